"""Measurement: memory and time of a training step per framework and checkpoint policy.

Entry point: ``python -m benchmarks.compare --help``. The modules here are the commands
(``compare``, ``plan``, ``max_batch``, ``estimates``, ``saved``, ``candidates_sweep``,
``gpu_check``); behind them:

* `benchmarks.harness`: the parent process's side: jobs, starting the framework workers,
  collecting their rows (no torch or jax import);
* `benchmarks.backends`: the worker processes, one framework each, measuring the training loops'
  own steps with the instruments of `torch_impl.memory` and `jax_impl.memory`;
* `benchmarks.reports`: rows into tables, JSON/CSV and pictures.

The planner's measuring half is not here: it lives with each framework (`torch_impl.profile`,
`jax_impl.profile`).
"""
