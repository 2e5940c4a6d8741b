"""diffusers U-Nets on disk -> our spec and state_dict (no torch, jax or diffusers): a local model or pipeline
folder, a repo id in the local Hugging Face cache (nothing downloaded) or a live module; weight names differ by
segment renames (`KEY_RENAMES`, `LEGACY_KEY_RENAMES`). Every problem is one line naming the file. docs/diffusers.md.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from shared_configs.controlnet import ControlNetSpec
from shared_configs.diffusers.controlnet_config import spec_from_config
from shared_configs.spec import UNetSpec

V = TypeVar("V")

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
LEGACY_KEY_RENAMES = (("query", "to_q"), ("key", "to_k"), ("value", "to_v"), ("proj_attn", "to_out"))


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


WEIGHT_NAMES = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class DiffusersFolder:
    """A local diffusers model folder: its config and the weight files to read, in order."""

    root: Path
    config: dict[str, Any]
    weight_files: tuple[Path, ...]


def is_path(obj: object) -> bool:
    return isinstance(obj, str | os.PathLike)


def find_folder(
    source: str | os.PathLike[str],
    variant: str | None = None,
    subfolder: str | None = None,
    revision: str | None = None,
    weights: tuple[str, ...] = WEIGHT_NAMES,
) -> DiffusersFolder:
    """Resolve a model folder, a pipeline folder (its ``unet/``) or a cached repo id on local disk; its weight file is
    the first of ``weights`` there (or its shards)."""
    root = Path(source)
    if not root.exists() and _REPO_ID.match(str(source)):
        root = _from_cache(str(source), subfolder, revision)
    elif subfolder is not None:
        root = root / subfolder
    if subfolder is None and not (root / "config.json").is_file() and (root / "unet" / "config.json").is_file():
        root = root / "unet"  # a pipeline folder (or a cached pipeline repo): its U-Net
    if not (root / "config.json").is_file():
        why = "expected a local diffusers U-Net folder" if root.exists() else "no such folder"
        raise FileNotFoundError(f"{root}: no config.json ({why})")
    return DiffusersFolder(root, read_config(root / "config.json"), _weight_files(root, variant, weights))


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, from the environment as it is now (huggingface_hub reads it once, at import)."""
    if cache := os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(cache).expanduser()
    if home := os.environ.get("HF_HOME"):
        return Path(home).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _from_cache(repo_id: str, subfolder: str | None, revision: str | None) -> Path:
    """The snapshot folder of a cached repo (its U-Net's: ``subfolder``, else the root or ``unet/``)."""
    from huggingface_hub import try_to_load_from_cache

    cache = hub_cache_dir()
    for sub in [subfolder] if subfolder is not None else ["", "unet"]:
        name = f"{sub}/config.json" if sub else "config.json"
        found = try_to_load_from_cache(repo_id, name, cache_dir=cache, revision=revision)
        if isinstance(found, str):  # else None, or a sentinel for "known not to exist"
            return Path(found).parent
    where = cache / f"models--{repo_id.replace('/', '--')}"
    what = f"{subfolder}/config.json" if subfolder else "config.json or unet/config.json"
    raise FileNotFoundError(
        f"{repo_id}: not a local folder, nor in the local Hugging Face cache at revision "
        f"{revision or 'main'} (looked for {what} under {where}; local files only, nothing is "
        "downloaded)"
    )


def _weight_files(root: Path, variant: str | None, weights: tuple[str, ...]) -> tuple[Path, ...]:
    """The single weight file, or the shards its index lists (diffusers' names, variant included)."""
    looked = []
    for name in weights:
        single = root / _with_variant(name, variant)
        index = root / _with_variant(f"{name}.index.json", variant)
        looked += [single.name, index.name]
        if single.is_file():
            return (single,)
        if index.is_file():  # sharded: {"weight_map": {key: shard file}}
            weight_map = read_config(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ValueError(f"{index}: no weight_map of keys to shard files")
            return tuple(root / s for s in dict.fromkeys(weight_map.values()))
    raise FileNotFoundError(f"{root}: no weights (looked for {', '.join(looked)})")


def _with_variant(name: str, variant: str | None) -> str:
    """diffusers' rule: the variant goes before the last extension (``m.fp16.safetensors``, ``m.index.fp16.json``)."""
    if variant is None:
        return name
    stem, ext = name.rsplit(".", 1)
    return f"{stem}.{variant}.{ext}"


def read_config(path: Path) -> dict[str, Any]:
    """A JSON object from ``path``; a broken file is one line naming it and where it breaks."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: unreadable ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def live_config(model: Any) -> dict[str, Any]:
    """A live diffusers model's config as config.json would hold it (with ``_class_name``)."""
    return {**dict(model.config), "_class_name": type(model).__name__}


def read_source(
    source: Any,
    variant: str | None,
    read_file: Callable[[Path], Mapping[str, V]],
    subfolder: str | None = None,
    revision: str | None = None,
) -> tuple[UNetSpec | ControlNetSpec, dict[str, V]]:
    """The spec and state_dict (our names) of a diffusers folder, cached repo id or live U-Net or ControlNet."""
    if not is_path(source):
        return spec_from_config(live_config(source)), diffusers_to_ours(dict(source.state_dict()))
    folder = find_folder(source, variant, subfolder, revision)
    name = folder.root.name if Path(source).exists() else str(source).rsplit("/", 1)[-1]  # a repo id: its last part
    spec = spec_from_config(folder.config, name=name)
    state: dict[str, V] = {}
    for file in folder.weight_files:
        try:
            state.update(read_file(file))
        except Exception as err:  # safetensors, pickle and zip errors alike: name the file
            detail = str(err).strip().splitlines()[0] if str(err).strip() else ""
            raise ValueError(f"{file}: unreadable weights ({type(err).__name__}: {detail})") from None
    return spec, diffusers_to_ours(state)


def check_weights(
    got: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], spec: UNetSpec | ControlNetSpec
) -> None:
    """One line listing every missing, unexpected and mis-shaped weight (names -> torch shapes), else nothing."""
    missing = sorted(expected.keys() - got.keys())
    extra = sorted(got.keys() - expected.keys())
    shaped = sorted(k for k in expected.keys() & got.keys() if tuple(got[k]) != tuple(expected[k]))
    parts = [f"{len(missing)} missing: {', '.join(map(_diffusers_name, missing))}"] if missing else []
    parts += [f"{len(extra)} unexpected: {', '.join(map(_diffusers_name, extra))}"] if extra else []
    if shaped:
        shapes = [f"{_diffusers_name(k)} {tuple(got[k])} (expected {tuple(expected[k])})" for k in shaped]
        parts.append(f"{len(shaped)} mis-shaped: {', '.join(shapes)}")
    if parts:
        raise ValueError(f"diffusers weights do not match spec {spec.name!r}: {'; '.join(parts)}")


def _diffusers_name(key: str) -> str:
    return _rename(key, _TO_DIFFUSERS)
