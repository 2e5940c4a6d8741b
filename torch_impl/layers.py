"""U-Net layers in PyTorch (NCHW). Mirrored name for name in `jax_impl/layers.py`.

Each layer takes only the numbers it needs; the U-Net assembly (`unet.py`) reads the spec.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from shared_configs.arch import ClassEmbeddingArgs, timestep_frequencies


def timestep_embedding(
    t: torch.Tensor, dim: int, flip_sin_to_cos: bool, freq_shift: float, max_period: float
) -> torch.Tensor:
    """Sinusoidal timestep features, (B,) -> (B, dim), as diffusers' `get_timestep_embedding`."""
    freqs = torch.from_numpy(timestep_frequencies(dim, freq_shift, max_period)).to(t.device)
    args = t.float()[:, None] * freqs[None]
    sin, cos = torch.sin(args), torch.cos(args)
    emb = torch.cat([cos, sin] if flip_sin_to_cos else [sin, cos], dim=-1)
    return F.pad(emb, (0, dim % 2))


def group_norm(ch: int, groups: int, eps: float, momentum: float) -> nn.GroupNorm:
    del momentum  # no running statistics
    return nn.GroupNorm(groups, ch, eps=eps)


def batch_norm(ch: int, groups: int, eps: float, momentum: float) -> nn.BatchNorm2d:
    del groups
    return nn.BatchNorm2d(ch, eps=eps, momentum=momentum)


# Norm kinds of the spec -> constructor (ch, groups, eps, momentum); the same keys as in Flax.
NORM: dict[str, Callable[[int, int, float, float], nn.Module]] = {"group": group_norm, "batch": batch_norm}


def norm_layer(ch: int, norm: str, groups: int, eps: float, momentum: float) -> nn.Module:
    """The ResNet / output norm of kind ``norm`` (``shared_configs.arch.norm_kwargs``)."""
    return NORM[norm](ch, groups, eps, momentum)


