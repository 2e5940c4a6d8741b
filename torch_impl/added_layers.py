"""The layers diffusers' Kandinsky 2.2, DeepFloyd IF and UnCLIP U-Nets add to SD's (PyTorch, NCHW):
the added-KV attention of their SimpleCrossAttn blocks, and conditioning on an image embedding.
Mirrored name for name in `jax_impl/added_layers.py`; attribute names are diffusers' (their
state_dict keys need no rename).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from shared_configs.arch import SimpleCrossAttentionArgs
from torch_impl.layers import Mask, attention


class SimpleCrossAttention(nn.Module):
    """diffusers' ``AttnAddedKVProcessor`` attention: tokens attend over the context's keys/values, then their own."""

    def __init__(self, ch: int, args: SimpleCrossAttentionArgs) -> None:
        super().__init__()
        self.heads, self.scale = args.heads, args.head_dim**-0.5
        inner, groups = args.heads * args.head_dim, args.context_groups
        self.group_norm = nn.GroupNorm(args.groups, ch, eps=args.eps)
        self.norm_cross = nn.GroupNorm(groups, args.context_dim, eps=args.eps) if groups else None
        self.to_q, self.to_k, self.to_v = (nn.Linear(ch, inner) for _ in range(3))
        self.add_k_proj, self.add_v_proj = nn.Linear(args.context_dim, inner), nn.Linear(args.context_dim, inner)
        self.to_out = nn.Linear(inner, ch)

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask: Mask = None) -> torch.Tensor:
        if self.norm_cross is not None:  # GroupNorm over the context's channels: (B, L, D) as (B, D, L)
            context = self.norm_cross(context.transpose(1, 2)).transpose(1, 2)
        h = rearrange(self.group_norm(x), "b c h w -> b (h w) c")
        k = torch.cat([self.add_k_proj(context), self.to_k(h)], dim=1)  # context first, as diffusers
        v = torch.cat([self.add_v_proj(context), self.to_v(h)], dim=1)
        if mask is not None:  # the block's own tokens are never masked
            mask = F.pad(mask, (0, h.shape[1]))
        h = attention(self.to_q(h), k, v, self.heads, self.scale, mask)
        return rearrange(self.to_out(h), "b (h w) c -> b c h w", h=x.shape[2]) + x


class ImageProjection(nn.Module):
    """``image_embeds`` (B, E) -> a context of ``tokens`` tokens (diffusers' ``ImageProjection``): Linear, LayerNorm."""

    def __init__(self, in_dim: int, dim: int, tokens: int, eps: float) -> None:
        super().__init__()
        self.tokens = tokens
        self.image_embeds = nn.Linear(in_dim, tokens * dim)
        self.norm = nn.LayerNorm(dim, eps=eps)

    def forward(self, image_embeds: torch.Tensor) -> torch.Tensor:
        return self.norm(self.image_embeds(image_embeds).reshape(image_embeds.shape[0], self.tokens, -1))


class ImageTimeEmbedding(nn.Module):
    """``image_embeds`` (B, E) -> the time embedding's width (diffusers' ``ImageTimeEmbedding``): Linear, LayerNorm."""

    def __init__(self, in_dim: int, dim: int, eps: float) -> None:
        super().__init__()
        self.image_proj = nn.Linear(in_dim, dim)
        self.image_norm = nn.LayerNorm(dim, eps=eps)

    def forward(self, image_embeds: torch.Tensor) -> torch.Tensor:
        return self.image_norm(self.image_proj(image_embeds))
