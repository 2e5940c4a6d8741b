"""A diffusers U-Net's ``config.json`` -> the `UNetSpec` of the network diffusers builds from it (no torch, jax or
diffusers): every option is mapped, fixed (`FIXED`), inert or refused by name, never silently ignored. The table
of options: docs/diffusers.md "What loads".
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from shared_configs.diffusers.conditioning import conditioning_fields
from shared_configs.loader import spec_from_dict
from shared_configs.spec import SpecError, UNetSpec

# diffusers 0.42's __init__ defaults, per class: a config.json may omit any of them.
_COMMON_DEFAULTS: dict[str, Any] = {
    "sample_size": None,
    "center_input_sample": False,
    "time_embedding_type": "positional",
    "time_embedding_dim": None,
    "freq_shift": 0,
    "flip_sin_to_cos": True,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "downsample_padding": 1,
    "dropout": 0.0,
    "act_fn": "silu",
    "attention_head_dim": 8,
    "norm_num_groups": 32,
    "norm_eps": 1e-5,
    "resnet_time_scale_shift": "default",
    "class_embed_type": None,
    "num_class_embeds": None,
}
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "UNet2DModel": _COMMON_DEFAULTS
    | {
        "in_channels": 3,
        "out_channels": 3,
        "mid_block_type": "UNetMidBlock2D",
        "down_block_types": ("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"),
        "up_block_types": ("AttnUpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        "block_out_channels": (224, 448, 672, 896),
        "downsample_type": "conv",
        "upsample_type": "conv",
        "attn_norm_num_groups": None,
        "add_attention": True,
        "num_train_timesteps": None,
    },
    "UNet2DConditionModel": _COMMON_DEFAULTS
    | {
        "in_channels": 4,
        "out_channels": 4,
        "mid_block_type": "UNetMidBlock2DCrossAttn",
        "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        "only_cross_attention": False,
        "block_out_channels": (320, 640, 1280, 1280),
        "cross_attention_dim": 1280,
        "transformer_layers_per_block": 1,
        "reverse_transformer_layers_per_block": None,
        "encoder_hid_dim": None,
        "encoder_hid_dim_type": None,
        "num_attention_heads": None,
        "dual_cross_attention": False,
        "use_linear_projection": False,
        "addition_embed_type": None,
        "addition_time_embed_dim": None,
        "upcast_attention": False,
        "resnet_skip_time_act": False,
        "resnet_out_scale_factor": 1.0,
        "time_embedding_act_fn": None,
        "timestep_post_act": None,
        "time_cond_proj_dim": None,
        "conv_in_kernel": 3,
        "conv_out_kernel": 3,
        "projection_class_embeddings_input_dim": None,
        "attention_type": "default",
        "class_embeddings_concat": False,
        "mid_block_only_cross_attention": None,
        "cross_attention_norm": None,
        "addition_embed_type_num_heads": 64,
    },
}

# Options the spec cannot express: the accepted values (a per-level list may repeat one of them).
FIXED: dict[str, tuple[Any, ...]] = {
    "center_input_sample": (False,),
    "time_embedding_type": ("positional",),
    "act_fn": ("silu",),
    "downsample_type": ("conv",),
    "upsample_type": ("conv",),
    "only_cross_attention": (False,),
    "reverse_transformer_layers_per_block": (None,),
    "num_attention_heads": (None,),
    "dual_cross_attention": (False,),
    "time_embedding_act_fn": (None,),
    "timestep_post_act": (None,),
    "conv_in_kernel": (3,),
    "conv_out_kernel": (3,),
    "attention_type": ("default",),
}

# Options that are spec fields of the same name and value.
SAME_FIELDS = (
    "in_channels",
    "out_channels",
    "norm_num_groups",
    "norm_eps",
    "dropout",
    "resnet_time_scale_shift",
    "downsample_padding",
    "mid_block_scale_factor",
)
CONTEXT_NORM_GROUPS = 32  # diffusers' cross_attention_norm: group_norm (cross_attention_norm_num_groups, fixed)
DOWN_BLOCKS: dict[str, str] = {"DownBlock2D": "none", "AttnDownBlock2D": "self", "CrossAttnDownBlock2D": "transformer"}
UP_BLOCKS: dict[str, str] = {"UpBlock2D": "none", "AttnUpBlock2D": "self", "CrossAttnUpBlock2D": "transformer"}
# The blocks whose resamplers are ResNets (Kandinsky 2.2, DeepFloyd IF, UnCLIP): spec `resampler: resnet`.
RESNET_DOWN_BLOCKS: dict[str, str] = {"ResnetDownsampleBlock2D": "none", "SimpleCrossAttnDownBlock2D": "simple_cross"}
RESNET_UP_BLOCKS: dict[str, str] = {"ResnetUpsampleBlock2D": "none", "SimpleCrossAttnUpBlock2D": "simple_cross"}
MID_BLOCKS: dict[str, dict[str, str]] = {
    "UNet2DModel": {"UNetMidBlock2D": "self"},  # "none" with add_attention=False
    "UNet2DConditionModel": {"UNetMidBlock2DCrossAttn": "transformer", "UNetMidBlock2DSimpleCrossAttn": "simple_cross"},
}


def from_diffusers_config(config: Mapping[str, Any], *, name: str | None = None) -> UNetSpec:
    """A ``config.json`` dict (with ``_class_name``) -> `UNetSpec`; a `SpecError` names the options we cannot honour."""
    cls = config.get("_class_name")
    if cls not in CLASS_DEFAULTS:
        raise SpecError(f"_class_name: unsupported diffusers model {cls!r} (supported: {', '.join(CLASS_DEFAULTS)})")
    cfg = _with_defaults(config, cls)
    _refuse_unsupported(cfg)
    data = {"name": name or Path(str(config.get("_name_or_path") or f"diffusers_{cls}")).name, **_fields(cfg, cls)}
    try:
        return spec_from_dict(data)
    except SpecError as err:
        raise SpecError(f"diffusers {cls} config: {err}") from None


def _fields(cfg: Mapping[str, Any], cls: str) -> dict[str, Any]:
    """The spec fields, as a plain dict for `spec_from_dict` to validate."""
    n = len(cfg["block_out_channels"])
    resampler = _resampler(cfg, cls)
    resnet = resampler == "resnet"
    down = _kinds(cfg, "down_block_types", RESNET_DOWN_BLOCKS if resnet else DOWN_BLOCKS, n)
    up = _kinds(cfg, "up_block_types", RESNET_UP_BLOCKS if resnet else UP_BLOCKS, n)
    mid, mid_groups = _mid(cfg, cls)
    if cls == "UNet2DModel" and "transformer" in (*down, *up):
        raise SpecError("down_block_types/up_block_types: CrossAttn*Block2D needs a UNet2DConditionModel")
    conditioning = conditioning_fields(cfg, cls)
    cond_dim = conditioning.pop("time_embedding_cond_dim", None)
    data: dict[str, Any] = {
        **{k: cfg[k] for k in SAME_FIELDS},
        "sample_size": _sample_size(cfg["sample_size"], n),
        "block_out_channels": list(cfg["block_out_channels"]),
        "layers_per_block": _per_level(cfg, "layers_per_block", n, uniform=True),
        "down_attention": down,
        "up_attention": None if up == down[::-1] else up,
        "mid_attention": mid,
        **_heads(cfg, cls, down, up, mid),
        "mid_attention_norm_groups": mid_groups,
        "time_embedding": {
            "flip_sin_to_cos": cfg["flip_sin_to_cos"],
            "freq_shift": cfg["freq_shift"],
            "dim": cfg["time_embedding_dim"],
            "cond_dim": cond_dim,
        },
        **conditioning,
        **_family(cfg, resampler, mid, [*down, *up]),
    }
    if cls == "UNet2DConditionModel":
        data |= {
            "cross_attention_dim": _per_level(cfg, "cross_attention_dim", n, uniform=True),
            "transformer_layers_per_block": _per_level(cfg, "transformer_layers_per_block", n),
            "use_linear_projection": cfg["use_linear_projection"],
        }
    return data


def _with_defaults(config: Mapping[str, Any], cls: str) -> dict[str, Any]:
    defaults = CLASS_DEFAULTS[cls]
    given = {k: v for k, v in config.items() if not k.startswith("_")}
    if unknown := sorted(set(given) - set(defaults)):
        raise SpecError(
            f"{unknown[0]}: unknown {cls} option (not in diffusers 0.42's signature); refusing to ignore it"
        )
    return defaults | given


def _refuse_unsupported(cfg: Mapping[str, Any]) -> None:
    """Refuse, naming them, the options the spec cannot express; warn about upcast_attention."""
    bad = []
    for key, allowed in FIXED.items():
        value = cfg.get(key, allowed[0])
        if not all(v in allowed for v in (value if isinstance(value, list | tuple) else (value,))):
            bad.append(f"{key}={value!r} (supported: {' or '.join(repr(a) for a in allowed)})")
    if bad:
        raise SpecError(f"unsupported diffusers option{'s' if len(bad) > 1 else ''}: {'; '.join(bad)}")
    if cfg["norm_num_groups"] is None:
        raise SpecError("norm_num_groups: None (diffusers then drops or resizes norms) is not supported")
    if cfg.get("upcast_attention"):
        warnings.warn(
            "upcast_attention=True accepted: it only changes reduced-precision attention (a no-op in "
            "float32); our models compute attention in the dtype they are run in",
            stacklevel=3,
        )


def _resampler(cfg: Mapping[str, Any], cls: str) -> str:
    """``resnet`` when every down and up block is a ResnetDownsample / SimpleCrossAttn block, else ``conv``."""
    types = [*cfg["down_block_types"], *cfg["up_block_types"]]
    family = [t in RESNET_DOWN_BLOCKS or t in RESNET_UP_BLOCKS for t in types]
    if not any(family):
        return "conv"
    if cls != "UNet2DConditionModel" or not all(family):
        raise SpecError(
            "down_block_types/up_block_types: ResnetDownsample/ResnetUpsample/SimpleCrossAttn blocks are "
            f"supported in a UNet2DConditionModel whose blocks are all of them, got {types}"
        )
    return "resnet"


def _family(cfg: Mapping[str, Any], resampler: str, mid: str, kinds: list[str]) -> dict[str, Any]:
    """The options only ResnetDownsample / SimpleCrossAttn blocks read, where they are built (else inert)."""
    out: dict[str, Any] = {"resampler": resampler}
    if resampler == "resnet":
        out["resnet_out_scale_factor"] = float(cfg["resnet_out_scale_factor"])
    if resampler == "resnet" or mid == "simple_cross":
        out["resnet_skip_time_act"] = cfg["resnet_skip_time_act"]
    simple = "simple_cross" in (*kinds, mid)  # only a UNet2DConditionModel builds them
    if simple and cfg["cross_attention_norm"] not in (None, "group_norm"):
        raise SpecError(
            f"cross_attention_norm: {cfg['cross_attention_norm']!r} unsupported for SimpleCrossAttn "
            "blocks (supported: None, 'group_norm')"
        )
    if simple and cfg["cross_attention_norm"] == "group_norm":
        out["context_norm_groups"] = CONTEXT_NORM_GROUPS
    if mid == "simple_cross" and cfg["mid_block_only_cross_attention"]:
        raise SpecError("mid_block_only_cross_attention: True unsupported (supported: None, False)")
    return out


def _kinds(cfg: Mapping[str, Any], key: str, table: dict[str, str], n: int) -> list[str]:
    types = list(cfg[key])
    if len(types) != n:
        raise SpecError(f"{key}: {len(types)} entries for {n} block_out_channels")
    if bad := [t for t in types if t not in table]:
        raise SpecError(f"{key}: unsupported block type {bad[0]!r} (supported: {', '.join(table)})")
    return [table[t] for t in types]


def _mid(cfg: Mapping[str, Any], cls: str) -> tuple[str, int | None]:
    """The middle block's attention kind, and its GroupNorm groups when they differ from the ResNets'."""
    mid_type, table = cfg["mid_block_type"], MID_BLOCKS[cls]
    if mid_type not in table:
        raise SpecError(f"mid_block_type: unsupported {mid_type!r} for {cls} (supported: {', '.join(table)})")
    if cls == "UNet2DConditionModel":
        return table[mid_type], None
    if not cfg["add_attention"]:
        return "none", None
    # diffusers' UNetMidBlock2D: attn_norm_num_groups, else the ResNets' groups under the default
    # time embedding, else (scale_shift) no GroupNorm at all (0 here).
    groups = cfg["attn_norm_num_groups"]
    if groups is None:
        groups = cfg["norm_num_groups"] if cfg["resnet_time_scale_shift"] == "default" else 0
    return "self", None if groups == cfg["norm_num_groups"] else groups


def _per_level(cfg: Mapping[str, Any], key: str, n: int, uniform: bool = False) -> Any:
    """An int, or one int per level (diffusers' up path reads the same list reversed), one when all are equal;
    ``uniform``: they must be (our spec has one value)."""
    value = cfg[key]
    if not isinstance(value, list | tuple):
        return value
    if uniform and (len(value) != n or len(set(value)) != 1):
        raise SpecError(f"{key}: per-level values {list(value)} are not supported, only one value for all levels")
    if len(value) != n or not all(isinstance(v, int) for v in value):
        raise SpecError(f"{key}: {list(value)} needs {n} integers, one per level")
    return value[0] if len(set(value)) == 1 else tuple(value)


def _heads(cfg: Mapping[str, Any], cls: str, down: list[str], up: list[str], mid: str) -> dict[str, Any]:
    """The spec's head fields: per level, the first attention's there; `block_heads` for blocks diffusers gives
    other heads at the same level; ``attention_head_dim`` too where heads x head size do not fill the channels."""
    chans, n = cfg["block_out_channels"], len(cfg["block_out_channels"])
    shapes = {
        b: (lv, _head_shape(cfg, cls, kind, chans[lv], lv, i)) for b, lv, i, kind in attention_blocks(down, up, mid)
    }
    if not shapes:
        return {}
    per_level = dict(reversed(shapes.values()))  # level -> the shape of its first attention
    full = [per_level.get(lv) or _unused_level(cfg, cls, chans[lv], lv) for lv in range(n)]
    if all(h * d == ch for (h, d), ch in zip(full, chans, strict=True)):
        counts = [h for h, _ in full]
        fields: dict[str, Any] = {"num_attention_heads": counts[0] if len(set(counts)) == 1 else counts}
    else:
        fields = {"num_attention_heads": [h for h, _ in full], "attention_head_dim": [d for _, d in full]}
    overrides = [(b, *shape) for b, (lv, shape) in shapes.items() if shape != per_level[lv]]
    return fields | ({"block_heads": overrides} if overrides else {})


def attention_blocks(down: Sequence[str], up: Sequence[str], mid: str) -> list[tuple[str, int, int, str]]:
    """(block, level, index in its path, attention kind) of every block with attention, in forward order, from
    the down, up (deepest first) and middle blocks' attention kinds."""
    n = len(down)
    blocks = [(f"down.{i}", i, i, k) for i, k in enumerate(down)] + [("mid", n - 1, n - 1, mid)]
    blocks += [(f"up.{i}", n - 1 - i, i, k) for i, k in enumerate(up)]
    return [b for b in blocks if b[3] != "none"]


def _unused_level(cfg: Mapping[str, Any], cls: str, ch: int, level: int) -> tuple[int, int]:
    """A level without attention: the config's own value where it fits (SDXL's 5 heads at level 0), else 1 head."""
    kind = "transformer" if cls == "UNet2DConditionModel" else "self"
    try:
        heads, head_dim = _head_shape(cfg, cls, kind, ch, level, level)
    except SpecError:
        return 1, ch
    return (heads, head_dim) if heads * head_dim == ch else (1, ch)


def _head_shape(cfg: Mapping[str, Any], cls: str, kind: str, ch: int, level: int, index: int) -> tuple[int, int]:
    """(heads, head size) as diffusers builds them: attention_head_dim is heads for UNet2DConditionModel's
    transformers, else channels per head (its Attn*Block2D read the un-reversed list in the up path)."""
    value = cfg["attention_head_dim"]
    per_level = list(value) if isinstance(value, list | tuple) else [value] * len(cfg["block_out_channels"])
    if cls == "UNet2DConditionModel" and kind == "transformer":  # (SimpleCrossAttn blocks read head sizes)
        heads = per_level[level]
        if heads is None or ch // heads == 0:
            raise SpecError(f"attention_head_dim: {ch} channels do not make {heads} heads")
        return heads, ch // heads
    head_dim = per_level[index if cls == "UNet2DConditionModel" else 0] or ch
    if ch // head_dim == 0:
        raise SpecError(f"attention_head_dim: {head_dim} exceeds the {ch} channels (diffusers would build 0 heads)")
    return ch // head_dim, head_dim


def _sample_size(value: int | list[int] | None, n: int) -> int:
    """The default input side (a tool's, not the model's); None -> the smallest multiple of 2**(n-1) that is >= 32."""
    if isinstance(value, list | tuple):
        if len(set(value)) != 1:
            raise SpecError(f"sample_size: non-square {list(value)} is not supported")
        value = value[0]
    factor = 2 ** (n - 1)
    return value if value is not None else factor * -(-32 // factor)
