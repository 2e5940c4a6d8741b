"""U-Net layers in Flax linen (NHWC). Mirrors `torch_impl/layers.py` class for class, name for name.

Submodules are assigned in ``setup()`` under the torch attribute names, so the parameter tree reads
like the torch ``state_dict`` (``resnets.0.conv1.weight`` <-> ``resnets_0/conv1/kernel``). Layers take
only the numbers they need (the U-Net assembly reads the spec), never Flax's default epsilons or scales.
Convs, Denses and norms have their outputs tagged (``"conv"``, ``"matmul"``, ``"norm"``) for remat
policies, and `norm_act` is a norm recomputed in the backward pass.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

from jax_impl.attention import attention
from jax_impl.lora import LoRADense
from shared_configs.arch import (
    ClassEmbeddingArgs,
    NormArgs,
    ResnetArgs,
    SelfAttentionArgs,
    TransformerArgs,
    timestep_frequencies,
)

Array = jax.Array
Mask = Array | None  # a context mask as a score bias (`mask_bias`)

# Torch pads 3x3 convs by 1 on each side; Flax's "SAME" pads bottom/right only at stride 2: padding is spelled out.
PAD_1 = ((1, 1), (1, 1))
PAD_0 = ((0, 0), (0, 0))


def tagged(cls: type[nn.Module], tag: str) -> type[nn.Module]:
    """``cls`` with its output tagged ``tag`` (`checkpoint_name`), the name a remat policy saves it by."""

    class Tagged(cls):
        def __call__(self, x: Array, *args: object, **kwargs: object) -> Array:
            return checkpoint_name(super().__call__(x, *args, **kwargs), tag)

    Tagged.__name__ = Tagged.__qualname__ = cls.__name__
    return Tagged


GroupNorm, LayerNorm = tagged(nn.GroupNorm, "norm"), tagged(nn.LayerNorm, "norm")


def group_norm(groups: int, eps: float) -> nn.GroupNorm:
    # use_fast_variance=False: E[(x - mean)^2] as torch, not E[x^2] - mean^2 (cancels badly).
    return GroupNorm(num_groups=groups, epsilon=eps, use_fast_variance=False)


def layer_norm(eps: float) -> nn.LayerNorm:
    return LayerNorm(epsilon=eps, use_fast_variance=False)


def batch_norm(eps: float, momentum: float) -> nn.BatchNorm:
    # ``momentum`` is torch's (the new batch's weight), Flax's the old average's; train mode is chosen per call.
    return nn.BatchNorm(momentum=1.0 - momentum, epsilon=eps, use_fast_variance=False)


# Norm kinds of the spec -> constructor; the same keys as in torch.
NORM: dict[str, Callable[[NormArgs], nn.Module]] = {
    "group": lambda a: group_norm(a.groups, a.eps),
    "batch": lambda a: batch_norm(a.eps, a.momentum),
}


def norm_layer(ch: int, args: NormArgs) -> nn.Module:
    """The ResNet / output norm of kind ``args.norm``."""
    del ch  # Flax infers it from the input; kept to mirror torch's signature
    return NORM[args.norm](args)


def norm_act(
    norm: nn.Module, x: Array, train: bool = False, silu: bool = False, film: tuple[Array, Array] | None = None
) -> Array:
    """``norm(x)``, then ``* (1 + scale) + shift`` with ``film=(scale, shift)``, then SiLU if ``silu``,
    recomputed from ``x`` in the backward pass: autodiff would keep x - mean and the SiLU's input and
    sigmoid, where torch's autograd keeps the norm's input and output. The parameter tree is unchanged,
    and a plan's ``save=norm`` still keeps the tagged output. Figures: docs/remat_vs_checkpoint.md."""

    def f(module: nn.Module, y: Array, film: tuple[Array, Array] | None) -> Array:
        # a BatchNorm uses (and updates) batch statistics in train mode, else its running ones
        y = module(y, use_running_average=not train) if isinstance(module, nn.BatchNorm) else module(y)
        if film is not None:
            y = y * (1 + film[0]) + film[1]
        return nn.silu(y) if silu else y

    return nn.checkpoint(f, prevent_cse=True)(norm, x, film)


