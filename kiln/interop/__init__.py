"""Interoperability with other ecosystems (Hugging Face `transformers` checkpoints)."""
