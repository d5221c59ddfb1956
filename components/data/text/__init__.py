"""Text in: documents from files and embedded sources, tokenizers, and prepared token folders."""
