"""The framework-free U-Net architecture spec (validated, frozen).

One `UNetSpec` describes both families people train:

* DDPM-style pixel U-Nets (diffusers ``UNet2DModel``): ResNet blocks with a timestep
  embedding, GroupNorm + SiLU, dropout, plain self-attention blocks (``attention: self``).
* Stable-Diffusion-style latent U-Nets (diffusers ``UNet2DConditionModel``): the same with
  Transformer2D blocks (``attention: transformer``): GroupNorm, projection in/out,
  self-attention, cross-attention over ``context`` when ``cross_attention_dim`` is set,
  GEGLU feed-forward.

Every default that differs between PyTorch and Flax (norm eps, attention scale) is a field
here, so neither framework's default ever leaks into the model.

Norms (``norm_kind``): ``group`` (the default, as diffusers) or ``batch`` for the ResNet norms
and the output norm; attention/transformer GroupNorms stay GroupNorms. BatchNorm keeps running
statistics, updated in train mode with weight ``norm_momentum`` on the new batch (torch's
``momentum``; Flax's ``momentum`` is ``1 - norm_momentum``). One honest difference remains:
torch's ``running_var`` takes the *unbiased* batch variance (times n/(n-1), n = B*H*W), Flax's
``batch_stats["var"]`` the *biased* one; Flax's own BatchNorm offers no switch. Outputs in train
mode (batch statistics, biased in both) and in eval mode from the same running statistics agree;
only the running variance each framework accumulates differs, by that factor on the batch term
(tested in ``tests/test_caveats.py``). Checkpointing BatchNorm: see ``torch_impl/batchnorm.py``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

AttentionKind = Literal["none", "self", "transformer"]
ATTENTION_KINDS: tuple[str, ...] = ("none", "self", "transformer")
NormKind = Literal["group", "batch"]
NORM_KINDS: tuple[str, ...] = ("group", "batch")


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)


class TimeEmbeddingSpec(_Frozen):
    """Sinusoidal timestep projection followed by a 2-layer MLP (diffusers ``positional``)."""

    flip_sin_to_cos: bool = True
    freq_shift: float = 0.0
    max_period: float = 10000.0
    dim: int | None = Field(default=None, gt=0, description="MLP width; default 4 * channels[0]")


class UNetSpec(_Frozen):
    """A diffusion U-Net, level by level. Lists run from the highest resolution down."""

    name: str = "unnamed"
    in_channels: int = Field(gt=0)
    out_channels: int = Field(gt=0)
    sample_size: int = Field(gt=0, description="spatial size (square) used by benchmarks/tests")
    block_out_channels: tuple[int, ...] = Field(min_length=1)
    layers_per_block: int = Field(default=2, gt=0)
    down_attention: tuple[AttentionKind, ...]
    up_attention: tuple[AttentionKind, ...] | None = Field(
        default=None, description="up blocks, deepest first; default: down_attention reversed"
    )
    mid_attention: AttentionKind = "self"
    # Exactly one of these two sets the heads (an int for all levels or one per level);
    # the middle block uses the deepest level's value.
    attention_head_dim: int | tuple[int, ...] | None = None
    num_attention_heads: int | tuple[int, ...] | None = None
    attention_scale: float | None = Field(default=None, gt=0, description="softmax scale; None means 1/sqrt(head_dim)")
    cross_attention_dim: int | None = Field(default=None, gt=0)
    transformer_layers_per_block: int | tuple[int, ...] = Field(
        default=1, description="transformer layers per Transformer2D block: one for all levels, or one per level"
    )
    use_linear_projection: bool = False
    norm_kind: NormKind = Field(default="group", description="ResNet and output norms (see NORM_KINDS)")
    norm_momentum: float = Field(
        default=0.1, gt=0.0, lt=1.0, description="BatchNorm running-stat weight of the new batch (torch convention)"
    )
    norm_num_groups: int = Field(default=32, gt=0)
    norm_eps: float = Field(default=1e-5, gt=0, description="ResNet, self-attention, output norms")
    transformer_norm_eps: float = Field(default=1e-6, gt=0, description="Transformer2D GroupNorm")
    layer_norm_eps: float = Field(default=1e-5, gt=0, description="LayerNorms in transformers")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    resnet_time_scale_shift: Literal["default", "scale_shift"] = "default"
    downsample_padding: int = Field(default=1, ge=0, le=1)
    mid_block_scale_factor: float = Field(default=1.0, gt=0)
    time_embedding: TimeEmbeddingSpec = TimeEmbeddingSpec()
    checkpoint: str | tuple[str, ...] | None = Field(
        default=None, description="default checkpoint policy (see shared_configs.plan)"
    )

    @property
    def num_levels(self) -> int:
        return len(self.block_out_channels)

    @property
    def time_embed_dim(self) -> int:
        return self.time_embedding.dim or 4 * self.block_out_channels[0]

    @property
    def up_attention_resolved(self) -> tuple[str, ...]:
        return self.up_attention or tuple(reversed(self.down_attention))

    def transformer_depth(self, level: int) -> int:
        """Transformer layers of a Transformer2D block at a level (``-1``: the middle block's)."""
        return _per_level(self.transformer_layers_per_block, level, self.num_levels)

    def heads(self, level: int) -> int:
        """Number of attention heads at a down level (``-1`` is the deepest / the middle)."""
        channels = self.block_out_channels[level]
        if self.num_attention_heads is not None:
            return _per_level(self.num_attention_heads, level, self.num_levels)
        if self.attention_head_dim is not None:
            return channels // _per_level(self.attention_head_dim, level, self.num_levels)
        return 1

    @model_validator(mode="after")
    def _check_dimensions(self) -> UNetSpec:
        n = self.num_levels
        _require(len(self.down_attention) == n, "down_attention", f"needs {n} entries, one per level")
        if self.up_attention is not None:
            _require(len(self.up_attention) == n, "up_attention", f"needs {n} entries, one per level")
        _require(
            (self.attention_head_dim is None) or (self.num_attention_heads is None),
            "attention_head_dim",
            "set attention_head_dim or num_attention_heads, not both",
        )
        for field in ("attention_head_dim", "num_attention_heads", "transformer_layers_per_block"):
            value = getattr(self, field)
            if isinstance(value, tuple):
                _require(len(value) == n, field, f"needs {n} entries, one per level")
            for v in value if isinstance(value, tuple) else ((value,) if value is not None else ()):
                _require(v > 0, field, "must be positive")
        factor = 2 ** (n - 1)
        _require(
            self.sample_size % factor == 0,
            "sample_size",
            f"{self.sample_size} is not divisible by the downsampling factor {factor}",
        )
        attention_levels = self._attention_levels()
        for level, ch in enumerate(self.block_out_channels):
            _require(ch > 0, "block_out_channels", "must be positive")
            _require(
                ch % self.norm_num_groups == 0,
                "norm_num_groups",
                f"block_out_channels[{level}]={ch} is not divisible by {self.norm_num_groups} groups",
            )
            if level in attention_levels:
                self._check_heads(level, ch)
        return self

    def _check_heads(self, level: int, ch: int) -> None:
        if self.attention_head_dim is not None:
            field, size = "attention_head_dim", _per_level(self.attention_head_dim, level, self.num_levels)
        else:
            field, size = "num_attention_heads", self.heads(level)
        _require(ch % size == 0, field, f"block_out_channels[{level}]={ch} does not split into heads of {field}={size}")

    def _attention_levels(self) -> set[int]:
        levels = {i for i, a in enumerate(self.down_attention) if a != "none"}
        levels |= {self.num_levels - 1 - i for i, a in enumerate(self.up_attention_resolved) if a != "none"}
        if self.mid_attention != "none":
            levels.add(self.num_levels - 1)
        return levels


def _per_level(value: int | tuple[int, ...], level: int, n: int) -> int:
    return value[level % n] if isinstance(value, tuple) else value


class SpecError(ValueError):
    """A spec or policy problem, reported as one line naming the field."""


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise SpecError(f"{field}: {message}")
