"""What both training loops share, framework-free: the run's configuration and CLI (`config`), data (`data`),
DDPM (`ddpm`), the run's plan (`run_plan`), the loop (`loop`), run folders and checkpoints (`run_folder`,
`manifest`) and outputs (`outputs`). `torch_impl.train` and `jax_impl.train` supply only the framework's step.
"""
