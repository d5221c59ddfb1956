"""Residual-scheme tests (a package so that test module names do not clash with tests/ops)."""
