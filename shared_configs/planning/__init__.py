"""Planning to a memory budget, framework-free: the profile and peak model (`budget`), recompute time
(`recompute_time`, `unit_flops`), the exact solver (`solver`), and `pipeline.plan`, from a workload and a budget to a
checked plan (what `torch_impl.plan_for_budget`, `jax_impl.plan_for_budget` and the plan command call).
"""

from shared_configs.planning.pipeline import Planned, Workload, plan, plan_for_budget

__all__ = ["Planned", "Workload", "plan", "plan_for_budget"]
