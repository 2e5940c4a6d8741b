"""Flax (linen) U-Net built from a shared spec, with per-block rematerialisation (`nn.remat`)."""

from jax_impl.diffusers_io import from_diffusers
from jax_impl.unet import UNet

__all__ = ["UNet", "from_diffusers"]