class TimestepEmbedding(nn.Module):
    """Two-layer MLP on the sinusoidal features."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


# Class embedding kinds of the spec -> the layer mapping ``class_labels`` to the time embedding's
# width (diffusers' ``class_embedding``); the same keys as in Flax. ``timestep`` runs on the labels'
# sinusoids (the U-Net computes them); ``identity`` adds the labels as they are, with no layer.
CLASS_EMBEDDING: dict[str, Callable[[ClassEmbeddingArgs], nn.Module | None]] = {
    "embedding": lambda a: nn.Embedding(a.num_classes, a.dim),
    "timestep": lambda a: TimestepEmbedding(a.sinusoid_dim, a.dim),
    "identity": lambda a: None,
    "projection": lambda a: TimestepEmbedding(a.input_dim, a.dim),
    "simple_projection": lambda a: nn.Linear(a.input_dim, a.dim),
}


class ResnetBlock(nn.Module):
    """Norm-SiLU-conv twice, the timestep added (or scale/shift) between, a skip.

    The norm is a GroupNorm (``norm="group"``) or a BatchNorm (``norm="batch"``, see `NORM`).
    """

    def __init__(
        self,
        in_ch: int,
        out_ch: int,
        temb_dim: int,
        groups: int,
        eps: float,
        dropout_rate: float,
        scale_shift: bool = False,
        output_scale: float = 1.0,
        norm: str = "group",
        momentum: float = 0.1,
    ) -> None:
        super().__init__()
        self.scale_shift, self.output_scale = scale_shift, output_scale
        self.norm1 = norm_layer(in_ch, norm, groups, eps, momentum)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.time_emb_proj = nn.Linear(temb_dim, out_ch * (2 if scale_shift else 1))
        self.norm2 = norm_layer(out_ch, norm, groups, eps, momentum)
        self.dropout = nn.Dropout(dropout_rate)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else None

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        t = self.time_emb_proj(F.silu(temb))[:, :, None, None]
        if self.scale_shift:
            scale, shift = t.chunk(2, dim=1)
            h = self.norm2(h) * (1 + scale) + shift
        else:
            h = self.norm2(h + t)
        h = self.conv2(self.dropout(F.silu(h)))
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        return (skip + h) / self.output_scale


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
    """Multi-head attention on (B, T, heads*D) tensors."""
    q, k, v = (rearrange(a, "b t (n d) -> b n t d", n=heads) for a in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, scale=scale)
    return rearrange(out, "b n t d -> b t (n d)")


class SelfAttention(nn.Module):
    """DDPM's spatial self-attention block: GroupNorm (none when ``groups=0``), q/k/v, attention, out, residual.

    The attention is ``heads * head_dim`` wide, which diffusers lets differ from ``ch``.
    """

    def __init__(
        self,
        ch: int,
        heads: int,
        head_dim: int,
        groups: int,
        eps: float,
        scale: float | None,
        output_scale: float = 1.0,
    ) -> None:
        super().__init__()
        self.heads, self.output_scale = heads, output_scale
        self.scale = scale or head_dim**-0.5
        self.group_norm = nn.GroupNorm(groups, ch, eps=eps) if groups else None
        inner = heads * head_dim
        self.to_q, self.to_k, self.to_v = (nn.Linear(ch, inner) for _ in range(3))
        self.to_out = nn.Linear(inner, ch)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        del context  # same call signature as Transformer2D; plain self-attention ignores it
        height = x.shape[2]
        h = x if self.group_norm is None else self.group_norm(x)
        h = rearrange(h, "b c h w -> b (h w) c")
        h = attention(self.to_q(h), self.to_k(h), self.to_v(h), self.heads, self.scale)
        h = rearrange(self.to_out(h), "b (h w) c -> b c h w", h=height)
        return (h + x) / self.output_scale


class CrossAttention(nn.Module):
    """Attention of a sequence over itself or over ``context`` (SD's attn1 / attn2)."""

    def __init__(self, dim: int, heads: int, scale: float | None, context_dim: int | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.scale = scale or (dim // heads) ** -0.5  # dim = heads * head_dim
        kv_dim = context_dim or dim
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(kv_dim, dim, bias=False)
        self.to_v = nn.Linear(kv_dim, dim, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:
        ctx = x if context is None else context
        return self.to_out(attention(self.to_q(x), self.to_k(ctx), self.to_v(ctx), self.heads, self.scale))


class FeedForward(nn.Module):
    """GEGLU feed-forward: proj to 2x inner, value * gelu(gate), project back."""

    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim * mult * 2)
        self.out = nn.Linear(dim * mult, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.proj(x).chunk(2, dim=-1)
        return self.out(value * F.gelu(gate))


class TransformerBlock(nn.Module):
    """Pre-norm self-attention, optional cross-attention, GEGLU feed-forward."""

    def __init__(self, dim: int, heads: int, eps: float, scale: float | None, context_dim: int | None) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn1 = CrossAttention(dim, heads, scale)
        self.norm2 = nn.LayerNorm(dim, eps=eps) if context_dim else None
        self.attn2 = CrossAttention(dim, heads, scale, context_dim) if context_dim else None
        self.norm3 = nn.LayerNorm(dim, eps=eps)
        self.ff = FeedForward(dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
        x = self.attn1(self.norm1(x)) + x
        if self.attn2 is not None:
            x = self.attn2(self.norm2(x), context) + x
        return self.ff(self.norm3(x)) + x


class Transformer2D(nn.Module):
    """SD's spatial transformer: GroupNorm, project in, transformer blocks, project out, residual.

    The transformer runs ``heads * head_dim`` wide (the projections map ``ch`` to it and back).
    """

    def __init__(
        self,
        ch: int,
        heads: int,
        head_dim: int,
        depth: int,
        groups: int,
        norm_eps: float,
        ln_eps: float,
        scale: float | None,
        context_dim: int | None,
        linear_projection: bool,
    ) -> None:
        super().__init__()
        self.linear_projection = linear_projection
        inner = heads * head_dim
        self.norm = nn.GroupNorm(groups, ch, eps=norm_eps)
        self.proj_in = nn.Linear(ch, inner) if linear_projection else nn.Conv2d(ch, inner, 1)
        self.transformer_blocks = nn.ModuleList(
            TransformerBlock(inner, heads, ln_eps, scale, context_dim) for _ in range(depth)
        )
        self.proj_out = nn.Linear(inner, ch) if linear_projection else nn.Conv2d(inner, ch, 1)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None) -> torch.Tensor:
        height = x.shape[2]
        h = self.norm(x)
        if not self.linear_projection:
            h = self.proj_in(h)
        h = rearrange(h, "b c h w -> b (h w) c")
        if self.linear_projection:
            h = self.proj_in(h)
        for block in self.transformer_blocks:
            h = block(h, context)
        if self.linear_projection:
            h = self.proj_out(h)
        h = rearrange(h, "b (h w) c -> b c h w", h=height)
        if not self.linear_projection:
            h = self.proj_out(h)
        return h + x


class Downsample(nn.Module):
    """Strided 3x3 conv; ``padding=0`` pads right/bottom only, as the original DDPM."""

    def __init__(self, ch: int, padding: int) -> None:
        super().__init__()
        self.padding = padding
        self.conv = nn.Conv2d(ch, ch, 3, stride=2, padding=padding)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.padding == 0:
            x = F.pad(x, (0, 1, 0, 1))
        return self.conv(x)


class Upsample(nn.Module):
    """Nearest-neighbour 2x, then a 3x3 conv."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


# Attention kinds of the spec -> layer class; the same keys as in `jax_impl/layers.py`.
ATTENTION: dict[str, type[nn.Module]] = {"self": SelfAttention, "transformer": Transformer2D}
