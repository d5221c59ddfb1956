"""Run analysis tools: ``python -m analysis.<tool> RUN_DIR``."""
