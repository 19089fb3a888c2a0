"""Evaluation: average pass@1 over k samples."""
