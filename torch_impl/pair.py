"""The ControlNet training step in PyTorch: a frozen `UNet` and the `ControlNet` trained on it.

As diffusers' ``train_controlnet.py``; one pair plan (`shared_configs.pair`) covers both networks'
units, and ``torch_impl.step.train_step`` trains the pair like a U-Net. Mirror: `jax_impl/pair.py`.
Docs: docs/training.md "Training a ControlNet", docs/guard.md.
"""

from __future__ import annotations

import torch
from torch import nn

from shared_configs import CheckpointPlan, UNetSpec
from shared_configs.pair import CONTROLNET, ControlNetPairSpec, PairPlan, example_pair_batch, split_pair_plan
from shared_configs.planning.units import HEAD, STEM
from shared_configs.training.data import Batch, example_batch
from torch_impl.controlnet import ControlNet
from torch_impl.diffusers_adapter import apply_plan, diffusers_spec
from torch_impl.unet import UNet
from torch_impl.wrappers import unwrap

Tensor = torch.Tensor
__all__ = ["ControlNetPair", "step_batch", "step_model", "trained_module", "unit_modules"]


class ControlNetPair(nn.Module):
    """The frozen ``unet`` and trained ``controlnet`` of ``pair_spec``, called as a U-Net with ``controlnet_cond``."""

    def __init__(self, pair_spec: ControlNetPairSpec, policy: str | PairPlan | None = None) -> None:
        super().__init__()
        self.pair_spec = pair_spec
        self.unet = UNet(pair_spec.unet)
        self.controlnet = ControlNet.from_unet(self.unet, **pair_spec.controlnet.model_dump(exclude={"name", "unet"}))
        self.unet.requires_grad_(False)
        self.enable_gradient_checkpointing(policy)

    @classmethod
    def of(cls, unet: nn.Module, controlnet: nn.Module) -> ControlNetPair:
        """The pair of a script's live networks (ours or diffusers', wrapped or not), as they are (or `ValueError`)."""
        unet, controlnet = unwrap(unet), unwrap(controlnet)
        pair = cls.__new__(cls)
        nn.Module.__init__(pair)
        pair.pair_spec = _live_pair_spec(unet, controlnet)
        pair.unet, pair.controlnet = unet, controlnet
        pair.plan = split_pair_plan(pair.pair_spec, None)
        return pair

    @property
    def spec(self) -> UNetSpec:
        return self.pair_spec.unet

    def enable_gradient_checkpointing(self, policy: str | PairPlan | None = "full") -> PairPlan:
        """Recompute the units the pair policy names, in either network; returns the split plan."""
        self.plan = split_pair_plan(self.pair_spec, policy)
        apply_plan(self.unet, self.plan.unet)  # ours, or diffusers' (a pair made by `of`)
        apply_plan(self.controlnet, self.plan.controlnet)
        return self.plan

    def train(self, mode: bool = True) -> ControlNetPair:
        """The ControlNet trains; the frozen U-Net stays in eval mode (diffusers loads it so)."""
        super().train(mode)
        self.unet.eval()
        return self

    def forward(
        self,
        x: Tensor,
        t: Tensor | float,
        context: Tensor | None = None,
        class_labels: Tensor | None = None,
        text_embeds: Tensor | None = None,
        time_ids: Tensor | None = None,
        controlnet_cond: Tensor | None = None,
        conditioning_scale: float = 1.0,
    ) -> Tensor:
        if controlnet_cond is None:
            raise ValueError("controlnet_cond: the ControlNet step needs its conditioning image (NCHW)")
        conditioning = {"class_labels": class_labels, "text_embeds": text_embeds, "time_ids": time_ids}
        down, mid = self.controlnet(x, t, context, controlnet_cond, conditioning_scale, **conditioning)
        return self.unet(
            x, t, context, **conditioning, down_block_additional_residuals=down, mid_block_additional_residual=mid
        )


def _live_pair_spec(unet: nn.Module, controlnet: nn.Module) -> ControlNetPairSpec:
    """The pair spec of a live U-Net and the ControlNet on it: the U-Net's spec, the ControlNet's own fields."""
    unet_spec, cn_spec = (
        (unet.spec, controlnet.spec)
        if isinstance(unet, UNet) and isinstance(controlnet, ControlNet)
        else (
            diffusers_spec(unet),
            diffusers_spec(controlnet, ("ControlNetModel",), "controlnet: expected", " or a torch_impl.ControlNet"),
        )
    )
    mine = cn_spec.unet
    for field in ("in_channels", "block_out_channels", "layers_per_block", "down_attention", "cross_attention_dim"):
        if getattr(mine, field) != (theirs := getattr(unet_spec, field)):
            raise ValueError(
                f"controlnet: its {field} {getattr(mine, field)!r} is not the U-Net's {theirs!r}; "
                "a ControlNet is made from its U-Net (from_unet)"
            )
    return ControlNetPairSpec(controlnet=cn_spec.model_copy(update={"unet": unet_spec}))


def unit_modules(model: UNet | ControlNetPair, unit: str, phase: str) -> list[nn.Module]:
    """The modules whose hooks mark ``unit``'s segment in ``phase`` ("fwd", "bwd"), in a U-Net or a pair."""
    if isinstance(model, ControlNetPair):
        if not unit.startswith(CONTROLNET):
            return unit_modules(model.unet, unit, phase)
        net, unit = model.controlnet, unit.removeprefix(CONTROLNET)
        ends = {
            STEM: [net.time_embedding, net.controlnet_cond_embedding, net.conv_in],
            HEAD: [*net.controlnet_down_blocks, net.controlnet_mid_block],
        }
    else:
        net = model
        ends = {STEM: [net.time_embedding, net.conv_in], HEAD: [net.conv_norm_out if phase == "fwd" else net.conv_out]}
    return ends.get(unit) or [net.get_submodule(unit)]


def trained_module(model: nn.Module) -> nn.Module:
    """What a step trains and a checkpoint holds: a pair's ControlNet (its frozen U-Net re-seeded), else ``model``."""
    return model.controlnet if isinstance(model, ControlNetPair) else model


def step_model(
    spec: UNetSpec | ControlNetPairSpec, policy: str | CheckpointPlan | PairPlan | None = None
) -> UNet | ControlNetPair:
    """What a step trains: the U-Net of ``spec``, or the ControlNet pair, under ``policy`` (None: the spec's own)."""
    return ControlNetPair(spec, policy) if isinstance(spec, ControlNetPairSpec) else UNet(spec, policy)


def step_batch(spec: UNetSpec | ControlNetPairSpec, batch_size: int, context_length: int) -> Batch:
    """The example batch it trains on (the pair's with its conditioning image)."""
    make = example_pair_batch if isinstance(spec, ControlNetPairSpec) else example_batch
    return make(spec, batch_size, context_length)
