"""Load diffusers U-Net weights into our Flax U-Net (and export them back in diffusers' names).

Mirrors `torch_impl/diffusers_io.py`: a source is a local model folder (``config.json`` +
``diffusion_pytorch_model.safetensors`` or ``.bin``; sharded or ``variant`` files too; a
pipeline folder's ``unet/`` is found) or a live diffusers module. Reading safetensors needs
neither torch nor diffusers; a ``.bin`` file or a live module needs torch (which they imply).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_impl.convert import flax_to_torch, torch_to_flax
from jax_impl.unet import PolicyArg, UNet
from shared_configs import UNetSpec
from shared_configs.diffusers import ours_to_diffusers as _ours_to_diffusers
from shared_configs.diffusers import read_source

Source = str | os.PathLike[str] | Any  # a folder path, or a live diffusers UNet2D(Condition)Model


def read_diffusers(source: Source, variant: str | None = None) -> tuple[UNetSpec, dict[str, Any]]:
    """The spec and the state_dict (in our torch names; arrays or tensors) of a diffusers U-Net."""
    return read_source(source, variant, _read_file)


def from_diffusers(source: Source, policy: PolicyArg = None, variant: str | None = None) -> tuple[UNet, dict]:
    """``(module, params)``: our Flax `UNet` (with checkpoint ``policy``) and float32 ``params``.

    Use as ``module.apply({"params": params}, x_nhwc, t, context)``.
    """
    spec, state = read_diffusers(source, variant)
    return UNet(spec=spec, policy=policy), torch_to_flax(state, spec)  # checks every path and shape


def to_diffusers_state_dict(params: dict, spec: UNetSpec) -> dict[str, Any]:
    """Flax ``params`` -> torch tensors in diffusers' names (needs torch)."""
    return _ours_to_diffusers(flax_to_torch(params, spec))


def _read_file(file: Path) -> dict[str, Any]:
    if file.suffix == ".safetensors":
        from safetensors.flax import load_file  # handles bfloat16, which safetensors.numpy cannot

        return {k: _float32(v) for k, v in load_file(str(file)).items()}
    import torch  # a pickled .bin holds torch tensors

    return torch.load(file, map_location="cpu", weights_only=True)


def _float32(array: Any) -> np.ndarray:
    array = np.asarray(array)
    return array.astype(np.float32) if jnp.issubdtype(array.dtype, jnp.floating) else array  # bfloat16 too
