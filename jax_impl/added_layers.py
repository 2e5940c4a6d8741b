"""The layers diffusers' Kandinsky 2.2, DeepFloyd IF and UnCLIP U-Nets add to SD's (Flax linen, NHWC):
the added-KV attention of their SimpleCrossAttn blocks, and conditioning on an image embedding.
Mirrors `torch_impl/added_layers.py` class for class, name for name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn

from jax_impl.attention import attention
from jax_impl.layers import Dense, Mask, group_norm, layer_norm, norm_act, projection
from shared_configs.arch import SimpleCrossAttentionArgs


class SimpleCrossAttention(nn.Module):
    """diffusers' ``Attention`` with ``added_kv_proj_dim``: tokens attend over the context's and their own keys."""

    ch: int
    args: SimpleCrossAttentionArgs
    query_chunk: int | None = None  # unused: the context's keys make the attention unchunkable here
    lora_rank: int | None = None  # LoRA adapters on q/k/v/out (`LoRADense`)

    def setup(self) -> None:
        inner, dense = self.args.heads * self.args.head_dim, projection(self.lora_rank)
        self.group_norm = group_norm(self.args.groups, self.args.eps)
        self.norm_cross = group_norm(self.args.context_groups, self.args.eps) if self.args.context_groups else None
        self.to_q, self.to_k, self.to_v = (dense(inner) for _ in range(3))
        self.add_k_proj, self.add_v_proj = Dense(inner), Dense(inner)
        self.to_out = dense(self.ch)

    def __call__(self, x: jax.Array, context: jax.Array, mask: Mask = None) -> jax.Array:
        """``mask``: the (B, 1, 1, L) score bias over the context (`jax_impl.layers.mask_bias`)."""
        if self.norm_cross is not None:  # (B, L, D): Flax's GroupNorm groups the last axis, as torch's (B, D, L)
            context = norm_act(self.norm_cross, context)
        h = norm_act(self.group_norm, x).reshape(x.shape[0], -1, x.shape[-1])  # (B, H*W, C)
        k = jnp.concatenate([self.add_k_proj(context), self.to_k(h)], axis=1)  # context first, as diffusers
        v = jnp.concatenate([self.add_v_proj(context), self.to_v(h)], axis=1)
        if mask is not None:  # the block's own tokens are never masked
            mask = jnp.pad(mask, ((0, 0), (0, 0), (0, 0), (0, h.shape[1])))
        h = attention(self.to_q(h), k, v, self.args.heads, self.args.head_dim**-0.5, None, mask)
        return self.to_out(h).reshape(x.shape) + x


class ImageProjection(nn.Module):
    """diffusers' ``ImageProjection``: ``image_embeds`` (B, E) -> (B, tokens, D) context (Dense, LayerNorm)."""

    in_dim: int
    dim: int
    tokens: int
    eps: float

    def setup(self) -> None:
        self.image_embeds = Dense(self.tokens * self.dim)
        self.norm = layer_norm(self.eps)

    def __call__(self, image_embeds: jax.Array) -> jax.Array:
        return self.norm(self.image_embeds(image_embeds).reshape(image_embeds.shape[0], self.tokens, -1))


class ImageTimeEmbedding(nn.Module):
    """diffusers' ``ImageTimeEmbedding``: ``image_embeds`` (B, E) -> the time embedding's width (Dense, LayerNorm)."""

    in_dim: int
    dim: int
    eps: float

    def setup(self) -> None:
        self.image_proj = Dense(self.dim)
        self.image_norm = layer_norm(self.eps)

    def __call__(self, image_embeds: jax.Array) -> jax.Array:
        return self.image_norm(self.image_proj(image_embeds))
