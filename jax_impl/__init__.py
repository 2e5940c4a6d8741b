"""Flax (linen) U-Net built from a shared spec, with per-block rematerialisation (`nn.remat`), and
the planner's call for it: ``plan_for_budget(spec, batch_size, budget_bytes, sample_size=None, ...)``
returns the policy string of the cheapest plan whose JAX step fits the budget. Drop-ins for diffusers' removed
Flax classes, ``FlaxUNet2DConditionModel`` and ``FlaxControlNetModel`` (`jax_impl.diffusers_flax`), and their
budget on a script's step, ``fit_budget``, load on first use: importing them changes ``XLA_FLAGS``
(docs/flax_users.md), importing this package does not."""

import importlib
from typing import TYPE_CHECKING, Any

from jax_impl.diffusers_io import controlnet_from_diffusers, from_diffusers
from jax_impl.guard import GuardedStep, plan_for_step
from jax_impl.unet import UNet
from shared_configs.planning.pipeline import for_framework

if TYPE_CHECKING:  # for type checkers; at run time `__getattr__` imports them on first use
    from jax_impl.diffusers_flax import FlaxControlNetModel, FlaxUNet2DConditionModel
    from jax_impl.remat_budget import fit_budget

plan_for_budget = for_framework("jax")

_ON_USE = {
    "FlaxUNet2DConditionModel": "jax_impl.diffusers_flax",
    "FlaxControlNetModel": "jax_impl.diffusers_flax",
    "fit_budget": "jax_impl.remat_budget",
}


def __getattr__(name: str) -> Any:
    if name in _ON_USE:
        return getattr(importlib.import_module(_ON_USE[name]), name)
    raise AttributeError(f"module 'jax_impl' has no attribute {name!r}")


__all__ = [
    "FlaxControlNetModel",
    "FlaxUNet2DConditionModel",
    "GuardedStep",
    "UNet",
    "controlnet_from_diffusers",
    "fit_budget",
    "from_diffusers",
    "plan_for_budget",
    "plan_for_step",
]
