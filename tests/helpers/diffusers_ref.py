"""Diffusers as the reference: its forward on our named inputs, our U-Net beside diffusers' own with the
same weights, a seeded exportable variant and its outputs, a Hugging Face hub cache laid out in a folder."""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared_configs import UNetSpec, to_diffusers_config
from shared_configs.inputs import example_inputs
from tests.helpers.specs import variant
from tests.helpers.tensors import as_torch, randomize_
from torch_impl import UNet

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the cached repos' one snapshot


def diffusers_forward(model: Any, inputs: dict[str, Any]) -> Any:
    """A diffusers ``UNet2DModel`` / ``UNet2DConditionModel`` on our named torch inputs (`as_torch`), no grad."""
    import torch

    kwargs: dict[str, Any] = {"class_labels": inputs.get("class_labels")}
    if type(model).__name__ == "UNet2DConditionModel":
        kwargs["encoder_hidden_states"] = inputs.get("context")
        if inputs.get("text_embeds") is not None:
            kwargs["added_cond_kwargs"] = {"text_embeds": inputs["text_embeds"], "time_ids": inputs["time_ids"]}
        if inputs.get("image_embeds") is not None:
            kwargs["added_cond_kwargs"] = {"image_embeds": inputs["image_embeds"]}
        for name in ("timestep_cond", "encoder_attention_mask"):
            kwargs[name] = inputs.get(name)
    with torch.no_grad():
        return model(inputs["x"], inputs["t"], **kwargs).sample


def diffusers_pair(spec: UNetSpec) -> tuple[UNet, torch.nn.Module]:
    """Our U-Net and diffusers' own, built from the spec's diffusers config, with the same weights."""
    import diffusers

    torch.manual_seed(0)
    ours = UNet(spec)
    config = to_diffusers_config(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = getattr(diffusers, config["_class_name"]).from_config(config)
    theirs.load_state_dict(ours.to_diffusers_state_dict(), strict=True)
    return ours, theirs


def seeded_variant(name: str) -> UNet:
    """A `tests.helpers.specs.variant` U-Net in eval mode with random (seeded) weights, biases included."""
    torch.manual_seed(0)
    model = UNet(variant(name)).eval()
    randomize_(model, seed=3)
    return model


def outputs(model: torch.nn.Module, spec: Any, diffusers: bool = False) -> torch.Tensor:
    """The model's output on fixed inputs (batch 2, 5 context tokens, timesteps 3 and 517)."""
    inputs = as_torch(example_inputs(spec, np.random.default_rng(1), batch=2, context_len=5))
    inputs["t"] = torch.tensor([3.0, 517.0])
    if diffusers:
        return diffusers_forward(model, inputs)
    with torch.no_grad():
        return model(**inputs)


def cache_repo(hub: Path, repo_id: str, files: Path, subfolder: str = "unet") -> Path:
    """Put ``files``' contents under ``hub`` as huggingface_hub caches a repo: blobs, a snapshot of links, refs/main."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT / subfolder
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in files.iterdir():
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return repo
