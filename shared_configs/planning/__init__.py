"""Planning to a memory budget, framework-free: the per-unit profile and peak model (`budget`,
`timeline`), recompute time (`recompute_time`, `unit_flops`), the exact solver (`solver`), and the
pipeline from a workload and a budget to a checked plan (`planner`: profile, cached, solve, check).

Training code calls `torch_impl.plan_for_budget` or `jax_impl.plan_for_budget` (or this package's,
with ``framework=``); the benchmark's plan command is the CLI over the same `planner.plan`.
"""

from shared_configs.planning.planner import Planned, Workload, plan, plan_for_budget

__all__ = ["Planned", "Workload", "plan", "plan_for_budget"]
