"""Fused Triton kernels. Every module here imports cleanly without triton installed."""
