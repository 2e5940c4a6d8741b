"""The framework workers: ``python -m benchmarks.backends.worker JOB_JSON`` imports one framework's
backend (`torch_bench`, `jax_bench`, `compiled_bench`, `diffusers_bench`) and measures its rows.
"""
