"""What the tests share, by topic (frameworks are imported only by the modules that need them):

- `specs`: `tiny`, its random variants, the hub configs, random planner profiles, `FAST_COMPILE`;
- `tensors`: relative errors, named inputs as torch or Flax arrays, perturbed weights, FLOPs;
- `policies`: loss and gradients under a policy, and the check that every policy gives `none`'s;
- `parity`: a torch variant and its Flax twin; `diffusers_ref`: diffusers' model as the reference;
- `training`: seeded models and curves, the training CLIs' flags (`train_argv`), run folders;
- `processes`: `benchmarks.compare`, torchrun, JAX on two devices, runs signalled from outside.
"""
