"""Our spec -> a diffusers ``config.json`` (the inverse of `from_diffusers_config`).

`to_diffusers_config` writes the config of the diffusers class that builds the same network, converts it back
and refuses by name every field that does not survive the round trip (BatchNorm, a custom attention scale, ...).
"""

from __future__ import annotations

import warnings
from typing import Any

from shared_configs.diffusers import unet_config as _config
from shared_configs.diffusers.conditioning import IMAGE_PROJ_TOKENS
from shared_configs.diffusers.unet_config import SAME_FIELDS, attention_blocks, from_diffusers_config
from shared_configs.spec import CONTEXT_KINDS, SpecError, UNetSpec


# (resampler, attention kind) -> diffusers' block type: the inverse of config's tables.
def _inverse(conv: dict[str, str], resnet: dict[str, str]) -> dict[tuple[str, str], str]:
    return {("conv", k): t for t, k in conv.items()} | {("resnet", k): t for t, k in resnet.items()}


DOWN_TYPES = _inverse(_config.DOWN_BLOCKS, _config.RESNET_DOWN_BLOCKS)
UP_TYPES = _inverse(_config.UP_BLOCKS, _config.RESNET_UP_BLOCKS)
MID_TYPES = {k: t for t, k in _config.MID_BLOCKS["UNet2DConditionModel"].items()}
DIFFUSERS_VERSION = "0.42.1"  # the diffusers whose signatures `shared_configs.diffusers.folders` mirrors


def to_diffusers_config(spec: UNetSpec) -> dict[str, Any]:
    """The ``config.json`` of the diffusers U-Net equal to ``spec``; a `SpecError` names a field it cannot express."""
    kinds = (*spec.down_attention, *spec.up_attention_resolved, spec.mid_attention)
    only_conditional = spec.time_embedding.cond_dim, spec.image_embedding, spec.context_proj_dim, spec.resampler
    conditional = any(k in CONTEXT_KINDS for k in kinds) or only_conditional != (None, None, None, "conv")
    config = _conditional(spec) if conditional else _pixel(spec)
    _check_round_trip(spec, config)
    return config


def _common(spec: UNetSpec, cls: str) -> dict[str, Any]:
    time = spec.time_embedding
    return {
        "_class_name": cls,
        "_diffusers_version": DIFFUSERS_VERSION,
        **{k: getattr(spec, k) for k in (*SAME_FIELDS, "sample_size", "layers_per_block")},
        "block_out_channels": list(spec.block_out_channels),
        "down_block_types": [_block_type(DOWN_TYPES, spec, k) for k in spec.down_attention],
        "up_block_types": [_block_type(UP_TYPES, spec, k) for k in spec.up_attention_resolved],
        "flip_sin_to_cos": time.flip_sin_to_cos,
        "freq_shift": time.freq_shift,
        "time_embedding_dim": time.dim,
        **_conditioning(spec),
    }


def _block_type(table: dict[tuple[str, str], str], spec: UNetSpec, kind: str) -> str:
    """The block type of ``kind`` among ``spec.resampler``'s blocks, else the other's (the round trip refuses it)."""
    return table.get((spec.resampler, kind)) or table[("resnet" if spec.resampler == "conv" else "conv", kind)]


def _conditioning(spec: UNetSpec) -> dict[str, Any]:
    """Class and text_time embeddings in diffusers' options (one projection width serves both there)."""
    out: dict[str, Any] = {}
    if (ce := spec.class_embedding) is not None:
        if ce.kind == "embedding":
            out["num_class_embeds"] = ce.num_classes
        else:
            out["class_embed_type"] = ce.kind
        if ce.input_dim is not None:
            out["projection_class_embeddings_input_dim"] = ce.input_dim
        if ce.concat:
            out["class_embeddings_concat"] = True
    if (add := spec.addition_embedding) is not None:
        out |= {
            "addition_embed_type": add.kind,
            "addition_time_embed_dim": add.time_id_dim,
            "projection_class_embeddings_input_dim": add.input_dim,
        }
    return out


def _added_options(spec: UNetSpec) -> dict[str, Any]:
    """The LCM, Kandinsky 2.2 and ResNet-resampler options that are set, in diffusers' names."""
    out: dict[str, Any] = {}
    if spec.time_embedding.cond_dim is not None:
        out["time_cond_proj_dim"] = spec.time_embedding.cond_dim
    if spec.context_proj_dim is not None:
        out |= {"encoder_hid_dim_type": "text_proj", "encoder_hid_dim": spec.context_proj_dim}
    if (img := spec.image_embedding) is not None:
        out["encoder_hid_dim"] = img.input_dim
        if img.add_to_time:
            out["addition_embed_type"] = "image"
        if img.context_tokens is not None:
            out["encoder_hid_dim_type"] = "image_proj"
            if img.context_tokens != IMAGE_PROJ_TOKENS:
                raise SpecError(
                    f"spec {spec.name!r} has no diffusers equivalent: image_embedding."
                    f"context_tokens={img.context_tokens} (diffusers' ImageProjection makes "
                    f"{IMAGE_PROJ_TOKENS})"
                )
    if spec.resnet_skip_time_act:
        out["resnet_skip_time_act"] = True
    if spec.resnet_out_scale_factor != 1.0:
        out["resnet_out_scale_factor"] = spec.resnet_out_scale_factor
    if spec.context_norm_groups is not None:
        out["cross_attention_norm"] = "group_norm"  # CONTEXT_NORM_GROUPS: other counts fail the round trip
    return out


