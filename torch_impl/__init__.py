"""PyTorch U-Net and ControlNet built from a shared spec, per-block checkpoint plans, and the planner.

``plan_for_budget(spec_or_model, batch_size, budget_bytes, ...)`` returns the cheapest plan whose torch
step fits; ``apply_plan`` / ``remove_plan`` put a plan on diffusers' own models; ``BudgetGuard`` keeps
a budget in the user's own step. Mirror: `jax_impl`. Docs: README.md, docs/planning.md, docs/guard.md.
"""

from typing import Any

from torch import nn

from shared_configs.planning.pipeline import for_framework
from torch_impl.controlnet import ControlNet as ControlNet
from torch_impl.diffusers_adapter import apply_plan, remove_plan
from torch_impl.guard import BudgetGuard
from torch_impl.guard_model import regime_seen, step_spec
from torch_impl.pair import ControlNetPair
from torch_impl.unet import UNet
from torch_impl.wrappers import unwrap

_plan_for_budget = for_framework("torch")


def plan_for_budget(spec: Any, batch_size: int, budget_bytes: int, sample_size: int | None = None, **kw: Any) -> str:
    """`shared_configs.planning.pipeline.plan_for_budget` for the torch step; ``spec``: a spec, a preset
    name, a spec file, or a model (wrapped or not) `torch_impl.guard_model.step_spec` reads; a model
    given without ``regime``: the regime its weights show."""
    if isinstance(spec, nn.Module):
        model = unwrap(spec)
        spec = step_spec(model)
        if "regime" not in kw:
            kw["regime"] = regime_seen(model)[0]
    return _plan_for_budget(spec, batch_size, budget_bytes, sample_size, **kw)


__all__ = ["BudgetGuard", "ControlNetPair", "UNet", "apply_plan", "plan_for_budget", "remove_plan"]
