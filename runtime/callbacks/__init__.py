"""Training callbacks, one per file."""
