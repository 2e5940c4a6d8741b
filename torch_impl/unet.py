"""The PyTorch U-Net, assembled from a `UNetSpec`: the one place that reads the spec. Mirror: `jax_impl/unet.py`."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shared_configs import CheckpointPlan, UNetSpec, block_names, layer_names, load_spec, resolve_plan
from shared_configs.arch import (
    BlockArgs,
    attention_args,
    block_resnet_args,
    class_embedding_args,
    down_blocks,
    norm_args,
    up_blocks,
)
from shared_configs.controlnet import add_residuals
from shared_configs.inputs import check_inputs
from shared_configs.vocabulary import Policy
from torch_impl.added_layers import ImageProjection, ImageTimeEmbedding, SimpleCrossAttention
from torch_impl.blocks import AttentionFactory, DownBlock, MidBlock, UpBlock
from torch_impl.checkpointing import apply_plan, remove_plan
from torch_impl.layers import (
    ATTENTION,
    CLASS_EMBEDDING,
    ResnetBlock,
    TimestepEmbedding,
    mask_bias,
    norm_layer,
    timestep_embedding,
)

Tensor = torch.Tensor
# Attention kinds of the spec -> layer class; the same keys as in `jax_impl/unet.py`.
ATTENTION_LAYERS: dict[str, type[nn.Module]] = {**ATTENTION, "simple_cross": SimpleCrossAttention}


class UNetTrunk(nn.Module):
    """What the U-Net and the ControlNet share, under the same names: ``conv_in``, embeddings, ``down``, ``mid``,
    built from ``trunk_spec`` (the U-Net's spec; a ControlNet's, its U-Net's)."""

    trunk_spec: UNetSpec

    def resolve(self, policy: Policy | CheckpointPlan) -> CheckpointPlan:
        """``policy`` as a plan over this model's units (a bad name is one line)."""
        raise NotImplementedError

    def enable_gradient_checkpointing(
        self, policy: Policy | CheckpointPlan = "full", preserve_rng_state: bool = True
    ) -> CheckpointPlan:
        """Recompute the units the policy names in the backward pass; returns the plan."""
        self.plan = self.resolve(policy)
        apply_plan(self, self.plan, preserve_rng_state)
        return self.plan

    def disable_gradient_checkpointing(self) -> None:
        remove_plan(self)
        self.plan = self.resolve("none")

    @classmethod
    def from_diffusers(
        cls,
        source: object,
        variant: str | None = None,
        *,
        subfolder: str | None = None,
        dtype: torch.dtype | None = None,
        revision: str | None = None,
    ) -> UNetTrunk:
        """Build from a diffusers folder (a pipeline's: ``subfolder="unet"`` / ``"controlnet"``), a repo id
        in the local Hugging Face cache, or a live diffusers model (`torch_impl.diffusers_io.from_diffusers`)."""
        from torch_impl.diffusers_io import from_diffusers

        return from_diffusers(
            cls,
            source,
            variant,
            subfolder=subfolder,
            dtype=dtype,
            revision=revision,
            controlnet=not issubclass(cls, UNet),
        )

    def to_diffusers_state_dict(self) -> dict[str, Tensor]:
        """This model's state_dict in diffusers' key names (``UNet2D(Condition)Model``, ``ControlNetModel``)."""
        from torch_impl.diffusers_io import to_diffusers_state_dict

        return to_diffusers_state_dict(self)

    def save_diffusers(self, folder: str | os.PathLike[str]) -> Path:
        """Write a local diffusers model folder (`torch_impl.diffusers_io.save_diffusers`)."""
        from torch_impl.diffusers_io import save_diffusers

        return save_diffusers(self, folder)

    def _build_trunk(self, spec: UNetSpec) -> None:
        self.trunk_spec = spec
        chans = spec.block_out_channels
        self.conv_in = nn.Conv2d(spec.in_channels, chans[0], 3, padding=1)
        self.time_embedding = TimestepEmbedding(chans[0], spec.time_embed_dim, spec.time_embedding.cond_dim)
        self._conditioning_layers()
        self.down = nn.ModuleList(
            DownBlock(
                b.in_ch, b.out_ch, spec.layers_per_block, *self._factories(b), b.downsample_padding, b.resnet_resample
            )
            for b in down_blocks(spec)
        )
        self.mid = MidBlock(
            chans[-1],
            self._resnet_factory("mid"),
            self._attention_factory(spec.mid_attention, -1, "mid", spec.mid_block_scale_factor),
        )

    def _conditioning_layers(self) -> None:
        """Class, text_time, image embeddings and the context's projection (diffusers' names), as the spec has them."""
        spec = self.trunk_spec
        if (args := class_embedding_args(spec)) is not None:
            self.class_embedding = CLASS_EMBEDDING[args.kind](args)
        if (add := spec.addition_embedding) is not None:
            self.add_embedding = TimestepEmbedding(add.input_dim, spec.time_embed_dim)
        if (img := spec.image_embedding) is not None and img.add_to_time:
            self.add_embedding = ImageTimeEmbedding(img.input_dim, spec.time_embed_dim, img.norm_eps)
        if img is not None and img.context_tokens is not None:
            self.encoder_hid_proj = ImageProjection(
                img.input_dim, spec.cross_attention_dim, img.context_tokens, img.norm_eps
            )
        elif spec.context_proj_dim is not None:
            self.encoder_hid_proj = nn.Linear(spec.context_proj_dim, spec.cross_attention_dim)

    def _factories(self, b: BlockArgs) -> tuple[functools.partial, AttentionFactory | None]:
        return self._resnet_factory(b.name), self._attention_factory(b.attention, b.level, b.name)

    def _resnet_factory(self, block: str) -> functools.partial:
        return functools.partial(ResnetBlock, args=block_resnet_args(self.trunk_spec, block))

    def _attention_factory(
        self, kind: str, level: int, block: str, output_scale: float = 1.0
    ) -> AttentionFactory | None:
        if kind == "none":
            return None
        return functools.partial(
            ATTENTION_LAYERS[kind], args=attention_args(self.trunk_spec, kind, level, block, output_scale)
        )

    def _encode(
        self, x: Tensor, temb: Tensor, context: Tensor | None, hint: Tensor | None = None, mask: Tensor | None = None
    ) -> tuple[Tensor, list[Tensor]]:
        """``conv_in`` (plus the ControlNet's ``hint``), the down path and the mid block: its output and the skips."""
        h = self.conv_in(x) if hint is None else self.conv_in(x) + hint
        skips = [h]
        for block in self.down:
            skips += block(h, temb, context, mask)
            h = skips[-1]
        return self.mid(h, temb, context, mask), skips

    def _context(self, context: Tensor | None, image_embeds: Tensor | None) -> Tensor | None:
        """The cross-attention context: the input, projected, or made from ``image_embeds`` (``encoder_hid_proj``)."""
        img = self.trunk_spec.image_embedding
        if img is not None and img.context_tokens is not None:
            return self.encoder_hid_proj(image_embeds)
        return context if self.trunk_spec.context_proj_dim is None else self.encoder_hid_proj(context)

    def _sinusoids(self, values: Tensor, dim: int) -> Tensor:
        te = self.trunk_spec.time_embedding
        return timestep_embedding(values, dim, te.flip_sin_to_cos, te.freq_shift, te.max_period)

    def _embedding(
        self,
        x: Tensor,
        t: Tensor | float,
        class_labels: Tensor | None,
        text_embeds: Tensor | None,
        time_ids: Tensor | None,
        timestep_cond: Tensor | None = None,
        image_embeds: Tensor | None = None,
    ) -> Tensor:
        """The embedding every ResNet gets: time (with ``timestep_cond``), plus class, text_time, image conditioning."""
        s, dtype = self.trunk_spec, x.dtype
        t = torch.as_tensor(t, device=x.device).expand(x.shape[0])
        sinusoids = self._sinusoids(t, s.block_out_channels[0]).to(dtype)  # computed in float32
        temb = self.time_embedding(sinusoids, timestep_cond)
        if (ce := s.class_embedding) is not None:
            labels = (
                self._sinusoids(class_labels, s.block_out_channels[0]).to(dtype)
                if ce.kind == "timestep"
                else class_labels
            )
            class_emb = (labels if self.class_embedding is None else self.class_embedding(labels)).to(dtype)
            temb = torch.cat([temb, class_emb], dim=-1) if ce.concat else temb + class_emb
        if (add := s.addition_embedding) is not None:
            ids = self._sinusoids(time_ids.flatten(), add.time_id_dim).reshape(x.shape[0], -1)  # (B, N * time_id_dim)
            temb = temb + self.add_embedding(torch.cat([text_embeds, ids], dim=-1).to(dtype))
        if (img := s.image_embedding) is not None and img.add_to_time:
            temb = temb + self.add_embedding(image_embeds)
        return temb


class UNet(UNetTrunk):
    """Diffusion U-Net on NCHW input. ``policy`` (a policy string, block names or a `CheckpointPlan`;
    ``None``: the spec's own ``checkpoint`` field) is applied at construction, as in ``jax_impl.UNet``."""

    def __init__(self, spec: UNetSpec | str, policy: Policy | CheckpointPlan = None) -> None:
        super().__init__()
        self.spec = spec = load_spec(spec) if isinstance(spec, str) else spec
        self._build_trunk(spec)
        self.up = nn.ModuleList(
            UpBlock(b.in_ch, b.out_ch, b.skip_channels, *self._factories(b), b.upsample, b.resnet_resample)
            for b in up_blocks(spec)
        )
        chans = spec.block_out_channels
        self.conv_norm_out = norm_layer(chans[0], norm_args(spec))
        self.conv_out = nn.Conv2d(chans[0], spec.out_channels, 3, padding=1)
        self.enable_gradient_checkpointing(policy)

    def forward(
        self,
        x: Tensor,
        t: Tensor | float,
        context: Tensor | None = None,
        class_labels: Tensor | None = None,
        text_embeds: Tensor | None = None,
        time_ids: Tensor | None = None,
        down_block_additional_residuals: Sequence[Tensor] | None = None,
        mid_block_additional_residual: Tensor | None = None,
        timestep_cond: Tensor | None = None,
        image_embeds: Tensor | None = None,
        encoder_attention_mask: Tensor | None = None,
    ) -> Tensor:
        """Predict the noise (or whatever the spec was trained on) for NCHW ``x`` at timesteps ``t`` (a
        scalar or (B,)). The other inputs are diffusers' ``UNet2DConditionModel``'s of the same names;
        a spec takes exactly those `shared_configs.inputs` says (anything else is a one-line `ValueError`).
        """
        check_inputs(
            self.spec,
            "NCHW",
            x,
            t,
            context=context,
            class_labels=class_labels,
            text_embeds=text_embeds,
            time_ids=time_ids,
            timestep_cond=timestep_cond,
            image_embeds=image_embeds,
            encoder_attention_mask=encoder_attention_mask,
        )
        temb = self._embedding(x, t, class_labels, text_embeds, time_ids, timestep_cond, image_embeds)
        context, mask = self._context(context, image_embeds), mask_bias(encoder_attention_mask, x.dtype)
        h, skips = self._encode(x, temb, context, mask=mask)
        h, skips = add_residuals(self.spec, h, skips, down_block_additional_residuals, mid_block_additional_residual)
        for block in self.up:
            count = len(block.resnets)
            h = block(h, skips[-count:], temb, context, mask)
            del skips[-count:]
        return self.conv_out(F.silu(self.conv_norm_out(h)))

    def block_names(self, layers: bool = False) -> list[str]:
        """Names a checkpoint plan can use: blocks, or with ``layers=True`` ResNets/attentions."""
        return layer_names(self.spec) if layers else block_names(self.spec)

    def resolve(self, policy: Policy | CheckpointPlan) -> CheckpointPlan:
        return resolve_plan(self.spec, policy)
