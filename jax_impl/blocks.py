"""Down, middle and up blocks in Flax linen: the units a checkpoint plan names. Mirrors `torch_impl/blocks.py`.

Blocks get their layers' factories from the U-Net assembly and know nothing of the spec. ``unit`` is the
block's plan name (``down.1``), ``plan`` the U-Net's: `checkpointing.build` asks it about each layer.
Call arguments are positional with ``train`` last, so that `nn.remat` can mark it static.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from jax_impl.checkpointing import build
from jax_impl.layers import Downsample, Upsample
from shared_configs.vocabulary import CheckpointPlan

ResnetFactory = Callable[..., nn.Module]  # (in_ch, out_ch, resample="none") -> ResnetBlock
AttentionFactory = Callable[[int], nn.Module]  # ch -> SelfAttention | Transformer2D | SimpleCrossAttention
Array = jax.Array
Context = Array | None
Mask = Array | None  # the context mask as a score bias (`jax_impl.layers.mask_bias`)


def _layer(block: nn.Module, kind: str, j: int, factory: Callable[..., nn.Module], *args: int) -> nn.Module:
    """Layer ``j`` of ``kind`` (``resnets``, ``attentions``) in ``block``, as its plan says."""
    return build(factory, f"{block.unit}.{kind}.{j}", block.plan, *args)


def _attentions(block: nn.Module, factory: AttentionFactory | None, ch: int, count: int) -> list | None:
    return None if factory is None else [_layer(block, "attentions", j, factory, ch) for j in range(count)]


class DownBlock(nn.Module):
    """``layers`` ResNets (each followed by attention if any), then a strided conv or a pooling ResNet, if any."""

    in_ch: int
    out_ch: int
    layers: int
    make_resnet: ResnetFactory
    make_attention: AttentionFactory | None
    downsample_padding: int | None
    resnet_resample: bool = False
    unit: str = ""
    plan: CheckpointPlan | None = None

    def setup(self) -> None:
        self.resnets = [
            _layer(self, "resnets", j, self.make_resnet, self.out_ch if j else self.in_ch, self.out_ch)
            for j in range(self.layers)
        ]
        self.attentions = _attentions(self, self.make_attention, self.out_ch, self.layers)
        pad, ch = self.downsample_padding, self.out_ch
        self.downsample = None
        if pad is not None:
            self.downsample = self.make_resnet(ch, ch, resample="down") if self.resnet_resample else Downsample(ch, pad)

    def __call__(
        self, x: Array, temb: Array, context: Context, mask: Mask = None, train: bool = False
    ) -> tuple[Array, ...]:
        """Returns the skips of this level; the last one is the block's output."""
        skips = []
        for j, resnet in enumerate(self.resnets):
            x = resnet(x, temb, train)
            if self.attentions is not None:
                x = self.attentions[j](x, context, mask)
            skips.append(x)
        if self.downsample is not None:
            skips.append(self.downsample(x, temb, train))
        return tuple(skips)


class MidBlock(nn.Module):
    """ResNet, attention (optional), ResNet at the lowest resolution."""

    ch: int
    make_resnet: ResnetFactory
    make_attention: AttentionFactory | None
    unit: str = ""
    plan: CheckpointPlan | None = None

    def setup(self) -> None:
        self.resnets = [_layer(self, "resnets", j, self.make_resnet, self.ch, self.ch) for j in range(2)]
        self.attentions = _attentions(self, self.make_attention, self.ch, 1)

    def __call__(self, x: Array, temb: Array, context: Context, mask: Mask = None, train: bool = False) -> Array:
        x = self.resnets[0](x, temb, train)
        if self.attentions is not None:
            x = self.attentions[0](x, context, mask)
        return self.resnets[1](x, temb, train)


class UpBlock(nn.Module):
    """One ResNet per skip (input concatenated with it), each followed by attention if any, then an upsample."""

    in_ch: int
    out_ch: int
    skip_channels: tuple[int, ...]
    make_resnet: ResnetFactory
    make_attention: AttentionFactory | None
    add_upsample: bool  # torch's `upsample` argument; here that name is the submodule's
    resnet_resample: bool = False
    unit: str = ""
    plan: CheckpointPlan | None = None

    def setup(self) -> None:
        self.resnets = [
            _layer(self, "resnets", j, self.make_resnet, (self.out_ch if j else self.in_ch) + s, self.out_ch)
            for j, s in enumerate(self.skip_channels)
        ]
        self.attentions = _attentions(self, self.make_attention, self.out_ch, len(self.skip_channels))
        self.upsample = None
        if self.add_upsample:
            ch = self.out_ch
            self.upsample = self.make_resnet(ch, ch, resample="up") if self.resnet_resample else Upsample(ch)

    def __call__(
        self, x: Array, skips: Sequence[Array], temb: Array, context: Context, mask: Mask = None, train: bool = False
    ) -> Array:
        """``skips`` in the order they were produced; consumed last first."""
        for j, resnet in enumerate(self.resnets):
            x = resnet(jnp.concatenate([x, skips[-1 - j]], axis=-1), temb, train)
            if self.attentions is not None:
                x = self.attentions[j](x, context, mask)
        return self.upsample(x, temb, train) if self.upsample is not None else x
