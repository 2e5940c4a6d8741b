"""Load diffusers U-Net and ControlNet weights into our PyTorch models, and export ours in diffusers' names.

A source is a local model folder, a repo id in the local Hugging Face cache (never downloaded), or a
live diffusers module (`shared_configs.diffusers.folders`); diffusers itself is never imported.
Mirror: `jax_impl/diffusers_io.py`. Docs: docs/diffusers.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from shared_configs.controlnet import ControlNetSpec
from shared_configs.diffusers.controlnet_config import controlnet_to_diffusers_config
from shared_configs.diffusers.export import to_diffusers_config
from shared_configs.diffusers.folders import check_weights, is_path, read_source
from shared_configs.diffusers.folders import ours_to_diffusers as _ours_to_diffusers
from shared_configs.files import atomic_write

if TYPE_CHECKING:  # the models call this module (UNet.from_diffusers, ...): it imports neither at run time
    from torch_impl.controlnet import ControlNet
    from torch_impl.unet import UNet

    Model = UNet | ControlNet

Source = str | os.PathLike[str] | Any  # a folder path, or a live diffusers UNet2D(Condition)Model / ControlNetModel
M = TypeVar("M", bound=torch.nn.Module)


def from_diffusers(
    cls: type[M],
    source: Source,
    variant: str | None = None,
    *,
    subfolder: str | None = None,
    dtype: torch.dtype | None = None,
    revision: str | None = None,
    controlnet: bool = False,
) -> M:
    """Our ``cls`` (`torch_impl.UNet`, or with ``controlnet`` `torch_impl.ControlNet`) in ``dtype`` (default
    float32), eval mode, with the weights of a diffusers model; ``variant="fp16"`` reads ``*.fp16.safetensors``."""
    spec, state = read_source(source, variant, _read_file, subfolder, revision)  # as stored: dtype unchanged
    what = str(source) if is_path(source) else type(source).__name__
    if controlnet and not isinstance(spec, ControlNetSpec):
        raise ValueError(f"{what} is a diffusers U-Net, not a ControlNetModel: load it with UNet.from_diffusers")
    if not controlnet and isinstance(spec, ControlNetSpec):
        raise ValueError(f"{what} is a diffusers ControlNetModel: load it with ControlNet.from_diffusers")
    return _build(cls, spec, state, source, dtype)


def _build(cls: type[M], spec: Any, state: dict[str, torch.Tensor], source: Source, dtype: Any) -> M:
    """``cls(spec)`` built on the meta device, taking the loaded tensors (so the weights are held once)."""
    if not is_path(source):  # a live module's tensors: copy, or both models would share them
        state = {k: v.detach().clone() for k, v in state.items()}
    with torch.device("meta"):
        model = cls(spec)
    check_weights(
        {k: tuple(v.shape) for k, v in state.items()}, {k: tuple(v.shape) for k, v in model.state_dict().items()}, spec
    )
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(dtype or torch.float32).eval()


def to_diffusers_state_dict(model: Model) -> dict[str, torch.Tensor]:
    """Our state_dict in diffusers' names: ``load_state_dict(strict=True)`` into the diffusers model."""
    return _ours_to_diffusers(model.state_dict())


def save_diffusers(model: Model, folder: str | os.PathLike[str]) -> Path:
    """Write a diffusers model folder that ``from_pretrained`` reads (`SpecError` if the spec has no equivalent)."""
    from safetensors.torch import save

    spec = model.spec
    config = controlnet_to_diffusers_config(spec) if isinstance(spec, ControlNetSpec) else to_diffusers_config(spec)
    state = {k: v.detach().contiguous() for k, v in to_diffusers_state_dict(model).items()}
    root = Path(folder)
    atomic_write(root / "diffusion_pytorch_model.safetensors", save(state, metadata={"format": "pt"}))
    atomic_write(root / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    return root


def _read_file(file: os.PathLike[str]) -> dict[str, torch.Tensor]:
    if str(file).endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(file)
    return torch.load(file, map_location="cpu", weights_only=True)
