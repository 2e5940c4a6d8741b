"""U-Net layers in Flax linen (NHWC). Mirrors `torch_impl/layers.py` class for class, name for name.

Every submodule is assigned in ``setup()`` under the torch attribute name, so the parameter tree
reads like the torch ``state_dict``: ``resnets.0.conv1.weight`` <-> ``resnets_0/conv1/kernel``.
Each layer takes only the numbers it needs; the U-Net assembly (`unet.py`) reads the spec.
Norm epsilons and attention scales always come from the caller, never from Flax defaults.
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
from shared_configs.arch import ClassEmbeddingArgs, timestep_frequencies

Array = jax.Array

# Torch pads 3x3 convs by 1 on each side; Flax's "SAME" would agree at stride 1 but not at
# stride 2 (it pads bottom/right only), so padding is always spelled out.
PAD_1 = ((1, 1), (1, 1))
PAD_0 = ((0, 0), (0, 0))


def timestep_embedding(t: Array, dim: int, flip_sin_to_cos: bool, freq_shift: float, max_period: float) -> Array:
    """Sinusoidal timestep features, (B,) -> (B, dim), as diffusers' `get_timestep_embedding`."""
    freqs = jnp.asarray(timestep_frequencies(dim, freq_shift, max_period))
    args = t.astype(jnp.float32)[:, None] * freqs[None]
    sin, cos = jnp.sin(args), jnp.cos(args)
    emb = jnp.concatenate([cos, sin] if flip_sin_to_cos else [sin, cos], axis=-1)
    return jnp.pad(emb, ((0, 0), (0, dim % 2)))


# Remat tags: each op class of `shared_configs.plan.OP_CLASSES` names its outputs, so that a plan's
# ``save`` becomes `jax.checkpoint_policies.save_only_these_names(*save)` (see checkpointing.py).
# The tagged points are the outputs torch's selective policy saves (aten convolution, mm/addmm,
# SDPA, native_group/layer_norm), bias included as in torch's fused ops.
class Conv(nn.Conv):
    """`nn.Conv` with its output tagged ``"conv"``."""

    def __call__(self, inputs: Array) -> Array:
        return checkpoint_name(super().__call__(inputs), "conv")


class Dense(nn.Dense):
    """`nn.Dense` with its output tagged ``"matmul"``."""

    def __call__(self, inputs: Array) -> Array:
        return checkpoint_name(super().__call__(inputs), "matmul")


LORA_A, LORA_B = "lora_A", "lora_B"  # the adapters' module names (peft's, less ``.default``)
LORA_LEAVES = (LORA_A, LORA_B)


class LoRADense(nn.Module):
    """A Dense layer with a rank-``rank`` LoRA adapter, as peft's ``lora.Linear`` with ``lora_alpha``
    equal to the rank: ``x @ kernel + bias + (x @ lora_A) @ lora_B``. The base ``kernel``/``bias``
    keep the plain Dense's names (the same converted weights); ``lora_B`` starts at zero, so the
    outputs do not change until it trains. Output tagged ``"matmul"``."""

    features: int
    rank: int
    use_bias: bool = True

    @nn.compact
    def __call__(self, x: Array) -> Array:
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        y = jnp.matmul(x, kernel)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros_init(), (self.features,))
        # peft's init: A as torch's Linear default (uniform, bound 1/sqrt(fan_in)), B zero
        a_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")
        low = nn.Dense(self.rank, use_bias=False, kernel_init=a_init, name=LORA_A)(x)
        y = y + nn.Dense(self.features, use_bias=False, kernel_init=nn.initializers.zeros_init(), name=LORA_B)(low)
        return checkpoint_name(y, "matmul")


def projection(lora_rank: int | None) -> Callable[..., nn.Module]:
    """The attention projections' layer: `Dense`, or `LoRADense` of that rank."""
    return Dense if lora_rank is None else functools.partial(LoRADense, rank=lora_rank)


class GroupNorm(nn.GroupNorm):
    """`nn.GroupNorm` with its output tagged ``"norm"``."""

    def __call__(self, x: Array, *args: object, **kwargs: object) -> Array:
        return checkpoint_name(super().__call__(x, *args, **kwargs), "norm")


