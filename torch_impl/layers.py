"""U-Net layers in PyTorch (NCHW), each taking only the numbers it needs. Mirror: `jax_impl/layers.py`."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from shared_configs.arch import (
    ClassEmbeddingArgs,
    NormArgs,
    ResnetArgs,
    SelfAttentionArgs,
    TransformerArgs,
    timestep_frequencies,
)

Mask = torch.Tensor | None  # a context mask as a score bias (`mask_bias`)


def timestep_embedding(
    t: torch.Tensor, dim: int, flip_sin_to_cos: bool, freq_shift: float, max_period: float
) -> torch.Tensor:
    """Sinusoidal timestep features, (B,) -> (B, dim), as diffusers' `get_timestep_embedding`."""
    freqs = torch.from_numpy(timestep_frequencies(dim, freq_shift, max_period)).to(t.device)
    args = t.float()[:, None] * freqs[None]
    sin, cos = torch.sin(args), torch.cos(args)
    emb = torch.cat([cos, sin] if flip_sin_to_cos else [sin, cos], dim=-1)
    return F.pad(emb, (0, dim % 2))


# Norm kinds of the spec -> constructor (ch, args); the same keys as in Flax.
NORM: dict[str, Callable[[int, NormArgs], nn.Module]] = {
    "group": lambda ch, a: nn.GroupNorm(a.groups, ch, eps=a.eps),
    "batch": lambda ch, a: nn.BatchNorm2d(ch, eps=a.eps, momentum=a.momentum),
}


def norm_layer(ch: int, args: NormArgs) -> nn.Module:
    """The ResNet / output norm of kind ``args.norm`` (`shared_configs.arch.norm_args`)."""
    return NORM[args.norm](ch, args)


class TimestepEmbedding(nn.Module):
    """Two-layer MLP on the sinusoidal features; ``cond`` (LCM's ``timestep_cond``) is projected onto them first."""

    def __init__(self, in_dim: int, dim: int, cond_dim: int | None = None) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.cond_proj = nn.Linear(cond_dim, in_dim, bias=False) if cond_dim else None
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        if cond is not None and self.cond_proj is not None:
            x = x + self.cond_proj(cond)
        return self.linear_2(F.silu(self.linear_1(x)))


# Class embedding kinds of the spec -> diffusers' ``class_embedding`` layer; the same keys as in Flax.
# ``timestep`` runs on the labels' sinusoids (the U-Net computes them); ``identity`` has no layer.
CLASS_EMBEDDING: dict[str, Callable[[ClassEmbeddingArgs], nn.Module | None]] = {
    "embedding": lambda a: nn.Embedding(a.num_classes, a.dim),
    "timestep": lambda a: TimestepEmbedding(a.sinusoid_dim, a.dim),
    "identity": lambda a: None,
    "projection": lambda a: TimestepEmbedding(a.input_dim, a.dim),
    "simple_projection": lambda a: nn.Linear(a.input_dim, a.dim),
}


# A ResNet that resamples (diffusers' ``down=True`` / ``up=True``): 2x2 average pool or nearest 2x.
_RESAMPLE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "down": functools.partial(F.avg_pool2d, kernel_size=2, stride=2),
    "up": functools.partial(F.interpolate, scale_factor=2.0, mode="nearest"),
}


