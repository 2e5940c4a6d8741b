"""The framework workers' side: `benchmarks.backends.worker`, run in a `shared_configs.planning.workers`
worker, imports one framework's backend (`torch_bench`, `jax_bench`, `compiled_bench`,
`diffusers_bench`) and measures its rows.
"""
