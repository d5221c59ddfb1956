"""Small building blocks shared by several components (norms, rotary embeddings)."""