class ResnetBlock(nn.Module):
    """Norm-SiLU-conv twice, the timestep added (or scale/shift) between, a skip. ``resample`` ``"down"`` /
    ``"up"`` (diffusers' ResnetDownsample blocks): both paths pooled / upsampled after the first norm."""

    def __init__(self, in_ch: int, out_ch: int, args: ResnetArgs, resample: str = "none") -> None:
        super().__init__()
        self.args = args
        self.resample = _RESAMPLE.get(resample)  # "none": None
        self.norm1 = norm_layer(in_ch, args.norm)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.time_emb_proj = nn.Linear(args.temb_dim, out_ch * (2 if args.scale_shift else 1))
        self.norm2 = norm_layer(out_ch, args.norm)
        self.dropout = nn.Dropout(args.dropout_rate)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else None

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.norm1(x))
        if self.resample is not None:
            x, h = self.resample(x), self.resample(h)
        h = self.conv1(h)
        t = self.time_emb_proj(temb if self.args.skip_time_act else F.silu(temb))[:, :, None, None]
        if self.args.scale_shift:
            scale, shift = t.chunk(2, dim=1)
            h = self.norm2(h) * (1 + scale) + shift
        else:
            h = self.norm2(h + t)
        h = self.conv2(self.dropout(F.silu(h)))
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        return (skip + h) / self.args.output_scale


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, scale: float, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Multi-head attention on (B, T, heads*D) tensors; ``bias`` (B, 1, 1, S) is added to the scores (`mask_bias`)."""
    q, k, v = (rearrange(a, "b t (n d) -> b n t d", n=heads) for a in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    return rearrange(out, "b n t d -> b t (n d)")


class SelfAttention(nn.Module):
    """DDPM's spatial self-attention block: GroupNorm (none when ``groups=0``), q/k/v, attention, out, residual."""

    def __init__(self, ch: int, args: SelfAttentionArgs) -> None:
        super().__init__()
        self.heads, self.output_scale = args.heads, args.output_scale
        self.scale = args.scale or args.head_dim**-0.5
        self.group_norm = nn.GroupNorm(args.groups, ch, eps=args.eps) if args.groups else None
        inner = args.heads * args.head_dim
        self.to_q, self.to_k, self.to_v = (nn.Linear(ch, inner) for _ in range(3))
        self.to_out = nn.Linear(inner, ch)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, mask: Mask = None) -> torch.Tensor:
        del context, mask  # same call signature as Transformer2D; plain self-attention ignores them
        h = x if self.group_norm is None else self.group_norm(x)
        h = rearrange(h, "b c h w -> b (h w) c")
        h = attention(self.to_q(h), self.to_k(h), self.to_v(h), self.heads, self.scale)
        h = rearrange(self.to_out(h), "b (h w) c -> b c h w", h=x.shape[2])
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

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, mask: Mask = None) -> torch.Tensor:
        """``mask``: a (B, 1, 1, L) score bias over the context (`mask_bias`); only with ``context``."""
        ctx = x if context is None else context
        q, k, v = self.to_q(x), self.to_k(ctx), self.to_v(ctx)
        return self.to_out(attention(q, k, v, self.heads, self.scale, mask if context is not None else None))


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

    def forward(self, x: torch.Tensor, context: torch.Tensor | None, mask: Mask = None) -> torch.Tensor:
        x = self.attn1(self.norm1(x)) + x
        if self.attn2 is not None:
            x = self.attn2(self.norm2(x), context, mask) + x
        return self.ff(self.norm3(x)) + x


class Transformer2D(nn.Module):
    """SD's spatial transformer: GroupNorm, project in (to ``heads * head_dim``), blocks, project out, residual."""

    def __init__(self, ch: int, args: TransformerArgs) -> None:
        super().__init__()
        self.linear_projection = linear = args.linear_projection
        inner = args.heads * args.head_dim
        self.norm = nn.GroupNorm(args.groups, ch, eps=args.norm_eps)
        self.proj_in = nn.Linear(ch, inner) if linear else nn.Conv2d(ch, inner, 1)
        self.transformer_blocks = nn.ModuleList(
            TransformerBlock(inner, args.heads, args.ln_eps, args.scale, args.context_dim) for _ in range(args.depth)
        )
        self.proj_out = nn.Linear(inner, ch) if linear else nn.Conv2d(inner, ch, 1)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None, mask: Mask = None) -> torch.Tensor:
        height = x.shape[2]
        h = self.norm(x)
        if not self.linear_projection:
            h = self.proj_in(h)
        h = rearrange(h, "b c h w -> b (h w) c")
        if self.linear_projection:
            h = self.proj_in(h)
        for block in self.transformer_blocks:
            h = block(h, context, mask)
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

    def forward(self, x: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
        del temb  # the call signature of a resampling ResnetBlock
        if self.padding == 0:
            x = F.pad(x, (0, 1, 0, 1))
        return self.conv(x)


class Upsample(nn.Module):
    """Nearest-neighbour 2x, then a 3x3 conv."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x: torch.Tensor, temb: torch.Tensor | None = None) -> torch.Tensor:
        del temb  # the call signature of a resampling ResnetBlock
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def mask_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A (B, L) context mask (1 keep, 0 drop; bool or float) -> the (B, 1, 1, L) score bias diffusers
    adds, ``(1 - mask) * -10000`` (not -inf: a fully masked row stays finite, as there)."""
    return None if mask is None else ((1 - mask.to(dtype)) * -10000.0)[:, None, None, :]


# Attention kinds of the spec -> layer class; the same keys as in `jax_impl/layers.py` (the U-Net adds
# ``simple_cross``, `torch_impl.added_layers.SimpleCrossAttention`).
ATTENTION: dict[str, type[nn.Module]] = {"self": SelfAttention, "transformer": Transformer2D}
