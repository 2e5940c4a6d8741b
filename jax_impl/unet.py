"""The Flax U-Net, assembled from a `UNetSpec`: the one place that reads the spec. Mirrors `torch_impl/unet.py`.

Checkpointing is chosen here once, in ``setup()``: each block is ``nn.remat(Block)`` or ``Block``
(`checkpointing.remat_class`), told which of its layers the plan recomputes; the parameter tree is the same.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from jax_impl.added_layers import ImageProjection, ImageTimeEmbedding, SimpleCrossAttention
from jax_impl.blocks import AttentionFactory, DownBlock, MidBlock, UpBlock
from jax_impl.checkpointing import own_cotangent, remat_class
from jax_impl.layers import (
    ATTENTION,
    CLASS_EMBEDDING,
    Dense,
    ResnetBlock,
    TimestepEmbedding,
    conv3x3,
    mask_bias,
    norm_act,
    norm_layer,
    timestep_embedding,
)
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
from shared_configs.inputs import check_inputs, input_specs

Array = jax.Array
PolicyArg = str | tuple[str, ...] | CheckpointPlan | None
# Attention kinds of the spec -> layer class; the same keys as in `torch_impl/unet.py`.
ATTENTION_LAYERS: dict[str, type[nn.Module]] = {**ATTENTION, "simple_cross": SimpleCrossAttention}


@functools.cache
def _as_spec(spec: UNetSpec | str) -> UNetSpec:
    # Cached: an unbound module's `block_names()` and `setup()` would otherwise re-read the YAML.
    return load_spec(spec) if isinstance(spec, str) else spec


def abstract_inputs(
    spec: UNetSpec, batch: int = 1, sample_size: int | None = None, context_len: int = 1
) -> dict[str, jax.ShapeDtypeStruct | None]:
    """Shape structs of every input of ``spec`` (NHWC) by name, at the smallest sizes by default (``eval_shape``)."""
    size = sample_size or 2 ** (spec.num_levels - 1)
    specs = input_specs(spec, batch, size, context_len, layout="NHWC")
    return {k: None if v is None else jax.ShapeDtypeStruct(v.shape, jnp.dtype(v.dtype)) for k, v in specs.items()}


class UNetTrunk(nn.Module):
    """What the U-Net and the ControlNet share, under the same names: ``conv_in``, the embeddings, ``down``, ``mid``.
    Subclasses give `trunk_spec`, ``plan``, ``attention_chunk`` and ``lora_rank``, and call `_setup_trunk`."""

    @property
    def trunk_spec(self) -> UNetSpec:
        raise NotImplementedError

    @nn.nowrap
    def _setup_trunk(self, plan: CheckpointPlan) -> None:
        spec = self.trunk_spec
        chunk = self.attention_chunk
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
            raise ValueError(f"attention_chunk: expected a positive number of queries or None, got {chunk!r}")
        chans = spec.block_out_channels
        self.conv_in = conv3x3(chans[0])
        self.time_embedding = TimestepEmbedding(chans[0], spec.time_embed_dim, spec.time_embedding.cond_dim)
        self._conditioning_layers()
        self.down = [
            self._block(
                DownBlock,
                b,
                plan,
                b.in_ch,
                b.out_ch,
                spec.layers_per_block,
                downsample_padding=b.downsample_padding,
                resnet_resample=b.resnet_resample,
            )
            for b in down_blocks(spec)
        ]
        mid = BlockArgs("mid", chans[-1], chans[-1], spec.mid_attention, -1)
        self.mid = self._block(MidBlock, mid, plan, chans[-1], output_scale=spec.mid_block_scale_factor)

    @nn.nowrap
    def _block(
        self,
        cls: type[nn.Module],
        b: BlockArgs,
        plan: CheckpointPlan,
        *args: object,
        output_scale: float = 1.0,
        **kw: object,
    ) -> nn.Module:
        """Block ``b`` of class ``cls`` (remat'd as ``plan`` says), given ``args``, its layers' factories and ``kw``."""
        make_attention = self._attention_factory(b.attention, b.level, b.name, output_scale)
        make_resnet = functools.partial(ResnetBlock, args=block_resnet_args(self.trunk_spec, b.name))
        return remat_class(cls, b.name, plan)(
            *args, make_resnet=make_resnet, make_attention=make_attention, unit=b.name, plan=plan, **kw
        )

    @nn.nowrap
    def _conditioning_layers(self) -> None:
        """Class, text_time and image embeddings and the context's projection, under diffusers' names."""
        spec, img = self.trunk_spec, self.trunk_spec.image_embedding
        args = class_embedding_args(spec)
        self.class_embedding = None if args is None else CLASS_EMBEDDING[args.kind](args)
        add, self.add_embedding, self.encoder_hid_proj = spec.addition_embedding, None, None
        if add is not None:
            self.add_embedding = TimestepEmbedding(add.input_dim, spec.time_embed_dim)
        if img is not None and img.add_to_time:
            self.add_embedding = ImageTimeEmbedding(img.input_dim, spec.time_embed_dim, img.norm_eps)
        if img is not None and img.context_tokens is not None:
            self.encoder_hid_proj = ImageProjection(
                img.input_dim, spec.cross_attention_dim, img.context_tokens, img.norm_eps
            )
        elif spec.context_proj_dim is not None:
            self.encoder_hid_proj = Dense(spec.cross_attention_dim)

    @nn.nowrap
    def _attention_factory(
        self, kind: str, level: int, block: str, output_scale: float = 1.0
    ) -> AttentionFactory | None:
        if kind == "none":
            return None
        args = attention_args(self.trunk_spec, kind, level, block, output_scale)
        return functools.partial(
            ATTENTION_LAYERS[kind], args=args, query_chunk=self.attention_chunk, lora_rank=self.lora_rank
        )

    def _encode(
        self,
        x: Array,
        temb: Array,
        context: Array | None,
        train: bool,
        hint: Array | None = None,
        mask: Array | None = None,
    ) -> tuple[Array, list[Array]]:
        """``conv_in`` (plus a ControlNet's ``hint``), down path, middle block: its output and the skips, as pushed."""
        h = self.conv_in(x)
        if hint is not None:
            h = h + hint
        skips = [h]
        for block in self.down:
            skips += block(h, temb, context, mask, train)  # positional: `train` is static under remat
            h = skips[-1]
        return self.mid(h, temb, context, mask, train), skips

    def _context(self, context: Array | None, image_embeds: Array | None) -> Array | None:
        """The cross-attention context: as given, projected, or from ``image_embeds`` (``encoder_hid_proj``)."""
        img = self.trunk_spec.image_embedding
        if img is not None and img.context_tokens is not None:
            return self.encoder_hid_proj(image_embeds)
        return context if self.trunk_spec.context_proj_dim is None else self.encoder_hid_proj(context)

    def _sinusoids(self, values: Array, dim: int) -> Array:
        te = self.trunk_spec.time_embedding
        return timestep_embedding(values, dim, te.flip_sin_to_cos, te.freq_shift, te.max_period)

    def _embedding(
        self,
        x: Array,
        t: Array | float,
        class_labels: Array | None,
        text_embeds: Array | None,
        time_ids: Array | None,
        timestep_cond: Array | None = None,
        image_embeds: Array | None = None,
    ) -> Array:
        """The embedding every ResNet receives: time, class, text_time and image conditioning, as diffusers."""
        s, dtype = self.trunk_spec, x.dtype
        t = jnp.broadcast_to(jnp.asarray(t), (x.shape[0],))
        # The float32 sinusoids in x's dtype: a float32 temb added to bf16 activations would promote the rest.
        temb = self.time_embedding(self._sinusoids(t, s.block_out_channels[0]).astype(dtype), timestep_cond)
        if (ce := s.class_embedding) is not None:
            labels = class_labels
            if ce.kind == "timestep":
                labels = self._sinusoids(labels, s.block_out_channels[0]).astype(dtype)
            class_emb = (labels if self.class_embedding is None else self.class_embedding(labels)).astype(dtype)
            temb = jnp.concatenate([temb, class_emb], axis=-1) if ce.concat else temb + class_emb
        if (add := s.addition_embedding) is not None:
            ids = self._sinusoids(time_ids.reshape(-1), add.time_id_dim).reshape(x.shape[0], -1)  # (B, N * dim)
            temb = temb + self.add_embedding(jnp.concatenate([text_embeds, ids], axis=-1).astype(dtype))
        if (img := s.image_embedding) is not None and img.add_to_time:
            temb = temb + self.add_embedding(image_embeds)
        return temb


class UNet(UNetTrunk):
    """Diffusion U-Net on NHWC input: ``apply(variables, x, t, ...)`` (see ``__call__``).

    Attributes:
        spec: the architecture, a `UNetSpec` or a preset name (``"tiny"``).
        policy: what to recompute in the backward: a policy name (``"full"``, ``"every:2"``), a tuple of block
            names, or a `CheckpointPlan`; ``None`` takes the spec's own ``checkpoint`` field.
        attention_chunk: queries per attention chunk (`jax_impl.attention`); ``None`` is off.
        lora_rank: rank-R LoRA adapters (`jax_impl.layers.LoRADense`) on every attention's q/k/v/out.
    """

    spec: UNetSpec | str
    policy: PolicyArg = None
    attention_chunk: int | None = None
    lora_rank: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _ = self.plan  # a bad spec or policy fails here, at construction (as torch's UNet), not at init

    @property
    def resolved_spec(self) -> UNetSpec:
        """``spec`` as a `UNetSpec` (a preset name loaded); works on an unbound module."""
        return _as_spec(self.spec)

    @functools.cached_property
    def plan(self) -> CheckpointPlan:
        """The resolved checkpoint plan, as torch's ``UNet.plan``; works on an unbound module."""
        return resolve_plan(self.resolved_spec, self.policy)

    trunk_spec = resolved_spec

    def setup(self) -> None:
        spec = self.resolved_spec
        self._setup_trunk(self.plan)
        self.up = [
            self._block(
                UpBlock,
                b,
                self.plan,
                b.in_ch,
                b.out_ch,
                b.skip_channels,
                add_upsample=b.upsample,
                resnet_resample=b.resnet_resample,
            )
            for b in up_blocks(spec)
        ]
        self.conv_norm_out = norm_layer(spec.block_out_channels[0], args=norm_args(spec))
        self.conv_out = conv3x3(spec.out_channels)

    def __call__(
        self,
        x: Array,
        t: Array | float,
        context: Array | None = None,
        class_labels: Array | None = None,
        text_embeds: Array | None = None,
        time_ids: Array | None = None,
        down_block_additional_residuals: Sequence[Array] | None = None,
        mid_block_additional_residual: Array | None = None,
        timestep_cond: Array | None = None,
        image_embeds: Array | None = None,
        encoder_attention_mask: Array | None = None,
        train: bool = False,
    ) -> Array:
        """Predict the noise (or whatever the spec was trained on) for NHWC ``x`` at timesteps ``t`` (scalar or (B,)).

        The conditioning inputs are exactly those the spec takes (`shared_configs.inputs`; anything else is a
        one-line `ValueError`); the rest are diffusers' inputs of the same names (the residuals NHWC). ``train=True``
        (by keyword) turns dropout on (rng ``"dropout"``) and, with ``norm_kind: batch``, normalises with batch
        statistics and updates ``"batch_stats"`` (pass ``mutable=["batch_stats"]``).
        """
        spec = self.resolved_spec
        check_inputs(
            spec,
            "NHWC",
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
        h, skips = self._encode(x, temb, context, train, mask=mask)
        h, skips = add_residuals(spec, h, skips, down_block_additional_residuals, mid_block_additional_residual)
        for block in self.up:
            count = len(block.skip_channels)
            h = block(h, tuple(map(own_cotangent, skips[-count:])), temb, context, mask, train)
            del skips[-count:]
        return self.conv_out(norm_act(self.conv_norm_out, h, train, silu=True))

    @nn.nowrap
    def block_names(self, layers: bool = False) -> list[str]:
        """Names a checkpoint plan can use: blocks, or with ``layers=True`` ResNets/attentions."""
        spec = self.resolved_spec
        return layer_names(spec) if layers else block_names(spec)
