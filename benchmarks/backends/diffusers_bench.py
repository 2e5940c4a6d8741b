"""diffusers' own U-Net, with and without its ``enable_gradient_checkpointing()`` (each ResNet and
transformer layer recomputed: close to our ``layers``), and under our plans (`torch_impl.apply_plan`),
measured as `benchmarks.backends.torch_bench` measures ours. Built from the spec's diffusers config (or
the folder's) with our U-Net's starting weights: every row trains the same network from the same numbers.
"""

from __future__ import annotations

from typing import Any

import diffusers
import torch

from benchmarks.backends import torch_bench
from benchmarks.harness.job import DIFFUSERS_OWN, Job, policy_arg
from shared_configs import to_diffusers_config
from shared_configs.diffusers.folders import find_folder
from torch_impl import apply_plan

BASE = torch_bench  # the worker takes what this module does not define from there


class DiffusersForward(torch.nn.Module):
    """Calls a diffusers U-Net as ours is called, ``model(x, t, context, class_labels, text_embeds, time_ids)``."""

    def __init__(self, unet: torch.nn.Module) -> None:
        super().__init__()
        self.unet = unet

    def forward(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        context: torch.Tensor | None = None,
        class_labels: torch.Tensor | None = None,
        text_embeds: torch.Tensor | None = None,
        time_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kwargs: dict[str, Any] = {"class_labels": class_labels}
        if "cross_attention_dim" in self.unet.config:  # UNet2DConditionModel
            kwargs["encoder_hidden_states"] = context
        if text_embeds is not None:  # SDXL's text_time conditioning
            kwargs["added_cond_kwargs"] = {"text_embeds": text_embeds, "time_ids": time_ids}
        return self.unet(x, t, return_dict=False, **kwargs)[0]


def build(job: Job, spec: Any, policy: str) -> torch.nn.Module:
    config = find_folder(job.config).config if job.source == "diffusers" else to_diffusers_config(spec)
    unet = getattr(diffusers, config["_class_name"]).from_config(config)
    unet.load_state_dict(torch_bench.our_unet(job, spec).to_diffusers_state_dict(), strict=True)
    if policy == DIFFUSERS_OWN:
        unet.enable_gradient_checkpointing()
    else:
        apply_plan(unet, policy_arg(policy))
    return DiffusersForward(unet)


def measure(job: Job, policy: str, batch_size: int, device: torch.device) -> dict[str, Any]:
    return torch_bench.measure(job, policy, batch_size, device, build=build)


VERSIONS = {**torch_bench.VERSIONS, "diffusers": diffusers.__version__}
