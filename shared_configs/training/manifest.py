"""A checkpoint's integrity record: ``manifest.json``, written last, inside the checkpoint folder (whatever the
framework's format). It lists every file with its size and SHA-256, carries what a resume needs (framework,
format, step, losses, the run's record) and its own SHA-256. `check_files` names each file that is missing,
truncated, grown or changed; ranks can each check a share. No torch or jax import.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from shared_configs.files import json_digest, write_sealed

MANIFEST = "manifest.json"
KIND = "unet-remat checkpoint"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: the message is one line naming the file and the fault."""


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written: one line naming the path; the previous checkpoint is kept."""


@dataclass(frozen=True)
class Manifest:
    """What `write_manifest` records and `read_manifest` returns."""

    framework: str  # the package that wrote it: torch_impl or jax_impl
    layout: str  # the on-disk format of the state, e.g. torch.distributed.checkpoint, orbax
    step: int
    losses: list[float]
    run: dict[str, Any]  # the run's record: its config and spec (see shared_configs.training.config.run_record)
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # relative path -> {bytes, sha256}


def files_of(root: Path) -> list[str]:
    """Every file under ``root`` but the manifest, as sorted POSIX paths relative to ``root``."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST)


def sha256_of(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def hash_files(root: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """{name: {bytes, sha256}} for the files ``names`` under ``root``."""
    return {name: {"bytes": (root / name).stat().st_size, "sha256": sha256_of(root / name)} for name in names}


def write_manifest(root: Path, manifest: Manifest) -> None:
    """``root/manifest.json``, atomically: the body plus its own SHA-256."""
    write_sealed(root / MANIFEST, {"kind": KIND, "version": VERSION, **asdict(manifest)})


def read_manifest(root: Path) -> Manifest:
    """The manifest of the checkpoint folder ``root``; `CheckpointError` naming what is wrong."""
    path = root / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing, so {root} is not a complete checkpoint")
    try:
        document = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: not a checkpoint manifest (unreadable JSON: {err})") from None
    if not isinstance(document, dict) or document.get("kind") != KIND:
        raise CheckpointError(f"{path}: not a checkpoint manifest (no kind {KIND!r})")
    if document.get("version") != VERSION:
        raise CheckpointError(f"{path}: manifest version {document.get('version')!r}; this version reads {VERSION}")
    if document.pop("sha256", None) != json_digest(document):
        raise CheckpointError(f"{path}: damaged (its contents do not match its own SHA-256)")
    try:
        return Manifest(**{k: v for k, v in document.items() if k not in ("kind", "version")})
    except TypeError as err:
        raise CheckpointError(f"{path}: not a checkpoint manifest ({err})") from None


def check_files(root: Path, manifest: Manifest, names: list[str]) -> list[str]:
    """One line per file of ``names`` (listed in ``manifest``) that is not as recorded."""
    problems = []
    for name in names:
        path, want = root / name, manifest.files[name]
        if not path.is_file():
            problems.append(f"{path}: missing")
        elif (size := path.stat().st_size) != want["bytes"]:
            kind = "truncated" if size < want["bytes"] else "longer than recorded"
            problems.append(f"{path}: {kind} ({size} bytes, recorded {want['bytes']})")
        elif sha256_of(path) != want["sha256"]:
            problems.append(f"{path}: corrupted (SHA-256 differs from the manifest's)")
    return problems
