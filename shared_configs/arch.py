"""What each block and layer is built with, derived once from the spec for both frameworks: both U-Net assemblies
loop over `down_blocks` / `up_blocks` and build layers from `block_resnet_args` / `attention_args`, the one arguments
object each layer of either framework takes after its channels, so the skip stack's channels are counted here alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shared_configs.spec import UNetSpec


@dataclass(frozen=True)
class BlockArgs:
    """One down or up block: its plan name, channels, attention kind and resampling."""

    name: str  # the plan's name: "down.1", "up.0", ...
    in_ch: int
    out_ch: int
    attention: str  # "none" | "self" | "transformer" | "simple_cross"
    level: int  # resolution level (0 = full); selects the number of heads
    skip_channels: tuple[int, ...] = ()  # up blocks: skips in the order they are consumed
    downsample_padding: int | None = None  # down blocks: None on the deepest level
    upsample: bool = False
    resnet_resample: bool = False  # a ResNet down/upsamples (spec.resampler == "resnet"), not a conv


def down_blocks(spec: UNetSpec) -> list[BlockArgs]:
    chans, n, resnet = spec.block_out_channels, spec.num_levels, spec.resampler == "resnet"
    return [
        BlockArgs(
            f"down.{i}",
            chans[max(i - 1, 0)],
            chans[i],
            attn,
            i,
            resnet_resample=resnet,
            downsample_padding=None if i == n - 1 else spec.downsample_padding,
        )
        for i, attn in enumerate(spec.down_attention)
    ]


def up_blocks(spec: UNetSpec) -> list[BlockArgs]:
    """Up blocks, deepest first; each consumes ``layers_per_block + 1`` skips off the stack: its level's."""
    chans, n, count = spec.block_out_channels, spec.num_levels, spec.layers_per_block + 1
    skips = [chans[0]] + [
        b.out_ch
        for b in down_blocks(spec)  # conv_in's, each ResNet's, each downsample's: `count` per level
        for _ in range(count - 1 + (b.downsample_padding is not None))
    ]
    return [
        BlockArgs(
            f"up.{n - 1 - level}",
            chans[min(level + 1, n - 1)],  # the block below's output (the middle block's at the deepest)
            chans[level],
            attn,
            level,
            skip_channels=tuple(reversed(skips[level * count : (level + 1) * count])),
            upsample=level > 0,
            resnet_resample=spec.resampler == "resnet",
        )
        for level, attn in zip(reversed(range(n)), spec.up_attention_resolved, strict=True)
    ]


@dataclass(frozen=True)
class NormArgs:
    """The ResNet / output norm (``norm_layer``'s arguments after the channels)."""

    norm: str  # "group" | "batch"
    groups: int
    eps: float
    momentum: float


@dataclass(frozen=True)
class ResnetArgs:
    """``ResnetBlock``'s arguments after in/out channels, in both frameworks."""

    temb_dim: int
    norm: NormArgs
    dropout_rate: float
    scale_shift: bool
    output_scale: float
    skip_time_act: bool = False


@dataclass(frozen=True)
class SelfAttentionArgs:
    """``SelfAttention``'s arguments after the channels. ``groups=0``: no GroupNorm."""

    heads: int
    head_dim: int
    groups: int
    eps: float
    scale: float | None
    output_scale: float


@dataclass(frozen=True)
class TransformerArgs:
    """``Transformer2D``'s arguments after the channels."""

    heads: int
    head_dim: int
    depth: int
    groups: int
    norm_eps: float
    ln_eps: float
    scale: float | None
    context_dim: int | None
    linear_projection: bool


ADDED_KV_NORM_EPS = 1e-5  # diffusers' Attention builds its GroupNorms with this eps, whatever norm_eps is


@dataclass(frozen=True)
class SimpleCrossAttentionArgs:
    """``SimpleCrossAttention``'s arguments after the channels (diffusers' added-KV ``Attention``)."""

    heads: int
    head_dim: int
    groups: int
    eps: float
    context_dim: int
    context_groups: int | None  # GroupNorm over the context (None: none)


@dataclass(frozen=True)
class ClassEmbeddingArgs:
    """The class embedding layer (`shared_configs.spec.ClassEmbeddingSpec`), into width ``dim``."""

    kind: str
    sinusoid_dim: int  # ``timestep``: width of the labels' sinusoids (the timestep's)
    dim: int
    num_classes: int | None
    input_dim: int | None


def norm_args(spec: UNetSpec) -> NormArgs:
    return NormArgs(spec.norm_kind, spec.norm_num_groups, spec.norm_eps, spec.norm_momentum)


def block_resnet_args(spec: UNetSpec, block: str) -> ResnetArgs:
    """The ResNets of ``block`` (``down.1``, ``mid``, ``up.0``), with the output scale and skip_time_act it reads."""
    if block == "mid":
        scale, skip = spec.mid_block_scale_factor, spec.resnet_skip_time_act and spec.mid_attention == "simple_cross"
    elif spec.resampler == "resnet":
        scale, skip = spec.resnet_out_scale_factor, spec.resnet_skip_time_act
    else:
        scale, skip = 1.0, False
    scale_shift = spec.resnet_time_scale_shift == "scale_shift"
    return ResnetArgs(spec.block_temb_dim, norm_args(spec), spec.dropout, scale_shift, scale, skip)


def attention_args(
    spec: UNetSpec, kind: str, level: int, block: str, output_scale: float = 1.0
) -> SelfAttentionArgs | TransformerArgs | SimpleCrossAttentionArgs:
    """The attention layer ``kind`` of ``block`` (``"down.1"``, ``"mid"``, ...) at ``level`` (``-1``: the middle)."""
    heads, head_dim = spec.attention_shape(block, level)
    if kind == "simple_cross":
        assert spec.cross_attention_dim is not None  # the spec requires it
        return SimpleCrossAttentionArgs(
            heads, head_dim, spec.norm_num_groups, ADDED_KV_NORM_EPS, spec.cross_attention_dim, spec.context_norm_groups
        )
    if kind == "self":
        mid_groups = spec.mid_attention_norm_groups if level == -1 else None
        groups = spec.norm_num_groups if mid_groups is None else mid_groups
        return SelfAttentionArgs(heads, head_dim, groups, spec.norm_eps, spec.attention_scale, output_scale)
    return TransformerArgs(
        heads,
        head_dim,
        spec.transformer_depth(level),
        spec.norm_num_groups,
        spec.transformer_norm_eps,
        spec.layer_norm_eps,
        spec.attention_scale,
        spec.cross_attention_dim,
        spec.use_linear_projection,
    )


def class_embedding_args(spec: UNetSpec) -> ClassEmbeddingArgs | None:
    ce = spec.class_embedding
    if ce is None:
        return None
    return ClassEmbeddingArgs(ce.kind, spec.block_out_channels[0], spec.time_embed_dim, ce.num_classes, ce.input_dim)


def timestep_frequencies(dim: int, freq_shift: float, max_period: float) -> np.ndarray:
    """The sinusoidal embedding's frequencies, (dim // 2,) float32, as diffusers' ``get_timestep_embedding`` rounds
    them, in numpy: both frameworks multiply by bit-identical constants (the network amplifies a 1-ulp difference)."""
    half = dim // 2
    exponent = np.float32(-math.log(max_period)) * np.arange(half, dtype=np.float32) / np.float32(half - freq_shift)
    return np.exp(exponent.astype(np.float64)).astype(np.float32)
