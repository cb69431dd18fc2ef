"""kiln: from raw text to a trained, evaluated language model, PyTorch-native."""

__version__ = "0.1.0"
