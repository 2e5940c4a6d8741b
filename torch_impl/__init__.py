"""PyTorch U-Net built from a shared spec, with per-block gradient checkpointing, and the planner's
call for it: ``plan_for_budget(spec, batch_size, budget_bytes, sample_size=None, ...)`` returns the
policy string of the cheapest plan whose torch step fits the budget. ``apply_plan(model, plan)`` /
``remove_plan(model)`` put a plan on diffusers' own U-Nets too (`torch_impl.diffusers_plan`), and
``plan_for_budget`` takes such a model in place of a spec: a diffusers training script gains a plan
in two lines::

    policy = torch_impl.plan_for_budget(unet, 4, 20 << 30, regime=Regime("bf16-mixed", "lora:8"))
    torch_impl.apply_plan(unet, policy)

``BudgetGuard(unet, budget_bytes, batch_size=4)`` does the same and then keeps the budget in the
user's own step: ``guard.run(step_fn, *args)`` measures it, re-plans, recovers from out-of-memory
errors (`torch_impl.guard`, docs/guard.md).

diffusers' ControlNet training step (a frozen U-Net, the ControlNet made from it trained) plans with
one policy over both networks' units (``controlnet.down.1``, ``up.0``; `shared_configs.pair`)::

    policy = torch_impl.plan_for_budget("sd_narrow", 8, 360 << 20, controlnet=True)
    pair = ControlNetPair(controlnet_pair("sd_narrow"), policy)   # or pair.enable_gradient_checkpointing(policy)
"""

from typing import Any

from torch import nn

from shared_configs.planning.planner import for_framework
from torch_impl.controlnet import ControlNet as ControlNet
from torch_impl.diffusers_plan import apply_plan, diffusers_spec, remove_plan
from torch_impl.guard import BudgetGuard
from torch_impl.pair import ControlNetPair
from torch_impl.unet import UNet

_plan_for_budget = for_framework("torch")


def plan_for_budget(spec: Any, batch_size: int, budget_bytes: int, sample_size: int | None = None, **kw: Any) -> str:
    """`shared_configs.planning.planner.plan_for_budget` for the torch step; ``spec``: a spec, a
    preset name, a spec file, our `UNet`, a live diffusers ``UNet2D(Condition)Model`` (its config),
    or a `ControlNetPair` (its step; ``controlnet=True`` with a U-Net spec: the same)."""
    if isinstance(spec, ControlNetPair):
        spec = spec.pair_spec
    elif isinstance(spec, nn.Module):
        spec = spec.spec if isinstance(spec, UNet) else diffusers_spec(spec)
    return _plan_for_budget(spec, batch_size, budget_bytes, sample_size, **kw)


__all__ = ["BudgetGuard", "ControlNetPair", "UNet", "apply_plan", "plan_for_budget", "remove_plan"]
