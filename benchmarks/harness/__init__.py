"""The parent side of a benchmark: jobs, the framework worker processes it starts, their rows.

No torch or jax import: the parent stays free of both runtimes.
"""
