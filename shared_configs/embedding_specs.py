"""The embeddings beside the timestep's in a `shared_configs.spec.UNetSpec` (re-exported there): the
time embedding's options, class conditioning, SDXL's text_time and Kandinsky 2.2's image conditioning."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shared_configs.spec_base import Bool, Float, Int, _Frozen, _require

ClassEmbeddingKind = Literal["embedding", "timestep", "identity", "projection", "simple_projection"]


class TimeEmbeddingSpec(_Frozen):
    """Sinusoidal timestep projection followed by a 2-layer MLP (diffusers ``positional``)."""

    flip_sin_to_cos: Bool = True
    freq_shift: Float = 0.0
    max_period: Float = Field(default=10000.0, gt=0)
    dim: Int | None = Field(default=None, gt=0, description="MLP width; default 4 * channels[0]")
    cond_dim: Int | None = Field(
        default=None, gt=0, description="width of timestep_cond, projected onto the sinusoids (LCM; time_cond_proj_dim)"
    )


class ClassEmbeddingSpec(_Frozen):
    """Class conditioning added to (or concatenated with) the timestep embedding (diffusers' ``class_embed_type``):
    ids (B,) for ``embedding`` (a table) and ``timestep`` (sinusoids + MLP); vectors (B, ``input_dim``) for
    ``projection`` (MLP) and ``simple_projection`` (Linear); ``identity``: vectors of the time embedding's width."""

    kind: ClassEmbeddingKind
    num_classes: Int | None = Field(default=None, gt=0, description="embedding: rows of the table")
    input_dim: Int | None = Field(default=None, gt=0, description="projection kinds: width of class_labels")
    concat: Bool = Field(default=False, description="concatenate with the time embedding (blocks see twice the width)")

    @model_validator(mode="after")
    def _check_kind(self) -> ClassEmbeddingSpec:
        needs = {"embedding": "num_classes", "projection": "input_dim", "simple_projection": "input_dim"}
        for field in ("num_classes", "input_dim"):
            wanted = needs.get(self.kind) == field
            _require(not wanted or getattr(self, field) is not None, field, f"required by kind {self.kind!r}")
            _require(wanted or getattr(self, field) is None, field, f"not used by kind {self.kind!r} (remove it)")
        return self


class AdditionEmbeddingSpec(_Frozen):
    """SDXL's ``text_time`` conditioning: ``time_ids`` (B, N) as sinusoids, concatenated with ``text_embeds`` (B, D),
    through an MLP from ``input_dim = D + N * time_id_dim``, added to the time embedding. Only ``input_dim`` is
    part of the network; ``num_time_ids`` is how example inputs split it (SDXL's refiner passes 5)."""

    kind: Literal["text_time"] = "text_time"
    time_id_dim: Int = Field(gt=0, description="sinusoid width per time id (addition_time_embed_dim)")
    input_dim: Int = Field(gt=0, description="MLP input: text_embeds width + num_time_ids * time_id_dim")
    num_time_ids: Int = Field(default=6, gt=0, description="time ids per sample in example inputs")

    @property
    def text_embeds_dim(self) -> int:
        """Width of ``text_embeds`` beside ``num_time_ids`` time ids."""
        return self.input_dim - self.num_time_ids * self.time_id_dim

    @model_validator(mode="after")
    def _check_split(self) -> AdditionEmbeddingSpec:
        _require(
            self.text_embeds_dim > 0,
            "num_time_ids",
            f"{self.num_time_ids} time ids x {self.time_id_dim} "
            f"leave no text_embeds width in input_dim={self.input_dim}",
        )
        return self


class ImageEmbeddingSpec(_Frozen):
    """Conditioning on ``image_embeds`` (B, ``input_dim``) as Kandinsky 2.2's decoder: Linear + LayerNorm added to
    the time embedding (``add_to_time``), and/or made into ``context_tokens`` tokens of cross-attention context."""

    input_dim: Int = Field(gt=0, description="width of image_embeds (diffusers encoder_hid_dim)")
    add_to_time: Bool = True
    context_tokens: Int | None = Field(default=32, gt=0, description="None: the context is an input")
    norm_eps: Float = Field(default=1e-5, gt=0, description="both LayerNorms")

    @model_validator(mode="after")
    def _check_use(self) -> ImageEmbeddingSpec:
        _require(
            self.add_to_time or self.context_tokens is not None,
            "image_embedding",
            "neither used: set add_to_time or context_tokens",
        )
        return self
