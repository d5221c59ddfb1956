"""Hugging Face checkpoints: key names, config.json, safetensors files, MXFP4 experts."""
