"""A ControlNet, framework-free: its spec (the U-Net's encoder and middle block under the same names, a
conditioning embedding, zero 1x1 convs per residual), its plan vocabulary and the residuals it hands a U-Net.
Built by `torch_impl/controlnet.py` and `jax_impl/controlnet.py`; docs/diffusers.md, docs/planning.md.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import Field, field_validator, model_validator

from shared_configs.inputs import check_inputs
from shared_configs.loader import load_spec, read_yaml, validated
from shared_configs.spec import SpecError, UNetSpec
from shared_configs.spec_base import Bool, Int, _Frozen
from shared_configs.vocabulary import CheckpointPlan, Policy, block_names, layer_names, resolve_plan

A = TypeVar("A")


class ControlNetSpec(_Frozen):
    """A ControlNet on ``unet``'s encoder and middle block; ``unet``: a `UNetSpec`, its fields, or a preset name."""

    name: str = "controlnet"
    unet: UNetSpec
    conditioning_channels: Int = Field(default=3, gt=0, description="channels of the conditioning image")
    conditioning_embedding_out_channels: tuple[Annotated[Int, Field(gt=0)], ...] = Field(
        default=(16, 32, 96, 256), min_length=1, description="widths, one per stage"
    )
    global_pool_conditions: Bool = Field(default=False, description="average each residual over H, W")
    conditioning_channel_order: Literal["rgb", "bgr"] = Field(
        default="rgb", description="bgr: the conditioning image's channels are reversed first (diffusers' option)"
    )

    @field_validator("unet", mode="before")
    @classmethod
    def _preset(cls, value: Any) -> Any:
        """``unet: sd_narrow`` (a preset name or a spec file) in YAML or code."""
        return load_spec(value) if isinstance(value, str) else value

    @property
    def conditioning_factor(self) -> int:
        """How many times larger than the sample the conditioning image is (each side)."""
        return 2 ** (len(self.conditioning_embedding_out_channels) - 1)

    @model_validator(mode="after")
    def _check(self) -> ControlNetSpec:
        unet = self.unet
        kinds = (*unet.down_attention, unet.mid_attention)
        unsupported = {  # U-Net options diffusers' ControlNetModel has no counterpart of
            "time_embedding.cond_dim": unet.time_embedding.cond_dim is not None,
            "image_embedding": unet.image_embedding is not None,
            "context_proj_dim": unet.context_proj_dim is not None,
            "resampler": unet.resampler != "conv",
            "down_attention/mid_attention": "simple_cross" in kinds,
        }
        if used := [field for field, on in unsupported.items() if on]:
            raise SpecError(f"unet.{used[0]}: not supported in a ControlNet (diffusers' ControlNetModel has none)")
        return self


def load_controlnet_spec(source: str | Path | Mapping[str, Any]) -> ControlNetSpec:
    """A `ControlNetSpec` from a YAML file or a mapping; a bad one is a `SpecError` naming the field."""
    return validated(ControlNetSpec, source if isinstance(source, Mapping) else read_yaml(Path(source)))