def timestep_embedding(t: Array, dim: int, flip_sin_to_cos: bool, freq_shift: float, max_period: float) -> Array:
    """Sinusoidal timestep features, (B,) -> (B, dim), as diffusers' `get_timestep_embedding`."""
    freqs = jnp.asarray(timestep_frequencies(dim, freq_shift, max_period))
    args = t.astype(jnp.float32)[:, None] * freqs[None]
    sin, cos = jnp.sin(args), jnp.cos(args)
    return jnp.pad(jnp.concatenate([cos, sin] if flip_sin_to_cos else [sin, cos], axis=-1), ((0, 0), (0, dim % 2)))


# Remat tags: each op class of `shared_configs.vocabulary.OP_CLASSES` names the outputs torch's selective policy
# saves (bias included, as in torch's fused ops), so a plan's ``save`` becomes `save_only_these_names(*save)`.
Conv, Dense = tagged(nn.Conv, "conv"), tagged(nn.Dense, "matmul")


def projection(lora_rank: int | None) -> Callable[..., nn.Module]:
    """The attention projections' layer: `Dense`, or `LoRADense` of that rank."""
    return Dense if lora_rank is None else functools.partial(LoRADense, rank=lora_rank)


conv3x3 = functools.partial(Conv, kernel_size=(3, 3), padding=PAD_1)  # features -> the layer
conv1x1 = functools.partial(Conv, kernel_size=(1, 1), padding=PAD_0)


class TimestepEmbedding(nn.Module):
    """Two-layer MLP on the sinusoidal features, plus ``cond`` (LCM's ``timestep_cond``) projected without bias."""

    in_dim: int
    dim: int
    cond_dim: int | None = None

    def setup(self) -> None:
        self.linear_1 = Dense(self.dim)
        self.cond_proj = Dense(self.in_dim, use_bias=False) if self.cond_dim else None
        self.linear_2 = Dense(self.dim)

    def __call__(self, x: Array, cond: Array | None = None) -> Array:
        if cond is not None and self.cond_proj is not None:
            x = x + self.cond_proj(cond)
        return self.linear_2(nn.silu(self.linear_1(x)))


# Class embedding kinds of the spec -> diffusers' ``class_embedding`` layer (the same keys as torch's);
# ``timestep`` runs on the labels' sinusoids (the U-Net computes them), ``identity`` has no layer.
CLASS_EMBEDDING: dict[str, Callable[[ClassEmbeddingArgs], nn.Module | None]] = {
    "embedding": lambda a: nn.Embed(a.num_classes, a.dim),
    "timestep": lambda a: TimestepEmbedding(a.sinusoid_dim, a.dim),
    "identity": lambda a: None,
    "projection": lambda a: TimestepEmbedding(a.input_dim, a.dim),
    "simple_projection": lambda a: Dense(a.dim),
}


def _resample(x: Array, resample: str) -> Array:
    """2x2 average pool (``"down"``) or nearest 2x (``"up"``), as diffusers' resampling ResNets."""
    if resample == "down":
        b, h, w, c = x.shape
        return x.reshape(b, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))
    if resample == "up":
        return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
    return x


class ResnetBlock(nn.Module):
    """Norm-SiLU-conv twice, the timestep added (or scale/shift) between, a skip; with ``resample`` both paths
    are resampled after the first norm. ``train`` is positional: `nn.remat` marks it static."""

    in_ch: int
    out_ch: int
    args: ResnetArgs
    resample: str = "none"

    def setup(self) -> None:
        self.norm1 = norm_layer(self.in_ch, self.args.norm)
        self.conv1 = conv3x3(self.out_ch)
        self.time_emb_proj = Dense(self.out_ch * (2 if self.args.scale_shift else 1))
        self.norm2 = norm_layer(self.out_ch, self.args.norm)
        self.dropout = nn.Dropout(self.args.dropout_rate, rng_collection="dropout")
        self.conv2 = conv3x3(self.out_ch)
        self.conv_shortcut = conv1x1(self.out_ch) if self.in_ch != self.out_ch else None

    def __call__(self, x: Array, temb: Array, train: bool = False) -> Array:
        h = norm_act(self.norm1, x, train, silu=True)
        x, h = _resample(x, self.resample), _resample(h, self.resample)
        h = self.conv1(h)
        t = self.time_emb_proj(temb if self.args.skip_time_act else nn.silu(temb))[:, None, None, :]  # (B, 1, 1, C)
        film = tuple(jnp.split(t, 2, axis=-1)) if self.args.scale_shift else None  # scale and shift, or t added
        h = norm_act(self.norm2, h if self.args.scale_shift else h + t, train, silu=True, film=film)
        h = self.conv2(self.dropout(h, deterministic=not train))
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        return (skip + h) / self.args.output_scale


