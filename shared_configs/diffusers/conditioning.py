"""diffusers' conditioning options -> our spec's, for `shared_configs.diffusers.unet_config`: the class, text_time and
image embeddings, LCM's timestep condition, and the context's projection (``encoder_hid_dim(_type)``)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from shared_configs.spec import SpecError

# class_embed_type -> our kind, per class (diffusers builds no class embedding for any other value).
CLASS_KINDS: dict[str, dict[str, str]] = {
    "UNet2DModel": {"timestep": "timestep", "identity": "identity"},
    "UNet2DConditionModel": {k: k for k in ("timestep", "identity", "projection", "simple_projection")},
}
SDXL_TIME_IDS = 6  # (original size, crop offset, target size) x (h, w): example inputs' split of text_time
ADDITION_TYPES = (None, "text_time", "image")  # addition_embed_type values we build
ENCODER_HID_TYPES = (None, "text_proj", "image_proj")  # encoder_hid_dim_type values we build
IMAGE_PROJ_TOKENS = 32  # diffusers' ImageProjection: num_image_text_embeds, not configurable there
WHY_NOT = {
    "text": "DeepFloyd IF's attention-pooled text embedding",
    "text_image": "Kandinsky 2.1's text and image embedding",
    "image_hint": "Kandinsky 2.2 ControlNet's image and hint embedding",
    "text_image_proj": "Kandinsky 2.1's text and image projection",
    "ip_image_proj": "IP-Adapter's image projection",
}


def conditioning_fields(cfg: Mapping[str, Any], cls: str) -> dict[str, Any]:
    """The spec fields of every conditioning option (a UNet2DModel has only class embeddings)."""
    fields: dict[str, Any] = {"class_embedding": class_embedding(cfg, cls)}
    if cls != "UNet2DConditionModel":
        return fields
    addition = _choice(cfg, "addition_embed_type", ADDITION_TYPES)
    hid_type = _choice(cfg, "encoder_hid_dim_type", ENCODER_HID_TYPES)
    hid_dim = cfg["encoder_hid_dim"]
    if hid_type is None and hid_dim is not None:
        hid_type = "text_proj"  # diffusers' default when only the width is given
    if hid_type is not None and hid_dim is None:
        raise SpecError(f"encoder_hid_dim: required by encoder_hid_dim_type={hid_type!r}")
    fields |= {
        "addition_embedding": _text_time(cfg) if addition == "text_time" else None,
        "context_proj_dim": hid_dim if hid_type == "text_proj" else None,
    }
    if addition == "image" or hid_type == "image_proj":
        if hid_dim is None:
            raise SpecError("encoder_hid_dim: required by addition_embed_type='image' (the image_embeds width)")
        tokens = IMAGE_PROJ_TOKENS if hid_type == "image_proj" else None
        fields["image_embedding"] = {"input_dim": hid_dim, "add_to_time": addition == "image", "context_tokens": tokens}
    fields["time_embedding_cond_dim"] = cfg["time_cond_proj_dim"]
    return fields


def _choice(cfg: Mapping[str, Any], key: str, allowed: tuple[str | None, ...]) -> str | None:
    value = cfg[key]
    if value not in allowed:
        why = f" ({WHY_NOT[value]})" if value in WHY_NOT else ""
        raise SpecError(
            f"unsupported diffusers option: {key}={value!r}{why} (supported: {' or '.join(map(repr, allowed))})"
        )
    return value


def class_embedding(cfg: Mapping[str, Any], cls: str) -> dict[str, Any] | None:
    """diffusers' class embedding: ``num_class_embeds`` alone is a table; ``class_embed_type`` wins over it."""
    name, concat = cfg["class_embed_type"], cfg.get("class_embeddings_concat", False)
    if name is None:
        kind = None if cfg["num_class_embeds"] is None else "embedding"
    else:
        kind = CLASS_KINDS[cls].get(name)
        if kind is None:
            warnings.warn(
                f"class_embed_type={name!r}: diffusers' {cls} builds no class embedding for it; neither do we",
                stacklevel=4,
            )
    if kind is None:
        if concat:
            raise SpecError(
                "class_embeddings_concat: True without a class embedding (diffusers sizes the ResNets for "
                "a concatenated embedding that never comes, and fails in the forward)"
            )
        return None
    data: dict[str, Any] = {"kind": kind, "concat": concat}
    if kind == "embedding":
        data["num_classes"] = cfg["num_class_embeds"]
    if kind in ("projection", "simple_projection"):
        data["input_dim"] = _required(cfg, "projection_class_embeddings_input_dim", f"class_embed_type={name!r}")
    return data


def _text_time(cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """SDXL's text_time embedding; how example inputs split its input width (SDXL: 6 time ids) is ours."""
    if cfg.get("addition_embed_type") is None:  # UNet2DModel has none
        return None
    why = "addition_embed_type='text_time'"
    time_dim = _required(cfg, "addition_time_embed_dim", why)
    width = _required(cfg, "projection_class_embeddings_input_dim", why)
    count = min(SDXL_TIME_IDS, (width - 1) // time_dim)
    if count < 1:
        raise SpecError(
            f"projection_class_embeddings_input_dim: {width} leaves no text_embeds width beside one time "
            f"id of addition_time_embed_dim={time_dim}"
        )
    return {"kind": "text_time", "time_id_dim": time_dim, "input_dim": width, "num_time_ids": count}


def _required(cfg: Mapping[str, Any], key: str, why: str) -> Any:
    if cfg[key] is None:
        raise SpecError(f"{key}: required by {why}")
    return cfg[key]
