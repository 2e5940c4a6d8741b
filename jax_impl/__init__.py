"""Flax (linen) U-Net built from a shared spec, with per-block rematerialisation (`nn.remat`), and
the planner's call for it: ``plan_for_budget(spec, batch_size, budget_bytes, sample_size=None, ...)``
returns the policy string of the cheapest plan whose JAX step fits the budget."""

from jax_impl.diffusers_io import controlnet_from_diffusers, from_diffusers
from jax_impl.guard import GuardedStep, plan_for_step
from jax_impl.unet import UNet
from shared_configs.planning.pipeline import for_framework

plan_for_budget = for_framework("jax")

__all__ = ["GuardedStep", "UNet", "controlnet_from_diffusers", "from_diffusers", "plan_for_budget", "plan_for_step"]