def _tokens(x: Array) -> Array:
    # NHWC -> (B, H*W, C): row-major over (h, w), the same token order as torch's "b c h w -> b (h w) c".
    return x.reshape(x.shape[0], -1, x.shape[-1])


class SelfAttention(nn.Module):
    """DDPM's spatial self-attention: GroupNorm (none when ``groups=0``), q/k/v, attention, out, residual."""

    ch: int
    args: SelfAttentionArgs
    query_chunk: int | None = None  # see `attention`
    lora_rank: int | None = None  # LoRA adapters on q/k/v/out (`LoRADense`)

    def setup(self) -> None:
        self.group_norm = group_norm(self.args.groups, self.args.eps) if self.args.groups else None
        inner, dense = self.args.heads * self.args.head_dim, projection(self.lora_rank)
        self.to_q, self.to_k, self.to_v = (dense(inner) for _ in range(3))
        self.to_out = dense(self.ch)

    def __call__(self, x: Array, context: Array | None = None, mask: Mask = None) -> Array:
        del context, mask  # same call signature as Transformer2D; plain self-attention ignores them
        h = _tokens(x if self.group_norm is None else norm_act(self.group_norm, x))
        scale = self.args.scale or self.args.head_dim**-0.5
        h = attention(self.to_q(h), self.to_k(h), self.to_v(h), self.args.heads, scale, self.query_chunk)
        h = self.to_out(h).reshape(x.shape)
        return (h + x) / self.args.output_scale