class LayerNorm(nn.LayerNorm):
    """`nn.LayerNorm` with its output tagged ``"norm"``."""

    def __call__(self, x: Array, *args: object, **kwargs: object) -> Array:
        return checkpoint_name(super().__call__(x, *args, **kwargs), "norm")


def group_norm(groups: int, eps: float) -> nn.GroupNorm:
    # use_fast_variance=False: E[(x - mean)^2] as torch, not E[x^2] - mean^2 (cancels badly).
    return GroupNorm(num_groups=groups, epsilon=eps, use_fast_variance=False)


def batch_norm(eps: float, momentum: float) -> nn.BatchNorm:
    # ``momentum`` is torch's (weight of the new batch); Flax's is the weight of the old average.
    # Running statistics live in the "batch_stats" collection; train mode is chosen per call.
    return nn.BatchNorm(momentum=1.0 - momentum, epsilon=eps, use_fast_variance=False)


# Norm kinds of the spec -> constructor (groups, eps, momentum); the same keys as in torch.
NORM: dict[str, Callable[[int, float, float], nn.Module]] = {
    "group": lambda groups, eps, momentum: group_norm(groups, eps),
    "batch": lambda groups, eps, momentum: batch_norm(eps, momentum),
}


def norm_layer(ch: int, norm: str, groups: int, eps: float, momentum: float) -> nn.Module:
    """The ResNet / output norm of kind ``norm`` (``shared_configs.arch.norm_kwargs``).

    ``ch`` is inferred by Flax from the input; it stays in the signature to mirror torch.
    """
    del ch
    return NORM[norm](groups, eps, momentum)


def apply_norm(norm: nn.Module, x: Array, train: bool) -> Array:
    """Call a `norm_layer`: a BatchNorm normalises with batch statistics (and updates its
    running ones) in train mode, with the running statistics otherwise; a GroupNorm ignores
    ``train``."""
    if isinstance(norm, nn.BatchNorm):
        return norm(x, use_running_average=not train)
    return norm(x)


def norm_act(
    norm: nn.Module, x: Array, train: bool = False, silu: bool = False, film: tuple[Array, Array] | None = None
) -> Array:
    """``norm(x)``, then ``* (1 + scale) + shift`` with ``film=(scale, shift)``, then SiLU if
    ``silu``; the backward pass recomputes all of it from ``x`` instead of keeping it.

    A norm's backward needs only its input and a few numbers per group, but autodiff keeps more
    (x - mean, for the variance; the SiLU's input and sigmoid), and XLA:CPU kept three or four
    full-size arrays per norm where torch's autograd keeps two (the norm's input and output). Under
    `nn.checkpoint` with no policy only ``x`` is kept: one more pass of elementwise work and a
    reduction per norm in the backward, beside convolutions and matmuls. The parameter tree is
    unchanged (the norm's own scope), and a plan's ``save=norm`` still keeps the tagged output
    inside (an enclosing remat's policy decides for the ones nested in it). Figures:
    docs/remat_vs_checkpoint.md.
    """

    def f(module: nn.Module, y: Array, film: tuple[Array, Array] | None) -> Array:
        y = apply_norm(module, y, train)
        if film is not None:
            y = y * (1 + film[0]) + film[1]
        return nn.silu(y) if silu else y

    return nn.checkpoint(f, prevent_cse=True)(norm, x, film)


def layer_norm(eps: float) -> nn.LayerNorm:
    return LayerNorm(epsilon=eps, use_fast_variance=False)


def conv3x3(features: int) -> nn.Conv:
    return Conv(features, (3, 3), padding=PAD_1)


def conv1x1(features: int) -> nn.Conv:
    return Conv(features, (1, 1), padding=PAD_0)


class TimestepEmbedding(nn.Module):
    """Two-layer MLP on the sinusoidal features."""

    in_dim: int
    dim: int

    def setup(self) -> None:
        self.linear_1 = Dense(self.dim)
        self.linear_2 = Dense(self.dim)

    def __call__(self, x: Array) -> Array:
        return self.linear_2(nn.silu(self.linear_1(x)))


# Class embedding kinds of the spec -> the layer mapping ``class_labels`` to the time embedding's
# width (diffusers' ``class_embedding``); the same keys as in torch. ``timestep`` runs on the labels'
# sinusoids (the U-Net computes them); ``identity`` adds the labels as they are, with no layer.
CLASS_EMBEDDING: dict[str, Callable[[ClassEmbeddingArgs], nn.Module | None]] = {
    "embedding": lambda a: nn.Embed(a.num_classes, a.dim),
    "timestep": lambda a: TimestepEmbedding(a.sinusoid_dim, a.dim),
    "identity": lambda a: None,
    "projection": lambda a: TimestepEmbedding(a.input_dim, a.dim),
    "simple_projection": lambda a: Dense(a.dim),
}


