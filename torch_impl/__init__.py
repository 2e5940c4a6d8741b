"""PyTorch U-Net built from a shared spec, with per-block gradient checkpointing, and the planner's
call for it: ``plan_for_budget(spec, batch_size, budget_bytes, sample_size=None, ...)`` returns the
policy string of the cheapest plan whose torch step fits the budget. ``apply_plan(model, plan)`` /
``remove_plan(model)`` put a plan on diffusers' own U-Nets too (`torch_impl.diffusers_plan`)."""

from shared_configs.planning.planner import for_framework
from torch_impl.diffusers_plan import apply_plan, remove_plan
from torch_impl.unet import UNet

plan_for_budget = for_framework("torch")

__all__ = ["UNet", "apply_plan", "plan_for_budget", "remove_plan"]