class CrossAttention(nn.Module):
    """Attention of a sequence over itself or over ``context`` (SD's attn1 / attn2)."""

    dim: int
    heads: int
    scale: float | None
    query_chunk: int | None = None  # see `attention`
    lora_rank: int | None = None  # LoRA adapters on q/k/v/out (`LoRADense`)

    def setup(self) -> None:
        dense = projection(self.lora_rank)  # no bias on q/k/v, as torch; Flax infers the context's width
        self.to_q, self.to_k, self.to_v = (dense(self.dim, use_bias=False) for _ in range(3))
        self.to_out = dense(self.dim)

    def __call__(self, x: Array, context: Array | None = None, mask: Mask = None) -> Array:
        """``mask``: a (B, 1, 1, L) score bias over the context (`mask_bias`); only with ``context``."""
        ctx = x if context is None else context
        scale = self.scale or (self.dim // self.heads) ** -0.5
        q, k, v = self.to_q(x), self.to_k(ctx), self.to_v(ctx)
        return self.to_out(
            attention(q, k, v, self.heads, scale, self.query_chunk, mask if context is not None else None)
        )


class FeedForward(nn.Module):
    """GEGLU feed-forward: proj to 2x inner, value * gelu(gate), project back."""

    dim: int
    mult: int = 4

    def setup(self) -> None:
        self.proj = Dense(self.dim * self.mult * 2)
        self.out = Dense(self.dim)

    def __call__(self, x: Array) -> Array:
        return self.out(geglu(self.proj(x)))


def gelu(x: Array) -> Array:
    """Exact GELU as torch's ``F.gelu``, written with erf: ``jax.nn.gelu(approximate=False)`` uses erfc,
    which leaves XLA:CPU more arrays live in its backward (and Flax's default is the tanh approximation)."""
    return 0.5 * x * (1.0 + jax.lax.erf(x * math.sqrt(0.5)))


@functools.partial(jax.checkpoint, prevent_cse=True)
def geglu(h: Array) -> Array:
    """``value * gelu(gate)`` of ``h``'s two halves, recomputed from ``h`` in the backward pass: autodiff
    would keep the GELU's intermediates, where torch's autograd keeps only ``gelu(gate)``."""
    value, gate = jnp.split(h, 2, axis=-1)
    return value * gelu(gate)


class TransformerBlock(nn.Module):
    """Pre-norm self-attention, optional cross-attention, GEGLU feed-forward."""

    dim: int
    heads: int
    eps: float
    scale: float | None
    context_dim: int | None
    query_chunk: int | None = None  # see `attention`
    lora_rank: int | None = None

    def setup(self) -> None:
        attn = functools.partial(CrossAttention, self.dim, self.heads, self.scale, self.query_chunk, self.lora_rank)
        self.norm1 = layer_norm(self.eps)
        self.attn1 = attn()
        self.norm2 = layer_norm(self.eps) if self.context_dim else None
        self.attn2 = attn() if self.context_dim else None
        self.norm3 = layer_norm(self.eps)
        self.ff = FeedForward(self.dim)

    def __call__(self, x: Array, context: Array | None, mask: Mask = None) -> Array:
        x = self.attn1(norm_act(self.norm1, x)) + x
        if self.attn2 is not None:
            x = self.attn2(norm_act(self.norm2, x), context, mask) + x
        return self.ff(norm_act(self.norm3, x)) + x


class Transformer2D(nn.Module):
    """SD's spatial transformer: GroupNorm, project in (to ``heads * head_dim``), blocks, project out, residual."""

    ch: int
    args: TransformerArgs
    query_chunk: int | None = None  # see `attention`
    lora_rank: int | None = None  # LoRA adapters on every attention's q/k/v/out

    def setup(self) -> None:
        # The same map in NHWC, but torch keeps 4-D conv weights without linear_projection: the tree mirrors them.
        project = Dense if self.args.linear_projection else conv1x1
        inner = self.args.heads * self.args.head_dim
        block = functools.partial(
            TransformerBlock, inner, self.args.heads, self.args.ln_eps, self.args.scale, self.args.context_dim
        )
        self.norm = group_norm(self.args.groups, self.args.norm_eps)
        self.proj_in = project(inner)
        self.transformer_blocks = [block(self.query_chunk, self.lora_rank) for _ in range(self.args.depth)]
        self.proj_out = project(self.ch)

    def __call__(self, x: Array, context: Array | None, mask: Mask = None) -> Array:
        # In NHWC the projections commute with flattening, so one order serves both variants.
        h = _tokens(self.proj_in(norm_act(self.norm, x)))  # (B, H*W, inner)
        for block in self.transformer_blocks:
            h = block(h, context, mask)
        return self.proj_out(h.reshape(*x.shape[:3], -1)) + x  # (B, H, W, inner) -> (B, H, W, C)


class Downsample(nn.Module):
    """Strided 3x3 conv; ``padding=0`` pads right/bottom only, as the original DDPM."""

    ch: int
    padding: int

    def setup(self) -> None:
        self.conv = Conv(self.ch, (3, 3), strides=(2, 2), padding=PAD_1 if self.padding == 1 else "VALID")

    def __call__(self, x: Array, temb: Array | None = None, train: bool = False) -> Array:
        del temb, train  # the call signature of a resampling ResnetBlock
        if self.padding == 0:
            x = jnp.pad(x, ((0, 0), (0, 1), (0, 1), (0, 0)))
        return self.conv(x)


class Upsample(nn.Module):
    """Nearest-neighbour 2x, then a 3x3 conv."""

    ch: int

    def setup(self) -> None:
        self.conv = conv3x3(self.ch)

    def __call__(self, x: Array, temb: Array | None = None, train: bool = False) -> Array:
        del temb, train  # the call signature of a resampling ResnetBlock
        return self.conv(_resample(x, "up"))  # (B, 2H, 2W, C)


def mask_bias(mask: Array | None, dtype: jnp.dtype) -> Array | None:
    """A (B, L) context mask (1 keep, 0 drop) -> diffusers' (B, 1, 1, L) score bias, finite as there."""
    return None if mask is None else ((1 - mask.astype(dtype)) * -10000.0)[:, None, None, :]


# Attention kinds of the spec -> layer class, with torch's keys (the U-Net adds ``simple_cross``).
ATTENTION: dict[str, type[nn.Module]] = {"self": SelfAttention, "transformer": Transformer2D}
