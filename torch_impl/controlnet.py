"""The PyTorch ControlNet: the U-Net's encoder and middle block (`UNetTrunk`, the same code and
names), a conditioning embedding and zero convolutions. Mirror: `jax_impl/controlnet.py`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from shared_configs import CheckpointPlan
from shared_configs.controlnet import (
    ControlNetSpec,
    check_controlnet_inputs,
    controlnet_names,
    controlnet_residuals,
    residual_shapes,
    resolve_controlnet_plan,
)
from shared_configs.vocabulary import Policy
from torch_impl.unet import UNet, UNetTrunk

Tensor = torch.Tensor


def zero_conv(in_ch: int, out_ch: int, kernel: int = 1) -> nn.Conv2d:
    """A convolution whose weights and bias start at zero: a fresh ControlNet changes nothing."""
    conv = nn.Conv2d(in_ch, out_ch, kernel, padding=kernel // 2)
    nn.init.zeros_(conv.weight)
    nn.init.zeros_(conv.bias)
    return conv


class ConditioningEmbedding(nn.Module):
    """The conditioning image -> ``out_ch`` channels at the sample's size (``ControlNetConditioningEmbedding``)."""

    def __init__(self, in_ch: int, out_ch: int, widths: Sequence[int]) -> None:
        super().__init__()
        self.conv_in = nn.Conv2d(in_ch, widths[0], 3, padding=1)
        self.blocks = nn.ModuleList(
            c
            for a, b in itertools.pairwise(widths)
            for c in (nn.Conv2d(a, a, 3, padding=1), nn.Conv2d(a, b, 3, padding=1, stride=2))
        )
        self.conv_out = zero_conv(widths[-1], out_ch, 3)

    def forward(self, cond: Tensor) -> Tensor:
        h = F.silu(self.conv_in(cond))
        for conv in self.blocks:
            h = F.silu(conv(h))
        return self.conv_out(h)


class ControlNet(UNetTrunk):
    """ControlNet on NCHW input: the residuals a `UNet` adds, in diffusers' order. ``policy`` names units
    as the U-Net's (``full``: every down block and ``mid``), applied at construction like `UNet`'s."""

    def __init__(self, spec: ControlNetSpec, policy: Policy | CheckpointPlan = None) -> None:
        super().__init__()
        self.spec = spec
        self._build_trunk(spec.unet)
        unet = spec.unet
        self.controlnet_cond_embedding = ConditioningEmbedding(
            spec.conditioning_channels, unet.block_out_channels[0], spec.conditioning_embedding_out_channels
        )
        down, mid = residual_shapes(unet, 1, 2 ** (unet.num_levels - 1))
        self.controlnet_down_blocks = nn.ModuleList(zero_conv(shape[1], shape[1]) for shape in down)
        self.controlnet_mid_block = zero_conv(mid[1], mid[1])
        self.enable_gradient_checkpointing(policy)

    @classmethod
    def from_unet(cls, unet: UNet, **options: object) -> ControlNet:
        """A ControlNet on ``unet``'s spec with its encoder's weights; ``options``: other `ControlNetSpec` fields."""
        model = cls(ControlNetSpec(name=f"{unet.spec.name}_controlnet", unet=unet.spec, **options))
        trunk = {k: v for k, v in unet.state_dict().items() if not k.startswith(("up.", "conv_norm_out", "conv_out"))}
        unexpected = model.load_state_dict(trunk, strict=False).unexpected_keys
        assert not unexpected, f"from_unet: the trunk has no {unexpected[0]}"  # the names are the U-Net's
        return model

    def forward(
        self,
        sample: Tensor,
        timestep: Tensor | float,
        context: Tensor | None,
        controlnet_cond: Tensor,
        conditioning_scale: float = 1.0,
        class_labels: Tensor | None = None,
        text_embeds: Tensor | None = None,
        time_ids: Tensor | None = None,
        guess_mode: bool = False,
    ) -> tuple[list[Tensor], Tensor]:
        """The residuals for ``sample`` under the NCHW conditioning image ``controlnet_cond`` (B,
        conditioning_channels, H x f, W x f), f = `ControlNetSpec.conditioning_factor`.

        ``guess_mode`` scales the residuals from 0.1 (first) to 1 (the middle's), as diffusers does.
        """
        check_controlnet_inputs(
            self.spec,
            "NCHW",
            sample,
            timestep,
            controlnet_cond,
            context=context,
            class_labels=class_labels,
            text_embeds=text_embeds,
            time_ids=time_ids,
        )
        if self.spec.conditioning_channel_order == "bgr":
            controlnet_cond = torch.flip(controlnet_cond, dims=[1])
        temb = self._embedding(sample, timestep, class_labels, text_embeds, time_ids)
        h, skips = self._encode(sample, temb, context, hint=self.controlnet_cond_embedding(controlnet_cond))
        return controlnet_residuals(
            self.spec,
            h,
            skips,
            self.controlnet_down_blocks,
            self.controlnet_mid_block,
            conditioning_scale,
            guess_mode,
            pool=lambda r: r.mean(dim=(2, 3), keepdim=True),
        )

    def block_names(self, layers: bool = False) -> list[str]:
        """Names a checkpoint plan can use: ``down.*`` and ``mid``, or with ``layers=True`` their layers."""
        return controlnet_names(self.spec, layers)

    def resolve(self, policy: Policy | CheckpointPlan) -> CheckpointPlan:
        """Units as the U-Net's: ``down.*`` and ``mid`` (and their layers); ``up.*`` is refused."""
        return resolve_controlnet_plan(self.spec, policy)
