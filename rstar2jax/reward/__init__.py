"""Answer extraction and verification (binary reward)."""
