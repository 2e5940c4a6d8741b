"""The framework-free U-Net architecture spec (validated, frozen), read by both frameworks: diffusers' pixel and
latent U-Nets, their conditioning and norms, every default that differs between PyTorch and Flax a field. YAML
comes in through `shared_configs.loader`. The manual: docs/spec_and_plans.md.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from shared_configs.embedding_specs import (
    AdditionEmbeddingSpec,
    ClassEmbeddingSpec,
    ImageEmbeddingSpec,
    TimeEmbeddingSpec,
)
from shared_configs.spec_base import Bool, Float, Int, _Frozen, _require
from shared_configs.spec_base import SpecError as SpecError  # re-exported

# simple_cross: diffusers' SimpleCrossAttn blocks (Kandinsky 2.2, DeepFloyd IF, UnCLIP): one attention over
# the context's added key/value projections and the block's own tokens.
AttentionKind = Literal["none", "self", "transformer", "simple_cross"]
CONTEXT_KINDS: tuple[str, ...] = ("transformer", "simple_cross")  # the attentions that read the context
NormKind = Literal["group", "batch"]


class UNetSpec(_Frozen):
    """A diffusion U-Net, level by level. Lists run from the highest resolution down."""

    name: str = "unnamed"
    in_channels: Int = Field(gt=0)
    out_channels: Int = Field(gt=0)
    sample_size: Int = Field(gt=0, description="the input's spatial size (square), the tools' default")
    block_out_channels: tuple[Annotated[Int, Field(gt=0)], ...] = Field(min_length=1)
    layers_per_block: Int = Field(default=2, gt=0)
    down_attention: tuple[AttentionKind, ...]
    up_attention: tuple[AttentionKind, ...] | None = Field(
        default=None, description="up blocks, deepest first; default: down_attention reversed"
    )
    mid_attention: AttentionKind = "self"
    # Heads, an int for all levels or one per level (the middle block uses the deepest level's):
    # one of the two sets them, the other follows (channels = heads * head_dim); both set means
    # exactly that many heads of that size (heads * head_dim may then differ from the channels,
    # as diffusers builds when they do not divide).
    attention_head_dim: Int | tuple[Int, ...] | None = None
    num_attention_heads: Int | tuple[Int, ...] | None = None
    block_heads: tuple[tuple[str, Int, Int], ...] = Field(
        default=(),
        description="(block, heads, head_dim) for a "
        "block whose attention differs from its level's heads (diffusers' Attn*Block2D in a UNet2DConditionModel); "
        "blocks: down.i, mid, up.i",
    )
    attention_scale: Float | None = Field(default=None, gt=0, description="softmax scale; None: 1/sqrt(head_dim)")
    cross_attention_dim: Int | None = Field(default=None, gt=0)
    transformer_layers_per_block: Int | tuple[Int, ...] = Field(
        default=1, description="transformer layers per Transformer2D block: one for all levels, or one per level"
    )
    use_linear_projection: Bool = False
    norm_kind: NormKind = Field(default="group", description="ResNet and output norms")
    norm_momentum: Float = Field(
        default=0.1, gt=0.0, lt=1.0, description="BatchNorm running-stat weight of the new batch (torch convention)"
    )
    norm_num_groups: Int = Field(default=32, gt=0)
    mid_attention_norm_groups: Int | None = Field(
        default=None,
        ge=0,
        description="GroupNorm groups of a middle self-attention; None: norm_num_groups; 0: no GroupNorm",
    )
    norm_eps: Float = Field(default=1e-5, gt=0, description="ResNet, self-attention, output norms")
    transformer_norm_eps: Float = Field(default=1e-6, gt=0, description="Transformer2D GroupNorm")
    layer_norm_eps: Float = Field(default=1e-5, gt=0, description="LayerNorms in transformers")
    dropout: Float = Field(default=0.0, ge=0.0, lt=1.0)
    resnet_time_scale_shift: Literal["default", "scale_shift"] = "default"
    resampler: Literal["conv", "resnet"] = Field(
        default="conv",
        description="resnet: a ResNet down/upsamples "
        "between levels (diffusers' ResnetDownsample, SimpleCrossAttn blocks)",
    )
    resnet_skip_time_act: Bool = Field(
        default=False,
        description="no SiLU on the embedding in the resampler="
        "resnet blocks' and a simple_cross middle block's ResNets",
    )
    resnet_out_scale_factor: Float = Field(
        default=1.0, gt=0, description="output divisor of resampler=resnet blocks' ResNets"
    )
    context_norm_groups: Int | None = Field(
        default=None,
        gt=0,
        description="simple_cross: GroupNorm of this many "
        "groups over the context (diffusers cross_attention_norm: group_norm, 32)",
    )
    context_proj_dim: Int | None = Field(
        default=None,
        gt=0,
        description="context input width, projected to "
        "cross_attention_dim by a Linear (diffusers encoder_hid_dim_type: text_proj)",
    )
    downsample_padding: Int = Field(default=1, ge=0, le=1)
    mid_block_scale_factor: Float = Field(default=1.0, gt=0)
    time_embedding: TimeEmbeddingSpec = TimeEmbeddingSpec()
    class_embedding: ClassEmbeddingSpec | None = Field(default=None, description="class conditioning (class_labels)")
    addition_embedding: AdditionEmbeddingSpec | None = Field(
        default=None, description="SDXL text_time (text_embeds, time_ids)"
    )
    image_embedding: ImageEmbeddingSpec | None = Field(default=None, description="image_embeds conditioning")
    checkpoint: str | tuple[str, ...] | None = Field(
        default=None, description="default checkpoint policy (vocabulary.py)"
    )

    @property
    def num_levels(self) -> int:
        return len(self.block_out_channels)

    @property
    def time_embed_dim(self) -> int:
        return self.time_embedding.dim or 4 * self.block_out_channels[0]

    @property
    def block_temb_dim(self) -> int:
        """Width of the embedding the ResNets receive: doubled when class embeddings are concatenated."""
        return self.time_embed_dim * (2 if self.class_embedding is not None and self.class_embedding.concat else 1)

    @property
    def reads_context(self) -> bool:
        """Whether any attention reads a cross-attention context."""
        kinds = (*self.down_attention, *self.up_attention_resolved, self.mid_attention)
        return self.cross_attention_dim is not None and any(k in CONTEXT_KINDS for k in kinds)

    @property
    def context_input_dim(self) -> int | None:
        """The width of the ``context`` input; None when the spec takes none (or makes it from ``image_embeds``)."""
        img = self.image_embedding
        if self.cross_attention_dim is None or (img is not None and img.context_tokens is not None):
            return None
        return self.context_proj_dim or self.cross_attention_dim

    @property
    def up_attention_resolved(self) -> tuple[str, ...]:
        return self.up_attention or tuple(reversed(self.down_attention))

    @property
    def attention_levels(self) -> tuple[int, ...]:
        """Levels with an attention layer anywhere (down, up, or the middle at the deepest), sorted."""
        n = self.num_levels
        levels = {i for i, a in enumerate(self.down_attention) if a != "none"}
        levels |= {n - 1 - i for i, a in enumerate(self.up_attention_resolved) if a != "none"}
        if self.mid_attention != "none":
            levels.add(n - 1)
        return tuple(sorted(levels))

    def transformer_depth(self, level: int) -> int:
        """Transformer layers of a Transformer2D block at a level (``-1``: the middle block's)."""
        return _per_level(self.transformer_layers_per_block, level, self.num_levels)

    def heads(self, level: int) -> int:
        """Number of attention heads at a down level (``-1`` is the deepest / the middle)."""
        if self.num_attention_heads is not None:
            return _per_level(self.num_attention_heads, level, self.num_levels)
        if self.attention_head_dim is not None:
            return self.block_out_channels[level] // _per_level(self.attention_head_dim, level, self.num_levels)
        return 1

    def attention_shape(self, block: str, level: int) -> tuple[int, int]:
        """(heads, head_dim) of the attention in ``block`` (``"up.1"``) at ``level`` (`block_heads` first)."""
        own = {name: (heads, head_dim) for name, heads, head_dim in self.block_heads}
        return own.get(block) or (self.heads(level), self.head_dim(level))

    def head_dim(self, level: int) -> int:
        """Channels per attention head at a level; ``heads * head_dim`` is the attention's width."""
        if self.attention_head_dim is not None:
            return _per_level(self.attention_head_dim, level, self.num_levels)
        return self.block_out_channels[level] // self.heads(level)

    @model_validator(mode="after")
    def _check_dimensions(self) -> UNetSpec:
        n = self.num_levels
        _require(len(self.down_attention) == n, "down_attention", f"needs {n} entries, one per level")
        _require(
            self.up_attention is None or len(self.up_attention) == n,
            "up_attention",
            f"needs {n} entries, one per level",
        )
        for field in ("attention_head_dim", "num_attention_heads", "transformer_layers_per_block"):
            value = getattr(self, field)  # an int for every level, one per level, or (heads) None
            values = value if isinstance(value, tuple) else () if value is None else (value,)
            _require(not isinstance(value, tuple) or len(value) == n, field, f"needs {n} entries, one per level")
            _require(all(v > 0 for v in values), field, "must be positive")
        factor = 2 ** (n - 1)
        _require(
            self.sample_size % factor == 0,
            "sample_size",
            f"{self.sample_size} is not divisible by the downsampling factor {factor}",
        )
        self._check_block_heads()
        for level, ch in enumerate(self.block_out_channels):
            _require(
                ch % self.norm_num_groups == 0,
                "norm_num_groups",
                f"block_out_channels[{level}]={ch} is not divisible by {self.norm_num_groups} groups",
            )
            if level in self.attention_levels:
                self._check_heads(level, ch)
        self._check_conditioning()
        self._check_added_options()
        return self

    def _check_added_options(self) -> None:
        """The options of diffusers' Kandinsky / IF / LCM U-Nets: each only where something reads it."""
        simple = "simple_cross" in (*self.down_attention, *self.up_attention_resolved, self.mid_attention)
        _require(not simple or self.cross_attention_dim is not None, "cross_attention_dim", "required by simple_cross")
        skip_readers = self.resampler == "resnet" or self.mid_attention == "simple_cross"
        _require(
            not self.resnet_skip_time_act or skip_readers,
            "resnet_skip_time_act",
            "only read with resampler: resnet or mid_attention: simple_cross",
        )
        _require(
            self.resnet_out_scale_factor == 1.0 or self.resampler == "resnet",
            "resnet_out_scale_factor",
            "only read with resampler: resnet",
        )
        if (groups := self.context_norm_groups) is not None:
            _require(simple, "context_norm_groups", "only read by simple_cross attention")
            _require(
                self.cross_attention_dim % groups == 0,
                "context_norm_groups",
                f"cross_attention_dim={self.cross_attention_dim} is not divisible by {groups} groups",
            )
        img = self.image_embedding
        makes_context = img is not None and img.context_tokens is not None
        projects = self.context_proj_dim is not None
        for field, used in (("context_proj_dim", projects), ("image_embedding", makes_context)):
            _require(not used or self.cross_attention_dim is not None, field, "needs cross_attention_dim")
        _require(
            not (makes_context and projects),
            "context_proj_dim",
            "cannot be combined with image_embedding.context_tokens (one context projection)",
        )
        if img is not None and img.add_to_time:
            _require(
                self.addition_embedding is None,
                "image_embedding.add_to_time",
                "cannot be combined with addition_embedding (one addition embedding)",
            )
            _require(
                self.class_embedding is None or not self.class_embedding.concat,
                "class_embedding.concat",
                "cannot be combined with image_embedding.add_to_time",
            )

    def _check_block_heads(self) -> None:
        names, blocks = [name for name, _, _ in self.block_heads], block_names(self)
        for name, heads, head_dim in self.block_heads:
            _require(name in blocks, "block_heads", f"unknown block {name!r} (valid: {', '.join(blocks)})")
            _require(names.count(name) == 1, "block_heads", f"{name!r} is listed twice")
            _require(heads > 0 and head_dim > 0, "block_heads", f"{name!r}: heads and head_dim must be positive")

    def _check_heads(self, level: int, ch: int) -> None:
        if self.attention_head_dim is not None and self.num_attention_heads is not None:
            return  # both explicit: any positive pair is a network
        if self.attention_head_dim is not None:
            field, size = "attention_head_dim", _per_level(self.attention_head_dim, level, self.num_levels)
        else:
            field, size = "num_attention_heads", self.heads(level)
        _require(ch % size == 0, field, f"block_out_channels[{level}]={ch} does not split into heads of {field}={size}")

    def _check_conditioning(self) -> None:
        """The middle attention's norm and the sinusoids' widths (the checkpoint policy: `shared_configs.loader`)."""
        groups = self.mid_attention_norm_groups
        if groups is not None:
            _require(self.mid_attention == "self", "mid_attention_norm_groups", "only for mid_attention: self")
            deepest = self.block_out_channels[-1]
            _require(
                groups == 0 or deepest % groups == 0,
                "mid_attention_norm_groups",
                f"block_out_channels[-1]={deepest} is not divisible by {groups} groups",
            )
        if self.class_embedding is not None and self.addition_embedding is not None:
            _require(
                not self.class_embedding.concat,
                "class_embedding.concat",
                "cannot be combined with addition_embedding (its MLP output has the unconcatenated width)",
            )
        widths = {"time_embedding.freq_shift": self.block_out_channels[0]}
        if self.addition_embedding is not None:
            widths["addition_embedding.time_id_dim"] = self.addition_embedding.time_id_dim
        for field, width in widths.items():
            # diffusers divides the exponent by (width // 2 - freq_shift): zero would make NaN sinusoids.
            shift = self.time_embedding.freq_shift
            _require(
                width // 2 != shift,
                field,
                f"sinusoids of width {width} with freq_shift={shift} divide by zero "
                "(width // 2 must differ from freq_shift)",
            )


def block_names(spec: UNetSpec) -> list[str]:
    """Coarse blocks in forward order: down.*, mid, up.* (the plan's vocabulary: `shared_configs.vocabulary`)."""
    n = spec.num_levels
    return [f"down.{i}" for i in range(n)] + ["mid"] + [f"up.{i}" for i in range(n)]


def _per_level(value: int | tuple[int, ...], level: int, n: int) -> int:
    return value[level % n] if isinstance(value, tuple) else value
