"""The PyTorch U-Net, assembled from a `UNetSpec`: the one place that reads the spec."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shared_configs import CheckpointPlan, UNetSpec, block_names, layer_names, load_spec, resolve_plan
from shared_configs.arch import attention_kwargs, down_blocks, norm_kwargs, resnet_kwargs, up_blocks
from shared_configs.plan import Policy
from torch_impl.blocks import AttentionFactory, DownBlock, MidBlock, UpBlock
from torch_impl.checkpointing import apply_plan, remove_plan
from torch_impl.layers import ATTENTION, ResnetBlock, TimestepEmbedding, norm_layer, timestep_embedding


class UNet(nn.Module):
    """Diffusion U-Net on NCHW input: ``forward(x, t, context=None)``."""

    def __init__(self, spec: UNetSpec | str) -> None:
        super().__init__()
        self.spec = spec = load_spec(spec) if isinstance(spec, str) else spec
        self.plan = resolve_plan(spec, "none")
        chans = spec.block_out_channels
        self.conv_in = nn.Conv2d(spec.in_channels, chans[0], 3, padding=1)
        self.time_embedding = TimestepEmbedding(chans[0], spec.time_embed_dim)
        resnet = self._resnet_factory(1.0)
        self.down = nn.ModuleList(
            DownBlock(
                b.in_ch,
                b.out_ch,
                spec.layers_per_block,
                resnet,
                self._attention_factory(b.attention, b.level),
                b.downsample_padding,
            )
            for b in down_blocks(spec)
        )
        scale = spec.mid_block_scale_factor
        self.mid = MidBlock(
            chans[-1], self._resnet_factory(scale), self._attention_factory(spec.mid_attention, -1, scale)
        )
        self.up = nn.ModuleList(
            UpBlock(
                b.in_ch, b.out_ch, b.skip_channels, resnet, self._attention_factory(b.attention, b.level), b.upsample
            )
            for b in up_blocks(spec)
        )
        self.conv_norm_out = norm_layer(chans[0], **norm_kwargs(spec))
        self.conv_out = nn.Conv2d(chans[0], spec.out_channels, 3, padding=1)

    def _resnet_factory(self, output_scale: float) -> functools.partial:
        return functools.partial(ResnetBlock, **resnet_kwargs(self.spec, output_scale))

    def _attention_factory(self, kind: str, level: int, output_scale: float = 1.0) -> AttentionFactory | None:
        if kind == "none":
            return None
        return functools.partial(ATTENTION[kind], **attention_kwargs(self.spec, kind, level, output_scale))

    def forward(self, x: torch.Tensor, t: torch.Tensor | float, context: torch.Tensor | None = None) -> torch.Tensor:
        s = self.spec
        if s.cross_attention_dim is not None and context is None:
            raise ValueError(
                f"context: spec {s.name!r} has cross-attention; pass context of shape (B, L, {s.cross_attention_dim})"
            )
        t = torch.as_tensor(t, device=x.device).expand(x.shape[0])
        te = s.time_embedding
        features = timestep_embedding(t, s.block_out_channels[0], te.flip_sin_to_cos, te.freq_shift, te.max_period)
        temb = self.time_embedding(features.to(x.dtype))  # sinusoids in float32, then the model's dtype
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

    def save_diffusers(self, folder: str | os.PathLike[str]) -> Path:
        """Write this model as a local diffusers model folder (see `torch_impl.diffusers_io.save_diffusers`)."""
        from torch_impl.diffusers_io import save_diffusers

        return save_diffusers(self, folder)

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
