"""The parent side of a benchmark: jobs, the worker processes it starts, their rows (no torch or jax import)."""