class ResnetBlock(nn.Module):
    """Norm-SiLU-conv twice, the timestep added (or scale/shift) between, a skip.

    ``train`` is positional so that `nn.remat` can mark it static (see `checkpointing.py`).
    """

    in_ch: int
    out_ch: int
    temb_dim: int
    groups: int
    eps: float
    dropout_rate: float  # torch's `dropout` argument; here that name is the submodule's
    scale_shift: bool = False
    output_scale: float = 1.0
    norm: str = "group"
    momentum: float = 0.1

    def setup(self) -> None:
        self.norm1 = norm_layer(self.in_ch, self.norm, self.groups, self.eps, self.momentum)
        self.conv1 = conv3x3(self.out_ch)
        self.time_emb_proj = Dense(self.out_ch * (2 if self.scale_shift else 1))
        self.norm2 = norm_layer(self.out_ch, self.norm, self.groups, self.eps, self.momentum)
        self.dropout = nn.Dropout(self.dropout_rate, rng_collection="dropout")
        self.conv2 = conv3x3(self.out_ch)
        self.conv_shortcut = conv1x1(self.out_ch) if self.in_ch != self.out_ch else None

    def __call__(self, x: Array, temb: Array, train: bool = False) -> Array:
        h = self.conv1(norm_act(self.norm1, x, train, silu=True))
        t = self.time_emb_proj(nn.silu(temb))[:, None, None, :]  # (B, 1, 1, C): broadcast over H, W
        if self.scale_shift:
            h = norm_act(self.norm2, h, train, silu=True, film=tuple(jnp.split(t, 2, axis=-1)))
        else:
            h = norm_act(self.norm2, h + t, train, silu=True)
        h = self.conv2(self.dropout(h, deterministic=not train))
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        return (skip + h) / self.output_scale


def _tokens(x: Array) -> Array:
    # NHWC -> (B, H*W, C): row-major over (h, w), the same token order as torch's "b c h w -> b (h w) c".
    return x.reshape(x.shape[0], -1, x.shape[-1])


class SelfAttention(nn.Module):
    """DDPM's spatial self-attention block: GroupNorm (none when ``groups=0``), q/k/v, attention, out, residual.

    The attention is ``heads * head_dim`` wide, which diffusers lets differ from ``ch``.
    """

    ch: int
    heads: int
    head_dim: int
    groups: int
    eps: float
    scale: float | None
    output_scale: float = 1.0
    query_chunk: int | None = None  # see `attention`
    lora_rank: int | None = None  # LoRA adapters on q/k/v/out (`LoRADense`)

    def setup(self) -> None:
        self.group_norm = group_norm(self.groups, self.eps) if self.groups else None
        inner, dense = self.heads * self.head_dim, projection(self.lora_rank)
        self.to_q, self.to_k, self.to_v = (dense(inner) for _ in range(3))
        self.to_out = dense(self.ch)

    def __call__(self, x: Array, context: Array | None = None) -> Array:
        del context  # same call signature as Transformer2D; plain self-attention ignores it
        scale = self.scale or self.head_dim**-0.5
        h = _tokens(x if self.group_norm is None else norm_act(self.group_norm, x))
        h = attention(self.to_q(h), self.to_k(h), self.to_v(h), self.heads, scale, self.query_chunk)
        h = self.to_out(h).reshape(x.shape)
        return (h + x) / self.output_scale


