"""The commands that measure: memory and time of a training step per framework and checkpoint policy.

The modules here are the commands; `benchmarks.harness` is the parent side (no torch or jax import),
`benchmarks.backends` the framework workers, `benchmarks.reports` tables, files and plots. Docs:
docs/benchmark.md.
"""
