"""Load diffusers U-Net weights into our PyTorch U-Net, and export ours in diffusers' names.

A source is a local model folder (``config.json`` + ``diffusion_pytorch_model.safetensors`` or
``.bin``; sharded or ``variant`` files too; a pipeline folder's ``unet/`` is found) or a live
diffusers module. diffusers itself is never imported: a live module is read through its
``config`` and ``state_dict()``. Mirrored in `jax_impl/diffusers_io.py`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from shared_configs import UNetSpec
from shared_configs.diffusers import ours_to_diffusers as _ours_to_diffusers
from shared_configs.diffusers import read_source
from shared_configs.diffusers_export import to_diffusers_config
from shared_configs.files import atomic_write
from torch_impl.unet import UNet

Source = str | os.PathLike[str] | Any  # a folder path, or a live diffusers UNet2D(Condition)Model


def read_diffusers(source: Source, variant: str | None = None) -> tuple[UNetSpec, dict[str, torch.Tensor]]:
    """The spec and the state_dict (in our names, as stored: dtype unchanged) of a diffusers U-Net."""
    return read_source(source, variant, _read_file)


def from_diffusers(source: Source, variant: str | None = None) -> UNet:
    """Our `UNet` (float32, eval mode) with a diffusers U-Net's weights."""
    spec, state = read_diffusers(source, variant)
    model = UNet(spec)
    _check_keys(state, model.state_dict(), spec)
    model.load_state_dict(state, strict=True)
    return model.eval()


def to_diffusers_state_dict(model: UNet) -> dict[str, torch.Tensor]:
    """Our state_dict in diffusers' names: ``load_state_dict(strict=True)`` into the diffusers model."""
    return _ours_to_diffusers(model.state_dict())


def save_diffusers(model: UNet, folder: str | os.PathLike[str]) -> Path:
    """Write a diffusers model folder (``config.json`` + ``diffusion_pytorch_model.safetensors``).

    diffusers loads it with ``UNet2D(Condition)Model.from_pretrained(folder)``; so do our
    `from_diffusers` readers. Each file is written atomically. Raises `SpecError` when the spec
    has no diffusers equivalent (see `shared_configs.diffusers_export`).
    """
    from safetensors.torch import save

    config = to_diffusers_config(model.spec)
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


def _check_keys(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], spec: UNetSpec) -> None:
    """One clear line, in diffusers' names, instead of torch's list of every mismatch."""
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    if missing or extra:
        key = missing[0] if missing else extra[0]
        what = f"{'missing' if missing else 'unexpected'} {next(iter(_ours_to_diffusers({key: 0})))}"
        raise ValueError(
            f"diffusers weights do not match spec {spec.name!r}: {what} "
            f"({len(missing)} missing, {len(extra)} unexpected)"
        )
