"""Load diffusers U-Net and ControlNet weights into our Flax modules (and export them in diffusers' names).

Mirrors `torch_impl/diffusers_io.py`; a source is a model or pipeline folder, a repo id in the local Hugging
Face cache (never downloaded) or a live module (`shared_configs.diffusers.folders`). Safetensors need neither
torch nor diffusers; a ``.bin`` file or a live module needs torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_impl.controlnet import ControlNet
from jax_impl.convert import Spec, flax_to_torch, torch_shapes, torch_to_flax
from jax_impl.unet import PolicyArg, UNet
from shared_configs.controlnet import ControlNetSpec
from shared_configs.diffusers.folders import check_weights, read_source
from shared_configs.diffusers.folders import ours_to_diffusers as _ours_to_diffusers

Source = str | os.PathLike[str] | Any  # a folder path, or a live diffusers UNet2D(Condition)Model / ControlNetModel


def from_diffusers(
    source: Source,
    policy: PolicyArg = None,
    variant: str | None = None,
    *,
    subfolder: str | None = None,
    dtype: Any = None,
    revision: str | None = None,
) -> tuple[UNet, dict]:
    """``(module, params)``: our Flax `UNet` (with checkpoint ``policy``) and ``params`` in ``dtype`` (default
    float32). ``source``: a folder, a cached repo id (``"org/name"``) or a live module; ``variant="fp16"``
    reads ``*.fp16.safetensors``."""
    return _load(UNet, source, policy, variant, subfolder, dtype, revision)


def controlnet_from_diffusers(
    source: Source,
    policy: PolicyArg = None,
    variant: str | None = None,
    *,
    subfolder: str | None = None,
    dtype: Any = None,
    revision: str | None = None,
) -> tuple[ControlNet, dict]:
    """As `from_diffusers`, for a diffusers ``ControlNetModel`` (in a pipeline folder, ``subfolder="controlnet"``)."""
    return _load(ControlNet, source, policy, variant, subfolder, dtype, revision)


def _load(
    cls: type[UNet | ControlNet],
    source: Source,
    policy: PolicyArg,
    variant: str | None,
    subfolder: str | None,
    dtype: Any,
    revision: str | None,
) -> tuple[Any, dict]:
    spec, state = read_source(source, variant, read_weights, subfolder, revision)  # state: in our torch names
    what = str(source) if isinstance(source, str | os.PathLike) else type(source).__name__
    if cls is UNet and isinstance(spec, ControlNetSpec):
        raise ValueError(f"{what} is a diffusers ControlNetModel: load it with controlnet_from_diffusers")
    if cls is ControlNet and not isinstance(spec, ControlNetSpec):
        raise ValueError(f"{what} is a diffusers U-Net, not a ControlNetModel: use from_diffusers")
    check_weights({k: tuple(np.shape(v)) for k, v in state.items()}, torch_shapes(spec), spec)
    params = torch_to_flax(state, spec)
    if dtype is not None:
        params = jax.tree.map(lambda v: np.asarray(v).astype(jnp.dtype(dtype)), params)
    return cls(spec=spec, policy=policy), params


def to_diffusers_state_dict(params: dict, spec: Spec) -> dict[str, Any]:
    """Flax ``params`` of a U-Net or a ControlNet -> torch tensors in diffusers' names (needs torch)."""
    return _ours_to_diffusers(flax_to_torch(params, spec))


def read_weights(file: Path) -> dict[str, Any]:
    """A diffusers weight file's tensors by their names: safetensors as float32 numpy arrays, a ``.bin`` (torch)."""
    if file.suffix == ".safetensors":
        from safetensors.flax import load_file  # handles bfloat16, which safetensors.numpy cannot

        arrays = {k: np.asarray(v) for k, v in load_file(str(file)).items()}  # floating ones (bfloat16 too) to float32
        return {k: a.astype(np.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for k, a in arrays.items()}
    import torch  # a pickled .bin holds torch tensors

    return torch.load(file, map_location="cpu", weights_only=True)
