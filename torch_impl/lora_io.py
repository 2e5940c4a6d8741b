"""LoRA adapters in the format diffusers reads: ``pytorch_lora_weights.safetensors``.

peft's adapters (`torch_impl.regime.add_lora`) under diffusers' module names with the ``unet.`` prefix
a pipeline's ``load_lora_weights`` reads. Loading adds the adapters (rank read from the weights) where
there are none. Docs: docs/training.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from shared_configs.diffusers.folders import diffusers_to_ours, ours_to_diffusers
from shared_configs.files import atomic_write
from shared_configs.spec import SpecError

LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
PREFIX = "unet."


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights in diffusers' names, ``unet.``-prefixed (what `save_lora_weights` writes)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model) if hasattr(model, "peft_config") else {}
    if not state:
        raise SpecError("lora: the model has no LoRA adapters (train with --trainable lora:R, or add_lora)")
    return {PREFIX + k: v.detach().contiguous() for k, v in ours_to_diffusers(state).items()}


def save_lora_weights(model: nn.Module, folder: str | os.PathLike[str]) -> Path:
    """Write ``folder/pytorch_lora_weights.safetensors`` atomically; returns its path."""
    from safetensors.torch import save

    path = Path(folder) / LORA_WEIGHTS
    atomic_write(path, save(lora_state_dict(model), metadata={"format": "pt"}))
    return path


def load_lora_weights(model: nn.Module, source: str | os.PathLike[str]) -> nn.Module:
    """Load diffusers-format LoRA weights (a file or a folder) into ``model``, adding adapters if it has none."""
    from peft import set_peft_model_state_dict
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from torch_impl.regime import add_lora

    path = Path(source)
    path = path / LORA_WEIGHTS if path.is_dir() else path
    try:
        raw = load_file(path)
    except (OSError, SafetensorError) as err:
        raise SpecError(f"{path}: unreadable LoRA weights ({type(err).__name__}: {err})") from None
    state = diffusers_to_ours({k.removeprefix(PREFIX): v for k, v in raw.items() if k.startswith(PREFIX)})
    ranks = {v.shape[0] for k, v in state.items() if ".lora_A." in k}
    if len(ranks) != 1:
        raise SpecError(f"{path}: expected LoRA weights of one rank under {PREFIX!r}, found ranks {sorted(ranks)}")
    if not any("lora_" in name for name, _ in model.named_parameters()):
        add_lora(model, ranks.pop())
    result = set_peft_model_state_dict(model, state)
    if result.unexpected_keys:
        raise SpecError(
            f"{path}: {len(result.unexpected_keys)} LoRA weights match no adapter, e.g. {result.unexpected_keys[0]}"
        )
    return model
