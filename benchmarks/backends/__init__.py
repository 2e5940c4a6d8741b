"""The framework workers' side: `benchmarks.backends.worker` measures rows with one framework's backend
(`torch_bench`, `jax_bench`, `compiled_bench`, `diffusers_bench`)."""
