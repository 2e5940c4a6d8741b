"""The Flax ControlNet: the U-Net's encoder and middle block (`UNetTrunk`, the same code and names), a
conditioning embedding and zero convolutions (`shared_configs.controlnet`). Mirrors `torch_impl/controlnet.py`
on NHWC input; its parameter tree mirrors torch's state_dict, so `jax_impl.convert` converts it as the U-Net's.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from flax import linen as nn

from jax_impl.layers import PAD_1, Conv, conv3x3
from jax_impl.unet import PolicyArg, UNetTrunk, abstract_inputs
from shared_configs import CheckpointPlan, UNetSpec
from shared_configs.controlnet import (
    ControlNetSpec,
    check_controlnet_inputs,
    controlnet_names,
    controlnet_residuals,
    residual_shapes,
    resolve_controlnet_plan,
)

Array = jax.Array


def zero_conv(features: int, kernel: int = 1) -> Conv:
    """A convolution whose kernel and bias start at zero: a fresh ControlNet changes nothing."""
    zeros = nn.initializers.zeros
    return Conv(features, (kernel, kernel), padding=((kernel // 2,) * 2,) * 2, kernel_init=zeros, bias_init=zeros)


class ConditioningEmbedding(nn.Module):
    """diffusers' ``ControlNetConditioningEmbedding``: the conditioning image -> ``out_ch`` channels at the
    sample's size (3x3 convs, a strided one per further stage, SiLU after each; the last zero-initialised)."""

    out_ch: int
    widths: tuple[int, ...]

    def setup(self) -> None:
        self.conv_in = conv3x3(self.widths[0])
        self.blocks = [
            c
            for a, b in itertools.pairwise(self.widths)
            for c in (conv3x3(a), Conv(b, (3, 3), strides=(2, 2), padding=PAD_1))
        ]
        self.conv_out = zero_conv(self.out_ch, 3)

    def __call__(self, cond: Array) -> Array:
        h = nn.silu(self.conv_in(cond))
        for conv in self.blocks:
            h = nn.silu(conv(h))
        return self.conv_out(h)


class ControlNet(UNetTrunk):
    """ControlNet on NHWC input: ``apply(variables, sample, timestep, context, controlnet_cond, ...)`` -> the NHWC
    residuals for ``jax_impl.UNet``, in diffusers' order. Attributes and plan unit names as the U-Net's."""

    spec: ControlNetSpec
    policy: PolicyArg = None
    attention_chunk: int | None = None
    lora_rank: int | None = None

    @property
    def trunk_spec(self) -> UNetSpec:
        return self.spec.unet

    @functools.cached_property
    def plan(self) -> CheckpointPlan:
        """The resolved checkpoint plan (`shared_configs.controlnet.resolve_controlnet_plan`)."""
        return resolve_controlnet_plan(self.spec, self.policy)

    def setup(self) -> None:
        unet = self.spec.unet
        self._setup_trunk(self.plan)
        self.controlnet_cond_embedding = ConditioningEmbedding(
            unet.block_out_channels[0], tuple(self.spec.conditioning_embedding_out_channels)
        )
        down, mid = residual_shapes(unet, 1, 2 ** (unet.num_levels - 1))
        self.controlnet_down_blocks = [zero_conv(shape[1]) for shape in down]
        self.controlnet_mid_block = zero_conv(mid[1])

    def __call__(
        self,
        sample: Array,
        timestep: Array | float,
        context: Array | None,
        controlnet_cond: Array,
        conditioning_scale: float = 1.0,
        class_labels: Array | None = None,
        text_embeds: Array | None = None,
        time_ids: Array | None = None,
        guess_mode: bool = False,
        train: bool = False,
    ) -> tuple[list[Array], Array]:
        """The residuals for ``sample`` under ``controlnet_cond`` (NHWC, `conditioning_factor` x as large)."""
        check_controlnet_inputs(
            self.spec,
            "NHWC",
            sample,
            timestep,
            controlnet_cond,
            context=context,
            class_labels=class_labels,
            text_embeds=text_embeds,
            time_ids=time_ids,
        )
        if self.spec.conditioning_channel_order == "bgr":
            controlnet_cond = controlnet_cond[..., ::-1]
        temb = self._embedding(sample, timestep, class_labels, text_embeds, time_ids)
        h, skips = self._encode(sample, temb, context, train, hint=self.controlnet_cond_embedding(controlnet_cond))
        return controlnet_residuals(
            self.spec,
            h,
            skips,
            self.controlnet_down_blocks,
            self.controlnet_mid_block,
            conditioning_scale,
            guess_mode,
            pool=lambda r: r.mean(axis=(1, 2), keepdims=True),
        )

    @nn.nowrap
    def block_names(self, layers: bool = False) -> list[str]:
        """Names a checkpoint plan can use: ``down.*`` and ``mid``, or with ``layers=True`` their layers."""
        return controlnet_names(self.spec, layers)


def abstract_controlnet_inputs(spec: ControlNetSpec, batch: int = 1) -> dict[str, jax.ShapeDtypeStruct | None]:
    """Shape structs of every input of ``spec``'s ControlNet (NHWC), by name, at the smallest sizes."""
    inputs = abstract_inputs(spec.unet, batch)
    size = inputs["x"].shape[1] * spec.conditioning_factor
    cond = jax.ShapeDtypeStruct((batch, size, size, spec.conditioning_channels), jnp.float32)
    # the U-Net's inputs under the ControlNet's names, the conditioning image after them
    named = {"sample": inputs.pop("x"), "timestep": inputs.pop("t"), "context": inputs.pop("context")}
    return named | {"controlnet_cond": cond} | inputs


def controlnet_from_unet(
    unet_params: dict, spec: UNetSpec, rng: jax.Array | None = None, policy: PolicyArg = None, **options: object
) -> tuple[ControlNet, dict]:
    """``(module, params)``: a ControlNet on ``spec``, its encoder the U-Net's (``from_unet``); ``options``: spec's."""
    cspec = ControlNetSpec(name=f"{spec.name}_controlnet", unet=spec, **options)
    module = ControlNet(spec=cspec, policy=policy)
    inputs = jax.tree.map(jnp.zeros_like, abstract_controlnet_inputs(cspec))
    fresh = module.init(rng if rng is not None else jax.random.key(0), **inputs)["params"]
    return module, {k: unet_params.get(k, v) for k, v in fresh.items()}  # the trunk's names are the U-Net's
