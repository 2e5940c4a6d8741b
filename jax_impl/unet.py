"""The Flax U-Net, assembled from a `UNetSpec`: the one place that reads the spec.

Mirrors `torch_impl/unet.py`. Checkpointing is chosen here too, once, in ``setup()``: each block
is built from `checkpointing.block_class` (``nn.remat(Block)`` or ``Block``) and told which of its
layers a layer-level plan recomputes. Names come from the ``setup()`` attributes, so the parameter
tree is identical for every plan and mirrors the torch ``state_dict`` (``down.1`` <-> ``down_1``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

from jax_impl.blocks import AttentionFactory, DownBlock, MidBlock, UpBlock
from jax_impl.checkpointing import block_class, layers_of
from jax_impl.layers import (
    ATTENTION,
    ResnetBlock,
    TimestepEmbedding,
    apply_norm,
    conv3x3,
    norm_layer,
    timestep_embedding,
)
from shared_configs import CheckpointPlan, UNetSpec, block_names, layer_names, load_spec, resolve_plan
from shared_configs.arch import attention_kwargs, down_blocks, norm_kwargs, resnet_kwargs, up_blocks

Array = jax.Array
PolicyArg = str | tuple[str, ...] | CheckpointPlan | None


@functools.cache
def _as_spec(spec: UNetSpec | str) -> UNetSpec:
    # Cached: an unbound module's `block_names()` and `setup()` would otherwise re-read the YAML.
    return load_spec(spec) if isinstance(spec, str) else spec


class UNet(nn.Module):
    """Diffusion U-Net on NHWC input: ``apply(variables, x, t, context=None, train=False)``.

    Attributes:
        spec: the architecture, a `UNetSpec` or a preset name (``"tiny"``).
        policy: which blocks/layers to recompute in the backward pass: a policy name (``"full"``,
            ``"balanced"``, ``"layers"``, ``"every:2"``), a tuple of block names, or a
            `CheckpointPlan`; ``None`` takes the spec's own ``checkpoint`` field (default none).
        attention_chunk: compute attention this many queries at a time, each chunk rematerialised
            (`jax_impl.layers.attention`): on XLA:CPU, whose attention is unfused, it keeps the
            (tokens x tokens) scores out of memory. Same parameters and outputs; ``None`` is off.
    """

    spec: UNetSpec | str
    policy: PolicyArg = None
    attention_chunk: int | None = None

    @property
    def resolved_spec(self) -> UNetSpec:
        """``spec`` as a `UNetSpec` (a preset name loaded); works on an unbound module."""
        return _as_spec(self.spec)

    @property
    def plan(self) -> CheckpointPlan:
        """The resolved checkpoint plan, as torch's ``UNet.plan``; works on an unbound module."""
        return resolve_plan(self.resolved_spec, self.policy)

    def setup(self) -> None:
        spec, plan = self.resolved_spec, self.plan
        chans = spec.block_out_channels
        self.conv_in = conv3x3(chans[0])
        self.time_embedding = TimestepEmbedding(chans[0], spec.time_embed_dim)
        self.down = self._down_path(plan)
        scale = spec.mid_block_scale_factor
        self.mid = block_class(MidBlock, "mid", plan)(
            chans[-1],
            self._resnet_factory(scale),
            self._attention_factory(spec.mid_attention, -1, scale),
            recompute=layers_of("mid", plan),
        )
        self.up = self._up_path(plan)
        self.conv_norm_out = norm_layer(chans[0], **norm_kwargs(spec))
        self.conv_out = conv3x3(spec.out_channels)

    @nn.nowrap
    def _down_path(self, plan: CheckpointPlan) -> list[DownBlock]:
        spec = self.resolved_spec
        return [
            block_class(DownBlock, b.name, plan)(
                b.in_ch,
                b.out_ch,
                spec.layers_per_block,
                self._resnet_factory(1.0),
                self._attention_factory(b.attention, b.level),
                b.downsample_padding,
                recompute=layers_of(b.name, plan),
            )
            for b in down_blocks(spec)
        ]

    @nn.nowrap
    def _up_path(self, plan: CheckpointPlan) -> list[UpBlock]:
        return [
            block_class(UpBlock, b.name, plan)(
                b.in_ch,
                b.out_ch,
                b.skip_channels,
                self._resnet_factory(1.0),
                self._attention_factory(b.attention, b.level),
                add_upsample=b.upsample,
                recompute=layers_of(b.name, plan),
            )
            for b in up_blocks(self.resolved_spec)
        ]

    @nn.nowrap
    def _resnet_factory(self, output_scale: float) -> functools.partial:
        return functools.partial(ResnetBlock, **resnet_kwargs(self.resolved_spec, output_scale))

    @nn.nowrap
    def _attention_factory(self, kind: str, level: int, output_scale: float = 1.0) -> AttentionFactory | None:
        if kind == "none":
            return None
        kwargs = attention_kwargs(self.resolved_spec, kind, level, output_scale)
        return functools.partial(ATTENTION[kind], **kwargs, query_chunk=self.attention_chunk)

    def __call__(self, x: Array, t: Array | float, context: Array | None = None, train: bool = False) -> Array:
        """Predict the noise (or whatever the spec was trained on) for NHWC ``x`` at timestep ``t``.

        ``t`` is a scalar or has shape (B,); ``context`` (B, L, cross_attention_dim) is required
        when the spec has cross-attention. ``train=True`` turns dropout on (rng ``"dropout"``) and,
        with ``norm_kind: batch``, normalises with batch statistics and updates ``"batch_stats"``
        (pass ``mutable=["batch_stats"]``).
        """
        s = self.resolved_spec
        if s.cross_attention_dim is not None and context is None:
            raise ValueError(
                f"context: spec {s.name!r} has cross-attention; pass context of shape (B, L, {s.cross_attention_dim})"
            )
        t = jnp.broadcast_to(jnp.asarray(t), (x.shape[0],))
        te = s.time_embedding
        # The sinusoids are float32 whatever ``t`` is; in x's dtype (a no-op for float32), so that a
        # bf16 forward stays bf16: float32 temb added to bf16 activations would promote the rest.
        features = timestep_embedding(t, s.block_out_channels[0], te.flip_sin_to_cos, te.freq_shift, te.max_period)
        temb = self.time_embedding(features.astype(x.dtype))
        h = self.conv_in(x)
        skips = [h]
        for block in self.down:
            skips += block(h, temb, context, train)  # positional: `train` is static under remat
            h = skips[-1]
        h = self.mid(h, temb, context, train)
        for block in self.up:
            count = len(block.skip_channels)
            h = block(h, tuple(skips[-count:]), temb, context, train)
            del skips[-count:]
        return self.conv_out(nn.silu(apply_norm(self.conv_norm_out, h, train)))

    @nn.nowrap
    def block_names(self, layers: bool = False) -> list[str]:
        """Names a checkpoint plan can use: blocks, or with ``layers=True`` ResNets/attentions."""
        spec = self.resolved_spec
        return layer_names(spec) if layers else block_names(spec)
