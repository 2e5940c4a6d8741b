"""diffusers U-Nets -> our spec and state_dict names (framework-free: no torch, jax or diffusers).

`from_diffusers_config` turns the ``config.json`` of a diffusers ``UNet2DModel`` or
``UNet2DConditionModel`` into a `UNetSpec`. Every diffusers option is one of:

* mapped onto a spec field (block types, widths, heads, norms, time embedding, ...);
* fixed: our spec cannot express it, so only the listed values (diffusers' default first) are
  accepted and any other is refused with a `SpecError` naming the option;
* inert: it only configures block types we refuse, so no accepted model depends on it;
* ``upcast_attention``: a precision hint, accepted with a warning (a no-op in float32).

Keys we do not know are refused too: an option is never silently ignored.

The state_dict names differ from ours by a few renames (`KEY_RENAMES`), applied segment-wise in
either direction; `LEGACY_KEY_RENAMES` also reads the pre-0.14 DDPM attention names
(``query/key/value/proj_attn``) that some hub folders still store.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from shared_configs.loader import spec_from_dict
from shared_configs.spec import SpecError, UNetSpec

V = TypeVar("V")

# diffusers 0.42's __init__ defaults, per class: a config.json may omit any of them.
_COMMON_DEFAULTS: dict[str, Any] = {
    "sample_size": None, "center_input_sample": False, "time_embedding_type": "positional",
    "time_embedding_dim": None, "freq_shift": 0, "flip_sin_to_cos": True, "layers_per_block": 2,
    "mid_block_scale_factor": 1, "downsample_padding": 1, "dropout": 0.0, "act_fn": "silu",
    "attention_head_dim": 8, "norm_num_groups": 32, "norm_eps": 1e-5, "resnet_time_scale_shift": "default",
    "class_embed_type": None, "num_class_embeds": None,
}  # fmt: skip
CLASS_DEFAULTS: dict[str, dict[str, Any]] = {
    "UNet2DModel": _COMMON_DEFAULTS | {
        "in_channels": 3, "out_channels": 3, "mid_block_type": "UNetMidBlock2D",
        "down_block_types": ("DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D"),
        "up_block_types": ("AttnUpBlock2D", "AttnUpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
        "block_out_channels": (224, 448, 672, 896), "downsample_type": "conv", "upsample_type": "conv",
        "attn_norm_num_groups": None, "add_attention": True, "num_train_timesteps": None,
    },
    "UNet2DConditionModel": _COMMON_DEFAULTS | {
        "in_channels": 4, "out_channels": 4, "mid_block_type": "UNetMidBlock2DCrossAttn",
        "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        "only_cross_attention": False, "block_out_channels": (320, 640, 1280, 1280), "cross_attention_dim": 1280,
        "transformer_layers_per_block": 1, "reverse_transformer_layers_per_block": None, "encoder_hid_dim": None,
        "encoder_hid_dim_type": None, "num_attention_heads": None, "dual_cross_attention": False,
        "use_linear_projection": False, "addition_embed_type": None, "addition_time_embed_dim": None,
        "upcast_attention": False, "resnet_skip_time_act": False, "resnet_out_scale_factor": 1.0,
        "time_embedding_act_fn": None, "timestep_post_act": None, "time_cond_proj_dim": None,
        "conv_in_kernel": 3, "conv_out_kernel": 3, "projection_class_embeddings_input_dim": None,
        "attention_type": "default", "class_embeddings_concat": False, "mid_block_only_cross_attention": None,
        "cross_attention_norm": None, "addition_embed_type_num_heads": 64,
    },
}  # fmt: skip

# Options the spec cannot express: the accepted values (a per-level list may repeat one of them).
FIXED: dict[str, tuple[Any, ...]] = {
    "center_input_sample": (False,), "time_embedding_type": ("positional",), "act_fn": ("silu",),
    "class_embed_type": (None,), "num_class_embeds": (None,), "downsample_type": ("conv",),
    "upsample_type": ("conv",), "only_cross_attention": (False,), "reverse_transformer_layers_per_block": (None,),
    "encoder_hid_dim": (None,), "encoder_hid_dim_type": (None,), "num_attention_heads": (None,),
    "dual_cross_attention": (False,), "addition_embed_type": (None,), "addition_time_embed_dim": (None,),
    "time_embedding_act_fn": (None,), "timestep_post_act": (None,), "time_cond_proj_dim": (None,),
    "conv_in_kernel": (3,), "conv_out_kernel": (3,), "projection_class_embeddings_input_dim": (None,),
    "attention_type": ("default",), "class_embeddings_concat": (False,)
}  # fmt: skip

# Options only the blocks we refuse read (ResnetDownsample/SimpleCrossAttn blocks, the learned
# time embedding, the text-conditioning head, UNetMidBlock2DSimpleCrossAttn): any value is fine.
INERT: frozenset[str] = frozenset({
    "resnet_skip_time_act", "resnet_out_scale_factor", "cross_attention_norm", "mid_block_only_cross_attention",
    "addition_embed_type_num_heads", "num_train_timesteps",
})  # fmt: skip

DOWN_BLOCKS: dict[str, str] = {"DownBlock2D": "none", "AttnDownBlock2D": "self", "CrossAttnDownBlock2D": "transformer"}
UP_BLOCKS: dict[str, str] = {"UpBlock2D": "none", "AttnUpBlock2D": "self", "CrossAttnUpBlock2D": "transformer"}
MID_BLOCKS: dict[str, dict[str, str]] = {
    "UNet2DModel": {"UNetMidBlock2D": "self"},  # "none" with add_attention=False
    "UNet2DConditionModel": {"UNetMidBlock2DCrossAttn": "transformer"},
}

# diffusers name <-> our name, as whole dotted segments (`_rename` compiles them to regexes).
KEY_RENAMES: tuple[tuple[str, str], ...] = (
    ("down_blocks", "down"),
    ("mid_block", "mid"),
    ("up_blocks", "up"),
    ("downsamplers.0", "downsample"),
    ("upsamplers.0", "upsample"),
    ("to_out.0", "to_out"),
    ("ff.net.0.proj", "ff.proj"),
    ("ff.net.2", "ff.out"),
)
LEGACY_KEY_RENAMES: tuple[tuple[str, str], ...] = (
    ("query", "to_q"),
    ("key", "to_k"),
    ("value", "to_v"),
    ("proj_attn", "to_out"),
)


def _compile(pairs: tuple[tuple[str, str], ...]) -> list[tuple[re.Pattern[str], str]]:
    return [(re.compile(rf"(?<![^.]){re.escape(a)}(?=\.)"), b) for a, b in pairs]


_TO_OURS = _compile(KEY_RENAMES + LEGACY_KEY_RENAMES)
_TO_DIFFUSERS = _compile(tuple((b, a) for a, b in KEY_RENAMES))


def _rename(key: str, table: list[tuple[re.Pattern[str], str]]) -> str:
    for pattern, replacement in table:
        key = pattern.sub(replacement, key)
    return key


def diffusers_to_ours(state_dict: Mapping[str, V]) -> dict[str, V]:
    """A diffusers U-Net state_dict (current or legacy names) -> our state_dict names."""
    return {_rename(k, _TO_OURS): v for k, v in state_dict.items()}


def ours_to_diffusers(state_dict: Mapping[str, V]) -> dict[str, V]:
    """Our state_dict names -> the current diffusers names."""
    return {_rename(k, _TO_DIFFUSERS): v for k, v in state_dict.items()}


def from_diffusers_config(config: Mapping[str, Any], *, name: str | None = None) -> UNetSpec:
    """A diffusers ``UNet2DModel`` / ``UNet2DConditionModel`` config -> `UNetSpec`.

    ``config`` is a ``config.json`` as a dict (it must carry ``_class_name``), or a live model's
    ``dict(model.config)`` with ``_class_name`` added. Raises `SpecError` naming the first option
    we cannot honour (all of them, for fixed options).
    """
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
    down, up = _kinds(cfg, "down_block_types", DOWN_BLOCKS, n), _kinds(cfg, "up_block_types", UP_BLOCKS, n)
    mid = _mid_kind(cfg, cls)
    if cls == "UNet2DModel" and "transformer" in (*down, *up):
        raise SpecError("down_block_types/up_block_types: CrossAttn*Block2D needs a UNet2DConditionModel")
    data: dict[str, Any] = {
        "in_channels": cfg["in_channels"],
        "out_channels": cfg["out_channels"],
        "sample_size": _sample_size(cfg["sample_size"], n),
        "block_out_channels": list(cfg["block_out_channels"]),
        "layers_per_block": _uniform(cfg, "layers_per_block", n),
        "down_attention": down,
        "up_attention": None if up == down[::-1] else up,
        "mid_attention": mid,
        "num_attention_heads": _heads(cfg, cls, down, up, mid),
        "norm_num_groups": cfg["norm_num_groups"],
        "norm_eps": cfg["norm_eps"],
        "dropout": cfg["dropout"],
        "resnet_time_scale_shift": cfg["resnet_time_scale_shift"],
        "downsample_padding": cfg["downsample_padding"],
        "mid_block_scale_factor": cfg["mid_block_scale_factor"],
        "time_embedding": {
            "flip_sin_to_cos": cfg["flip_sin_to_cos"],
            "freq_shift": cfg["freq_shift"],
            "dim": cfg["time_embedding_dim"],
        },
    }
    if cls == "UNet2DConditionModel":
        data["cross_attention_dim"] = _uniform(cfg, "cross_attention_dim", n)
        data["transformer_layers_per_block"] = _per_level_ints(cfg, "transformer_layers_per_block", n)
        data["use_linear_projection"] = cfg["use_linear_projection"]
    return data


def _with_defaults(config: Mapping[str, Any], cls: str) -> dict[str, Any]:
    defaults = CLASS_DEFAULTS[cls]
    unknown = sorted(k for k in config if not k.startswith("_") and k not in defaults)
    if unknown:
        raise SpecError(
            f"{unknown[0]}: unknown {cls} option (not in diffusers 0.42's signature); refusing to ignore it"
        )
    return {**defaults, **{k: v for k, v in config.items() if not k.startswith("_")}}


def _refuse_unsupported(cfg: Mapping[str, Any]) -> None:
    """Refuse, naming them, the options the spec cannot express; warn about upcast_attention."""
    bad = []
    for key, allowed in FIXED.items():
        value = cfg.get(key, allowed[0])
        values = value if isinstance(value, list | tuple) else (value,)
        if not all(v in allowed for v in values):
            bad.append(f"{key}={value!r} (supported: {' or '.join(repr(a) for a in allowed)})")
    if bad:
        raise SpecError(f"unsupported diffusers option{'s' if len(bad) > 1 else ''}: {'; '.join(bad)}")
    if cfg["resnet_time_scale_shift"] not in ("default", "scale_shift"):
        raise SpecError(
            f"resnet_time_scale_shift: {cfg['resnet_time_scale_shift']!r} unsupported (supported: default, scale_shift)"
        )
    if cfg["norm_num_groups"] is None:
        raise SpecError("norm_num_groups: None (diffusers then drops or resizes norms) is not supported")
    if cfg.get("upcast_attention"):
        warnings.warn(
            "upcast_attention=True accepted: it only changes reduced-precision attention (a no-op in "
            "float32); our models compute attention in the dtype they are run in",
            stacklevel=3,
        )


def _kinds(cfg: Mapping[str, Any], key: str, table: dict[str, str], n: int) -> list[str]:
    types = list(cfg[key])
    if len(types) != n:
        raise SpecError(f"{key}: {len(types)} entries for {n} block_out_channels")
    for t in types:
        if t not in table:
            raise SpecError(f"{key}: unsupported block type {t!r} (supported: {', '.join(table)})")
    return [table[t] for t in types]


def _mid_kind(cfg: Mapping[str, Any], cls: str) -> str:
    mid_type, table = cfg["mid_block_type"], MID_BLOCKS[cls]
    if mid_type not in table:
        raise SpecError(f"mid_block_type: unsupported {mid_type!r} for {cls} (supported: {', '.join(table)})")
    if cls == "UNet2DConditionModel":
        return table[mid_type]
    if not cfg["add_attention"]:
        return "none"
    # diffusers' UNetMidBlock2D gives its attention no GroupNorm when attn groups end up None.
    attn_groups = cfg["attn_norm_num_groups"]
    if attn_groups is None and cfg["resnet_time_scale_shift"] == "default":
        attn_groups = cfg["norm_num_groups"]
    if attn_groups != cfg["norm_num_groups"]:
        raise SpecError(
            f"attn_norm_num_groups: the middle attention would have {attn_groups} GroupNorm groups "
            f"(resnet_time_scale_shift={cfg['resnet_time_scale_shift']!r}); ours uses norm_num_groups="
            f"{cfg['norm_num_groups']}, so attn_norm_num_groups must equal it"
        )
    return "self"


def _uniform(cfg: Mapping[str, Any], key: str, n: int) -> int:
    """An int, or a per-level list whose entries are all equal (our spec has one value)."""
    value = cfg[key]
    if not isinstance(value, list | tuple):
        return value
    if len(value) != n or len(set(value)) != 1:
        raise SpecError(f"{key}: per-level values {list(value)} are not supported, only one value for all levels")
    return value[0]


def _per_level_ints(cfg: Mapping[str, Any], key: str, n: int) -> int | tuple[int, ...]:
    """An int, or one int per level (diffusers' up path reads the same list reversed)."""
    value = cfg[key]
    if not isinstance(value, list | tuple):
        return value
    if len(value) != n or not all(isinstance(v, int) for v in value):
        raise SpecError(f"{key}: {list(value)} needs {n} integers, one per level")
    return value[0] if len(set(value)) == 1 else tuple(value)


def _heads(cfg: Mapping[str, Any], cls: str, down: list[str], up: list[str], mid: str) -> int | tuple[int, ...] | None:
    """Heads per level, from every attention that sits at that level (they must agree)."""
    chans, n = cfg["block_out_channels"], len(cfg["block_out_channels"])
    uses = [(i, kind, f"down_block_types[{i}]", i) for i, kind in enumerate(down)]
    uses += [(n - 1 - i, kind, f"up_block_types[{i}]", i) for i, kind in enumerate(up)]
    uses.append((n - 1, mid, "mid_block_type", n - 1))
    found: dict[int, tuple[int, str]] = {}
    for level, kind, where, index in uses:
        if kind == "none":
            continue
        heads = _head_count(cfg, cls, kind, chans[level], level, index)
        if level in found and found[level][0] != heads:
            raise SpecError(
                f"attention_head_dim: {found[level][1]} has {found[level][0]} heads but {where} has {heads} "
                f"at the same level; our spec has one head count per level"
            )
        found.setdefault(level, (heads, where))
    counts = {level: heads for level, (heads, _) in found.items()}
    if not counts:
        return None
    if len(set(counts.values())) == 1:
        return next(iter(counts.values()))
    return tuple(counts.get(level, 1) for level in range(n))


def _head_count(cfg: Mapping[str, Any], cls: str, kind: str, ch: int, level: int, index: int) -> int:
    """diffusers' heads: UNet2DModel's attention_head_dim is channels per head; in
    UNet2DConditionModel it is the number of heads of transformers, yet still channels per head
    for its Attn*Block2D, which (a diffusers quirk) read the un-reversed list in the up path."""
    value = cfg["attention_head_dim"]
    per_level = list(value) if isinstance(value, list | tuple) else [value] * len(cfg["block_out_channels"])
    if cls == "UNet2DConditionModel" and kind == "transformer":
        heads = per_level[level]
        if heads is None or ch % heads:
            raise SpecError(f"attention_head_dim: {ch} channels do not split into {heads} heads")
        return heads
    head_dim = per_level[index if cls == "UNet2DConditionModel" else 0] or ch
    if ch % head_dim:
        raise SpecError(f"attention_head_dim: {ch} channels do not split into heads of {head_dim}")
    return ch // head_dim


def _sample_size(value: int | list[int] | None, n: int) -> int:
    """Only benchmarks read it; None -> the smallest multiple of 2**(n-1) that is >= 32."""
    if isinstance(value, list | tuple):
        if len(set(value)) != 1:
            raise SpecError(f"sample_size: non-square {list(value)} is not supported")
        value = value[0]
    factor = 2 ** (n - 1)
    return value if value is not None else factor * -(-32 // factor)


# ---- local model folders (no hub access) ----------------------------------------------------

WEIGHT_NAMES = ("diffusion_pytorch_model{}.safetensors", "diffusion_pytorch_model{}.bin")


@dataclass(frozen=True)
class DiffusersFolder:
    """A local diffusers model folder: its config and the weight files to read, in order."""

    root: Path
    config: dict[str, Any]
    weight_files: tuple[Path, ...]

    @property
    def is_safetensors(self) -> bool:
        return self.weight_files[0].suffix == ".safetensors"


def is_path(obj: object) -> bool:
    return isinstance(obj, str | os.PathLike)


def find_folder(path: str | os.PathLike[str], variant: str | None = None) -> DiffusersFolder:
    """Resolve a model folder (or a pipeline folder with a ``unet/`` subfolder) on local disk."""
    root = Path(path)
    if not (root / "config.json").is_file() and (root / "unet" / "config.json").is_file():
        root = root / "unet"
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root}: no config.json (expected a local diffusers U-Net folder)")
    config = json.loads((root / "config.json").read_text())
    suffix = f".{variant}" if variant else ""
    for pattern in WEIGHT_NAMES:
        single = root / pattern.format(suffix)
        if single.is_file():
            return DiffusersFolder(root, config, (single,))
        index = single.with_name(single.name + ".index.json")
        if index.is_file():  # sharded: {"weight_map": {key: shard file}}
            shards = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
            return DiffusersFolder(root, config, tuple(root / s for s in shards))
    looked = ", ".join(p.format(suffix) for p in WEIGHT_NAMES)
    raise FileNotFoundError(f"{root}: no weights ({looked}, or their .index.json)")


def live_config(model: Any) -> dict[str, Any]:
    """A live diffusers model's config as config.json would hold it (with ``_class_name``)."""
    return {**dict(model.config), "_class_name": type(model).__name__}


def read_source(
    source: Any, variant: str | None, read_file: Callable[[Path], Mapping[str, V]]
) -> tuple[UNetSpec, dict[str, V]]:
    """The spec and state_dict (in our names) of a diffusers folder or live module.

    ``read_file`` reads one weight file in the caller's framework (torch tensors or arrays);
    a live module's own ``state_dict()`` is taken as it is.
    """
    if is_path(source):
        folder = find_folder(source, variant)
        spec = from_diffusers_config(folder.config, name=folder.root.name)
        state: dict[str, V] = {}
        for file in folder.weight_files:
            state.update(read_file(file))
    else:
        spec = from_diffusers_config(live_config(source))
        state = dict(source.state_dict())
    return spec, diffusers_to_ours(state)
