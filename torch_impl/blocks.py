"""Down, middle and up blocks in PyTorch: the units a checkpoint plan names.

Blocks receive factories for their layers from the U-Net assembly, so they know nothing of the
spec. Mirrored in `jax_impl/blocks.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from torch_impl.layers import Downsample, Mask, Upsample

ResnetFactory = Callable[..., nn.Module]  # (in_ch, out_ch, resample="none") -> ResnetBlock
AttentionFactory = Callable[[int], nn.Module]  # ch -> SelfAttention | Transformer2D | SimpleCrossAttention
Context = torch.Tensor | None


class DownBlock(nn.Module):
    """``layers`` ResNets (each then attention, if any), then a downsample: a strided conv or a pooling ResNet."""

    def __init__(
        self,
        in_ch: int,
        out_ch: int,
        layers: int,
        make_resnet: ResnetFactory,
        make_attention: AttentionFactory | None,
        downsample_padding: int | None,
        resnet_resample: bool = False,
    ) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(make_resnet(in_ch if j == 0 else out_ch, out_ch) for j in range(layers))
        self.attentions = nn.ModuleList(make_attention(out_ch) for _ in range(layers)) if make_attention else None
        self.downsample = None
        if downsample_padding is not None:
            self.downsample = (
                make_resnet(out_ch, out_ch, resample="down")
                if resnet_resample
                else Downsample(out_ch, downsample_padding)
            )

    def forward(
        self, x: torch.Tensor, temb: torch.Tensor, context: Context, mask: Mask = None
    ) -> tuple[torch.Tensor, ...]:
        """Returns the skips of this level; the last one is the block's output."""
        skips = []
        for j, resnet in enumerate(self.resnets):
            x = resnet(x, temb)
            if self.attentions is not None:
                x = self.attentions[j](x, context, mask)
            skips.append(x)
        if self.downsample is not None:
            skips.append(self.downsample(x, temb))
        return tuple(skips)


class MidBlock(nn.Module):
    """ResNet, attention (optional), ResNet at the lowest resolution."""

    def __init__(self, ch: int, make_resnet: ResnetFactory, make_attention: AttentionFactory | None) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([make_resnet(ch, ch), make_resnet(ch, ch)])
        self.attentions = nn.ModuleList([make_attention(ch)]) if make_attention else None

    def forward(self, x: torch.Tensor, temb: torch.Tensor, context: Context, mask: Mask = None) -> torch.Tensor:
        x = self.resnets[0](x, temb)
        if self.attentions is not None:
            x = self.attentions[0](x, context, mask)
        return self.resnets[1](x, temb)


class UpBlock(nn.Module):
    """One ResNet per skip (the input concatenated with it), each then attention, then upsample (or a ResNet's)."""

    def __init__(
        self,
        in_ch: int,
        out_ch: int,
        skip_channels: Sequence[int],
        make_resnet: ResnetFactory,
        make_attention: AttentionFactory | None,
        upsample: bool,
        resnet_resample: bool = False,
    ) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(
            make_resnet((out_ch if j else in_ch) + s, out_ch) for j, s in enumerate(skip_channels)
        )
        self.attentions = nn.ModuleList(make_attention(out_ch) for _ in skip_channels) if make_attention else None
        self.upsample = None
        if upsample:
            self.upsample = make_resnet(out_ch, out_ch, resample="up") if resnet_resample else Upsample(out_ch)

    def forward(
        self, x: torch.Tensor, skips: Sequence[torch.Tensor], temb: torch.Tensor, context: Context, mask: Mask = None
    ) -> torch.Tensor:
        """``skips`` in the order they were produced; consumed last first."""
        for j, resnet in enumerate(self.resnets):
            x = resnet(torch.cat([x, skips[-1 - j]], dim=1), temb)
            if self.attentions is not None:
                x = self.attentions[j](x, context, mask)
        return self.upsample(x, temb) if self.upsample is not None else x
