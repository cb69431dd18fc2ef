"""Privacy after training: canaries, memorization metrics, unlearning (docs/privacy.md)."""