def _pixel(spec: UNetSpec) -> dict[str, Any]:
    """UNet2DModel: one ``attention_head_dim`` (channels per head) for every attention."""
    levels = spec.attention_levels
    head_dims = {spec.head_dim(lv) for lv in levels}
    one_head = all(spec.heads(lv) == 1 and spec.head_dim(lv) == spec.block_out_channels[lv] for lv in levels)
    return _common(spec, "UNet2DModel") | {
        "mid_block_type": "UNetMidBlock2D",
        "add_attention": spec.mid_attention != "none",
        "attn_norm_num_groups": _mid_groups(spec),
        "attention_head_dim": None if one_head or not head_dims else min(head_dims),
    }


def _mid_groups(spec: UNetSpec) -> int | None:
    """diffusers' attn_norm_num_groups (None: the ResNets' groups, or under scale_shift no GroupNorm)."""
    groups = spec.mid_attention_norm_groups
    if groups == 0:
        return None  # no GroupNorm: diffusers builds that only under scale_shift (the round trip checks)
    groups = spec.norm_num_groups if groups is None else groups
    return None if groups == spec.norm_num_groups and spec.resnet_time_scale_shift == "default" else groups


def _conditional(spec: UNetSpec) -> dict[str, Any]:
    """UNet2DConditionModel: per-level heads for transformers; channels per head for Attn*Block2D."""
    if spec.mid_attention not in MID_TYPES:
        raise SpecError(
            f"mid_attention: {spec.mid_attention!r} beside Transformer2D levels has no diffusers "
            "equivalent (UNet2DConditionModel's middle blocks: UNetMidBlock2DCrossAttn, mid_attention "
            "'transformer'; UNetMidBlock2DSimpleCrossAttn, 'simple_cross')"
        )
    own = {
        "mid_block_type": MID_TYPES[spec.mid_attention],
        "attention_head_dim": _plain(_conditional_heads(spec)),
        "cross_attention_dim": spec.cross_attention_dim,
        "transformer_layers_per_block": _plain(spec.transformer_layers_per_block),
        "use_linear_projection": spec.use_linear_projection,
    }
    return _common(spec, "UNet2DConditionModel") | _added_options(spec) | own


def _conditional_heads(spec: UNetSpec) -> tuple[int, ...]:
    """UNet2DConditionModel's attention_head_dim: transformers' heads by level, Attn*Block2D's head size by index."""
    values: dict[int, int] = {}
    for block, level, index, kind in attention_blocks(
        spec.down_attention, spec.up_attention_resolved, spec.mid_attention
    ):
        heads, head_dim = spec.attention_shape(block, level)
        values.setdefault(level if kind == "transformer" else index, heads if kind == "transformer" else head_dim)
    return tuple(values.get(lv, spec.heads(lv)) for lv in range(spec.num_levels))


def _plain(value: int | tuple[int, ...]) -> int | list[int]:
    """One value when every level has the same, else the per-level list (as config.json holds it)."""
    if isinstance(value, int):
        return value
    return value[0] if len(set(value)) == 1 else list(value)


def _normalised(spec: UNetSpec) -> dict[str, Any]:
    """The fields that decide the network, in one spelling (heads per attention level, resolved defaults)."""
    exclude = {"name", "checkpoint", "attention_head_dim", "num_attention_heads", "block_heads", "up_attention"}
    data = spec.model_dump(exclude=exclude | {"addition_embedding"})
    data["up_attention"] = spec.up_attention_resolved
    data["heads"] = {
        b: spec.attention_shape(b, level)
        for b, level, _, _ in attention_blocks(spec.down_attention, spec.up_attention_resolved, spec.mid_attention)
    }
    if (add := spec.addition_embedding) is not None:  # how example inputs split its width is not the network
        data["addition_embedding"] = add.model_dump(exclude={"num_time_ids"})
    data["transformer_layers_per_block"] = [spec.transformer_depth(lv) for lv in range(spec.num_levels)]
    data["time_embedding"]["dim"] = spec.time_embed_dim
    if spec.norm_kind == "group":
        data.pop("norm_momentum")  # only BatchNorm reads it
    return data


def _check_round_trip(spec: UNetSpec, config: dict[str, Any]) -> None:
    try:
        with warnings.catch_warnings():  # e.g. a class_embed_type UNet2DModel ignores: refused just below
            warnings.simplefilter("ignore")
            back = from_diffusers_config(config)
    except SpecError as err:
        raise SpecError(f"spec {spec.name!r} has no diffusers equivalent: {err}") from None
    want, got = _normalised(spec), _normalised(back)
    for field, value in want.items():
        if got.get(field) != value:
            raise SpecError(
                f"spec {spec.name!r} has no diffusers equivalent: {field}={value!r} (the nearest "
                f"{config['_class_name']} config gives {got.get(field)!r})"
            )
