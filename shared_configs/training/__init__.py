"""What both training loops share, framework-free: the run's configuration and CLI (`config`), the
data sets and batches (`data`), the DDPM schedule and objectives (`ddpm`), the run's checkpoint plan,
``--policy``'s or ``--budget-mib``'s, resolved once (`run_plan`), the loop itself (`loop`),
run folders with locks and checkpoint records (`run_folder`, `manifest`) and the run's outputs
(`outputs`). `torch_impl.train` and `jax_impl.train` supply only the framework's step."""