class CrossAttention(nn.Module):
    """Attention of a sequence over itself or over ``context`` (SD's attn1 / attn2)."""

    dim: int
    heads: int
    scale: float | None
    query_chunk: int | None = None  # see `attention`
    lora_rank: int | None = None  # LoRA adapters on q/k/v/out (`LoRADense`)

    def setup(self) -> None:
        # No bias on q/k/v, as torch; the key/value input width is inferred from ``context``.
        dense = projection(self.lora_rank)
        self.to_q = dense(self.dim, use_bias=False)
        self.to_k = dense(self.dim, use_bias=False)
        self.to_v = dense(self.dim, use_bias=False)
        self.to_out = dense(self.dim)

    def __call__(self, x: Array, context: Array | None = None) -> Array:
        ctx = x if context is None else context
        scale = self.scale or (self.dim // self.heads) ** -0.5
        q, k, v = self.to_q(x), self.to_k(ctx), self.to_v(ctx)
        return self.to_out(attention(q, k, v, self.heads, scale, self.query_chunk))


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
    """Exact GELU as torch's ``F.gelu`` computes it, x/2 * (1 + erf(x/sqrt(2))). (Flax's default is
    the tanh approximation; ``jax.nn.gelu(approximate=False)``, the same function written with
    erfc, leaves XLA:CPU three more half-size arrays live in its backward.)"""
    return 0.5 * x * (1.0 + jax.lax.erf(x * math.sqrt(0.5)))


@functools.partial(jax.checkpoint, prevent_cse=True)
def geglu(h: Array) -> Array:
    """``value * gelu(gate)`` of ``h``'s two halves, recomputed from ``h`` in the backward pass.

    Autodiff would keep the GELU's intermediates (XLA:CPU: four half-size arrays beside ``h``,
    torch's autograd one, ``gelu(gate)``); recomputed, the backward keeps only ``h`` and the
    product, which the output projection keeps anyway.
    """
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

    def __call__(self, x: Array, context: Array | None) -> Array:
        x = self.attn1(norm_act(self.norm1, x)) + x
        if self.attn2 is not None:
            x = self.attn2(norm_act(self.norm2, x), context) + x
        return self.ff(norm_act(self.norm3, x)) + x


class Transformer2D(nn.Module):
    """SD's spatial transformer: GroupNorm, project in, transformer blocks, project out, residual.

    The transformer runs ``heads * head_dim`` wide (the projections map ``ch`` to it and back).
    """

    ch: int
    heads: int
    head_dim: int
    depth: int
    groups: int
    norm_eps: float
    ln_eps: float
    scale: float | None
    context_dim: int | None
    linear_projection: bool
    query_chunk: int | None = None  # see `attention`
    lora_rank: int | None = None  # LoRA adapters on every attention's q/k/v/out

    def setup(self) -> None:
        # A 1x1 conv and a Dense compute the same map in NHWC, but torch keeps 4-D conv weights
        # when linear_projection is off, and the parameter tree must mirror torch's.
        project = Dense if self.linear_projection else conv1x1
        inner = self.heads * self.head_dim
        self.norm = group_norm(self.groups, self.norm_eps)
        self.proj_in = project(inner)
        self.transformer_blocks = [
            TransformerBlock(
                inner, self.heads, self.ln_eps, self.scale, self.context_dim, self.query_chunk, self.lora_rank
            )
            for _ in range(self.depth)
        ]
        self.proj_out = project(self.ch)

    def __call__(self, x: Array, context: Array | None) -> Array:
        # In NHWC the projections commute with flattening, so one order serves both variants.
        h = _tokens(self.proj_in(norm_act(self.norm, x)))  # (B, H*W, inner)
        for block in self.transformer_blocks:
            h = block(h, context)
        return self.proj_out(h.reshape(*x.shape[:3], -1)) + x  # (B, H, W, inner) -> (B, H, W, C)


class Downsample(nn.Module):
    """Strided 3x3 conv; ``padding=0`` pads right/bottom only, as the original DDPM."""

    ch: int
    padding: int

    def setup(self) -> None:
        self.conv = Conv(self.ch, (3, 3), strides=(2, 2), padding=PAD_1 if self.padding == 1 else "VALID")

    def __call__(self, x: Array) -> Array:
        if self.padding == 0:
            x = jnp.pad(x, ((0, 0), (0, 1), (0, 1), (0, 0)))
        return self.conv(x)


class Upsample(nn.Module):
    """Nearest-neighbour 2x, then a 3x3 conv."""

    ch: int

    def setup(self) -> None:
        self.conv = conv3x3(self.ch)

    def __call__(self, x: Array) -> Array:
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)  # (B, 2H, 2W, C)
        return self.conv(x)


# Attention kinds of the spec -> layer class; the same keys as in `torch_impl/layers.py`.
ATTENTION: dict[str, type[nn.Module]] = {"self": SelfAttention, "transformer": Transformer2D}
