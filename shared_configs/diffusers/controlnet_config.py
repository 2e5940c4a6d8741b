"""A diffusers ``ControlNetModel`` config <-> `ControlNetSpec` (framework-free): read as the config of the U-Net
whose encoder it is (through `from_diffusers_config`), written as that U-Net's cut back to ``ControlNetModel``'s
signature, refusing by name what diffusers' ControlNet cannot express.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from shared_configs.controlnet import ControlNetSpec
from shared_configs.diffusers.export import DIFFUSERS_VERSION, to_diffusers_config
from shared_configs.diffusers.unet_config import CLASS_DEFAULTS, from_diffusers_config
from shared_configs.spec import SpecError, UNetSpec

CLASS = "ControlNetModel"
# ControlNetModel's own options (diffusers 0.42's signature) -> our spec fields.
OWN: dict[str, str] = {
    **{k: k for k in ("conditioning_channels", "conditioning_embedding_out_channels", "global_pool_conditions")},
    "controlnet_conditioning_channel_order": "conditioning_channel_order",
}
# The U-Net options ControlNetModel takes too (the rest of its signature).
SHARED: tuple[str, ...] = (
    "in_channels",
    "flip_sin_to_cos",
    "freq_shift",
    "down_block_types",
    "mid_block_type",
    "only_cross_attention",
    "block_out_channels",
    "layers_per_block",
    "downsample_padding",
    "mid_block_scale_factor",
    "act_fn",
    "norm_num_groups",
    "norm_eps",
    "cross_attention_dim",
    "transformer_layers_per_block",
    "encoder_hid_dim",
    "encoder_hid_dim_type",
    "attention_head_dim",
    "num_attention_heads",
    "use_linear_projection",
    "class_embed_type",
    "addition_embed_type",
    "addition_time_embed_dim",
    "num_class_embeds",
    "upcast_attention",
    "resnet_time_scale_shift",
    "projection_class_embeddings_input_dim",
    "addition_embed_type_num_heads",
)
UP_OF: dict[str, str] = {
    "DownBlock2D": "UpBlock2D",
    "AttnDownBlock2D": "AttnUpBlock2D",
    "CrossAttnDownBlock2D": "CrossAttnUpBlock2D",
}
# diffusers' ControlNetModel builds a class embedding only for these class_embed_type values.
CLASS_EMBED_TYPES = (None, "timestep", "identity", "projection")


def spec_from_config(config: Mapping[str, Any], *, name: str | None = None) -> UNetSpec | ControlNetSpec:
    """The spec of a diffusers U-Net or ControlNet config, by its ``_class_name``."""
    if config.get("_class_name") == CLASS:
        return controlnet_from_diffusers_config(config, name=name)
    if (cls := config.get("_class_name")) not in CLASS_DEFAULTS:
        raise SpecError(
            f"_class_name: unsupported diffusers model {cls!r} (supported: {', '.join([*CLASS_DEFAULTS, CLASS])})"
        )
    return from_diffusers_config(config, name=name)


def controlnet_from_diffusers_config(config: Mapping[str, Any], *, name: str | None = None) -> ControlNetSpec:
    """A diffusers ``ControlNetModel`` config -> `ControlNetSpec`; `SpecError` naming an option we cannot honour."""
    options = {k: v for k, v in config.items() if not k.startswith("_")}
    if unknown := sorted(k for k in options if k not in OWN and k not in SHARED):
        raise SpecError(f"{unknown[0]}: unknown {CLASS} option (not in diffusers 0.42's signature); refusing it")
    if options.get("encoder_hid_dim") is not None or options.get("encoder_hid_dim_type") is not None:
        raise SpecError(f"encoder_hid_dim(_type): a context projection is not supported for {CLASS}")
    if options.get("class_embed_type") not in CLASS_EMBED_TYPES:
        raise SpecError(
            f"class_embed_type: {options['class_embed_type']!r} unsupported for {CLASS} (diffusers builds "
            f"no class embedding for it; supported: {', '.join(map(str, CLASS_EMBED_TYPES))})"
        )
    defaults = CLASS_DEFAULTS["UNet2DConditionModel"]
    unet = {k: v for k, v in options.items() if k in SHARED}
    downs = unet.get("down_block_types", defaults["down_block_types"])
    unet |= {
        "_class_name": "UNet2DConditionModel",
        "_name_or_path": config.get("_name_or_path") or f"diffusers_{CLASS}",
        "out_channels": unet.get("in_channels", 4),
        "up_block_types": [UP_OF.get(t, t) for t in reversed(downs)],
    }
    try:
        unet_spec = from_diffusers_config(unet, name=name)
        own = {field: options[key] for key, field in OWN.items() if key in options}
        if own.get("conditioning_embedding_out_channels") is None:
            own.pop("conditioning_embedding_out_channels", None)
        return ControlNetSpec(name=unet_spec.name, unet=unet_spec, **own)
    except (SpecError, ValueError) as err:
        detail = str(err).removeprefix("diffusers UNet2DConditionModel config: ")
        raise SpecError(f"diffusers {CLASS} config: {detail}") from None


def controlnet_to_diffusers_config(spec: ControlNetSpec) -> dict[str, Any]:
    """The ``config.json`` (with ``_class_name``) of the diffusers ``ControlNetModel`` equal to ``spec``."""
    unet, ce = spec.unet, spec.unet.class_embedding
    refused = {
        "dropout": (unet.dropout != 0.0, f"{unet.dropout} (ControlNetModel has no dropout)"),
        "time_embedding.dim": (
            unet.time_embed_dim != 4 * unet.block_out_channels[0],
            f"{unet.time_embed_dim} (ControlNetModel's is 4 x block_out_channels[0])",
        ),
        "class_embedding": (
            ce is not None and (ce.kind == "simple_projection" or ce.concat),
            f"{ce} (ControlNetModel builds no simple_projection, and never concatenates)",
        ),
    }
    if bad := [f"{field}={why}" for field, (refuse, why) in refused.items() if refuse]:
        raise SpecError(f"controlnet {spec.name!r} has no diffusers equivalent: {bad[0]}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = to_diffusers_config(_with_mirrored_up(unet))
    return (
        {"_class_name": CLASS, "_diffusers_version": DIFFUSERS_VERSION}
        | {k: full[k] for k in SHARED if k in full}
        | {key: _plain(getattr(spec, field)) for key, field in OWN.items()}
    )


def _with_mirrored_up(unet: UNetSpec) -> UNetSpec:
    """The U-Net with the up path diffusers' ControlNet config implies (it has none of its own)."""
    heads = tuple(b for b in unet.block_heads if not b[0].startswith("up."))
    return unet.model_copy(update={"up_attention": None, "block_heads": heads, "out_channels": unet.in_channels})


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value