def residual_shapes(spec: UNetSpec, batch: int, size: int) -> tuple[list[tuple[int, ...]], tuple[int, ...]]:
    """NCHW shapes of the residuals a U-Net takes on a ``size`` x ``size`` sample: one per skip, and the middle's."""
    chans, n = spec.block_out_channels, spec.num_levels
    down = [(batch, chans[0], size, size)]
    for level, ch in enumerate(chans):
        side = size // 2**level
        down += [(batch, ch, side, side)] * spec.layers_per_block
        if level < n - 1:
            down.append((batch, ch, side // 2, side // 2))
    return down, (batch, chans[-1], side, side)  # the deepest level's side


def add_residuals(spec: UNetSpec, h: A, skips: list[A], down: Sequence[A] | None, mid: A | None) -> tuple[A, list[A]]:
    """``(h + mid, [skip + residual, ...])`` as diffusers adds a ControlNet's residuals (torch or jax arrays)."""
    if down is not None:
        if len(down) != len(skips):
            raise ValueError(
                f"down_block_additional_residuals: expected {len(skips)} tensors (one per skip: conv_in, "
                f"each ResNet, each downsample of spec {spec.name!r}), got {len(down)}"
            )
        skips = [s + r for s, r in zip(skips, down, strict=True)]
    if mid is not None:
        h = h + mid
    return h, skips


def controlnet_residuals(
    spec: ControlNetSpec,
    h: A,
    skips: list[A],
    down_convs: Sequence[Callable[[A], A]],
    mid_conv: Callable[[A], A],
    scale: float,
    guess_mode: bool,
    pool: Callable[[A], A],
) -> tuple[list[A], A]:
    """The ControlNet's outputs from its trunk's (torch or jax arrays): each skip, then the middle block's output,
    through its zero conv, times ``scale`` (``guess_mode``, unpooled: a logspace from 0.1 of it up to it, as
    diffusers), each averaged over H, W by ``pool`` under ``global_pool_conditions``."""
    count = len(skips)
    if guess_mode and not spec.global_pool_conditions:
        scales = [scale * 10.0 ** (-1 + i / count) for i in range(count + 1)]
    else:
        scales = [scale] * (count + 1)
    down = [conv(s) * f for conv, s, f in zip(down_convs, skips, scales[:-1], strict=True)]
    mid = mid_conv(h) * scales[-1]
    if spec.global_pool_conditions:
        return [pool(r) for r in down], pool(mid)
    return down, mid


def check_controlnet_inputs(
    spec: ControlNetSpec, layout: str, sample: Any, timestep: Any, cond: Any, **conditioning: Any
) -> None:
    """`check_inputs` of the U-Net's inputs, then the conditioning image's shape: one `ValueError` naming what
    the spec expects."""
    check_inputs(spec.unet, layout, sample, timestep, **conditioning)
    f, c, shape = spec.conditioning_factor, spec.conditioning_channels, tuple(sample.shape)
    n, h, w = (shape[0], *shape[2:4]) if layout == "NCHW" else shape[:3]
    want = (n, c, h * f, w * f) if layout == "NCHW" else (n, h * f, w * f, c)
    if tuple(cond.shape) != want:
        raise ValueError(
            f"controlnet_cond: expected {layout} shape {want} ({c} channels at {f}x the sample's size), "
            f"got {tuple(cond.shape)}"
        )


def controlnet_names(spec: ControlNetSpec | UNetSpec, layers: bool = False) -> list[str]:
    """The units a ControlNet's plan can name: the U-Net's ``down.*`` and ``mid`` (blocks, or layers)."""
    unet = spec.unet if isinstance(spec, ControlNetSpec) else spec
    return [n for n in (layer_names(unet) if layers else block_names(unet)) if not n.startswith("up.")]


def resolve_controlnet_plan(spec: ControlNetSpec, policy: Policy | CheckpointPlan = None) -> CheckpointPlan:
    """A plan for the ControlNet, resolved as for its U-Net, keeping its units (naming an ``up.*`` is refused)."""
    plan = resolve_plan(spec.unet, policy)  # None: the U-Net spec's own `checkpoint`
    # the units written out in a policy (a string or a list of names; a named policy writes none)
    written = policy.recompute if isinstance(policy, CheckpointPlan) else re.findall(r"[\w.]+", str(policy or ""))
    if missing := [n for n in written if n.startswith("up.")]:
        raise SpecError(f"policy: a ControlNet has no unit {missing[0]!r} (it has down.* and mid)")
    keep = tuple(n for n in plan.recompute if not n.startswith("up."))
    unit_save = tuple((n, ops) for n, ops in plan.unit_save if not n.startswith("up."))
    return plan if keep == plan.recompute else CheckpointPlan(plan.policy, keep, plan.save, plan.offload, unit_save)
