"""The PyTorch U-Net, assembled from a `UNetSpec`: the one place that reads the spec."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from shared_configs import CheckpointPlan, UNetSpec, block_names, layer_names, load_spec, resolve_plan
from shared_configs.plan import Policy
from torch_impl.blocks import AttentionFactory, DownBlock, MidBlock, UpBlock
from torch_impl.checkpointing import apply_plan, remove_plan
from torch_impl.layers import ResnetBlock, SelfAttention, TimestepEmbedding, Transformer2D, timestep_embedding


class UNet(nn.Module):
    """Diffusion U-Net on NCHW input: ``forward(x, t, context=None)``."""

    def __init__(self, spec: UNetSpec | str) -> None:
        super().__init__()
        self.spec = spec = load_spec(spec) if isinstance(spec, str) else spec
        self.plan = resolve_plan(spec, "none")
        chans, n, temb = spec.block_out_channels, spec.num_levels, spec.time_embed_dim
        self.conv_in = nn.Conv2d(spec.in_channels, chans[0], 3, padding=1)
        self.time_embedding = TimestepEmbedding(chans[0], temb)

        skips = [chans[0]]  # channels of the skip stack, pushed by the down path
        down = []
        for i, attn in enumerate(spec.down_attention):
            in_ch = chans[max(i - 1, 0)]
            last = i == n - 1
            down.append(
                DownBlock(
                    in_ch,
                    chans[i],
                    spec.layers_per_block,
                    self._resnet_factory(1.0),
                    self._attention_factory(attn, i, 1.0),
                    None if last else spec.downsample_padding,
                )
            )
            skips += [chans[i]] * (spec.layers_per_block + (0 if last else 1))
        self.down = nn.ModuleList(down)

        scale = spec.mid_block_scale_factor
        self.mid = MidBlock(
            chans[-1], self._resnet_factory(scale), self._attention_factory(spec.mid_attention, -1, scale)
        )

        up, prev = [], chans[-1]
        for i, attn in enumerate(spec.up_attention_resolved):
            level = n - 1 - i
            count = spec.layers_per_block + 1
            mine, skips = skips[-count:], skips[:-count]
            up.append(
                UpBlock(
                    prev,
                    chans[level],
                    list(reversed(mine)),
                    self._resnet_factory(1.0),
                    self._attention_factory(attn, level, 1.0),
                    upsample=level > 0,
                )
            )
            prev = chans[level]
        self.up = nn.ModuleList(up)

        self.conv_norm_out = nn.GroupNorm(spec.norm_num_groups, chans[0], eps=spec.norm_eps)
        self.conv_out = nn.Conv2d(chans[0], spec.out_channels, 3, padding=1)

    def _resnet_factory(self, output_scale: float) -> functools.partial:
        s = self.spec
        return functools.partial(
            _resnet,
            temb_dim=s.time_embed_dim,
            groups=s.norm_num_groups,
            eps=s.norm_eps,
            dropout=s.dropout,
            scale_shift=s.resnet_time_scale_shift == "scale_shift",
            output_scale=output_scale,
        )

    def _attention_factory(self, kind: str, level: int, output_scale: float) -> AttentionFactory | None:
        s, heads = self.spec, self.spec.heads(level)
        if kind == "self":
            return functools.partial(
                SelfAttention,
                heads=heads,
                groups=s.norm_num_groups,
                eps=s.norm_eps,
                scale=s.attention_scale,
                output_scale=output_scale,
            )
        if kind == "transformer":
            return functools.partial(
                Transformer2D,
                heads=heads,
                depth=s.transformer_layers_per_block,
                groups=s.norm_num_groups,
                norm_eps=s.transformer_norm_eps,
                ln_eps=s.layer_norm_eps,
                scale=s.attention_scale,
                context_dim=s.cross_attention_dim,
                linear_projection=s.use_linear_projection,
            )
        return None

    def forward(self, x: torch.Tensor, t: torch.Tensor | float, context: torch.Tensor | None = None) -> torch.Tensor:
        s = self.spec
        if s.cross_attention_dim is not None and context is None:
            raise ValueError(
                f"context: spec {s.name!r} has cross-attention; pass context of shape (B, L, {s.cross_attention_dim})"
            )
        t = torch.as_tensor(t, device=x.device).expand(x.shape[0])
        te = s.time_embedding
        temb = self.time_embedding(
            timestep_embedding(t, s.block_out_channels[0], te.flip_sin_to_cos, te.freq_shift, te.max_period)
        )
        h = self.conv_in(x)
        skips = [h]
        for block in self.down:
            skips += block(h, temb, context)
            h = skips[-1]
        h = self.mid(h, temb, context)
        for block in self.up:
            count = len(block.resnets)
            h = block(h, skips[-count:], temb, context)
            del skips[-count:]
        return self.conv_out(F.silu(self.conv_norm_out(h)))

    @classmethod
    def from_diffusers(cls, path_or_model: object, variant: str | None = None) -> UNet:
        """Build from a local diffusers model folder or a live diffusers U-Net (see `torch_impl.diffusers_io`)."""
        from torch_impl.diffusers_io import from_diffusers

        return from_diffusers(path_or_model, variant)

    def to_diffusers_state_dict(self) -> dict[str, torch.Tensor]:
        """This model's state_dict in diffusers' key names (``UNet2D(Condition)Model``)."""
        from torch_impl.diffusers_io import to_diffusers_state_dict

        return to_diffusers_state_dict(self)

    def block_names(self, layers: bool = False) -> list[str]:
        """Names a checkpoint plan can use: blocks, or with ``layers=True`` ResNets/attentions."""
        return layer_names(self.spec) if layers else block_names(self.spec)

    def enable_gradient_checkpointing(
        self, policy: Policy | CheckpointPlan = "full", preserve_rng_state: bool = True
    ) -> CheckpointPlan:
        """Recompute the blocks the policy names in the backward pass; returns the plan."""
        self.plan = resolve_plan(self.spec, policy)
        apply_plan(self, self.plan, preserve_rng_state)
        return self.plan

    def disable_gradient_checkpointing(self) -> None:
        remove_plan(self)
        self.plan = resolve_plan(self.spec, "none")


def _resnet(in_ch: int, out_ch: int, **kwargs: object) -> ResnetBlock:
    return ResnetBlock(in_ch, out_ch, **kwargs)
