"""JAX checkpoints: `orbax.checkpoint` folders carrying the run's manifest.

Every run, one device or a mesh, replicated or FSDP-sharded, saves the `TrainState` pytree with
orbax's `StandardCheckpointer` (each array written from its shards, no gather onto one device),
and `shared_configs.training.run_folder` hashes the files and commits the folder with its manifest.
Restoring takes a target of `jax.ShapeDtypeStruct` leaves carrying the shardings wanted now, so a
run resumes onto the same mesh, another one, or a single device. Over several processes each
writes (and reads) the shards of its own devices: the files hold global arrays, whatever the
layout, so N processes' checkpoint resumes in one process with N x k devices, and the other way.
The mirror of `torch_impl.checkpoint_io`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from shared_configs.training.manifest import Manifest
from shared_configs.training.run_folder import SOLO, STATE, Comm, read_checkpoint, save, verify

FRAMEWORK, LAYOUT = "jax_impl", "orbax"


def save_checkpoint(out: Path, state: Any, manifest: Manifest, comm: Comm = SOLO) -> Path:
    """Save ``state`` (a pytree of arrays, e.g. a `TrainState`) as the checkpoint of ``manifest.step``;
    over several processes (``comm``: `jax_impl.processes.current_comm`) every one calls it and
    writes the shards its devices hold."""

    def write(folder: Path) -> None:
        try:
            with ocp.StandardCheckpointer() as checkpointer:  # asynchronous: leaving the block waits for it
                checkpointer.save(folder.absolute(), state)
        except BaseException:
            _settle(folder.parent)  # so that the partial folder can be removed
            raise

    return save(out, manifest, write, comm, nbytes=sum(leaf.nbytes for leaf in jax.tree.leaves(state)))


def abstract_target(abstract_state: Any, shardings: Any) -> Any:
    """``abstract_state`` (e.g. from `jax.eval_shape`) as `jax.ShapeDtypeStruct` leaves placed by
    ``shardings`` (a matching pytree of `jax.sharding.Sharding`): what `load_checkpoint` restores onto."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)


def load_checkpoint(path: Path, target: Any, comm: Comm = SOLO) -> tuple[Any, Manifest]:
    """Check the checkpoint folder ``path`` against its manifest (each process of ``comm`` a share of
    the files), then restore it onto ``target`` (see `abstract_target`; over several processes each
    reads the shards its devices hold). Returns (state, manifest)."""
    manifest = read_checkpoint(path, FRAMEWORK, LAYOUT)
    verify(path, manifest, comm)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore((path / STATE).absolute(), target), manifest


# ---- a failed write as one line: orbax's own echoes of it are dropped ----------------------


class _OrbaxEchoes(logging.Filter):
    """Drops the tracebacks orbax's threads log of a failed write (disk full): orbax raises the
    error itself (`shared_configs.training.run_folder.save` makes it one line), and its threads and sibling
    coroutines would each log a copy, some after the save returned (absl), some when collected
    (asyncio's "exception was never retrieved")."""

    def filter(self, record: logging.LogRecord) -> bool:
        tb = record.exc_info[2] if record.exc_info else None
        return not any("/orbax/" in frame.filename for frame in traceback.extract_tb(tb))


for _logger in ("absl", "asyncio"):
    logging.getLogger(_logger).addFilter(_OrbaxEchoes())


def _quiet_closed_loops(previous: Any) -> Any:
    """``sys.unraisablehook`` but for one case: when a write fails, tensorstore's threads go on
    completing orbax's futures on event loops orbax has closed, and each such callback ends as an
    "Exception ignored" traceback (RuntimeError: Event loop is closed), hundreds of them."""

    def hook(unraisable: Any) -> None:
        frames = traceback.extract_tb(unraisable.exc_traceback)
        closed = isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"
        if not (closed and frames and frames[-1].filename.endswith("asyncio/base_events.py")):
            previous(unraisable)

    return hook


sys.unraisablehook = _quiet_closed_loops(sys.unraisablehook)


def _settle(folder: Path, quiet_s: float = 0.5, limit_s: float = 10.0) -> None:
    """Wait until nothing under ``folder`` has changed for ``quiet_s`` (at most ``limit_s``): after a
    failed write orbax returns while tensorstore's writers still run."""

    def state() -> list[tuple[str, int, int]]:
        found = []
        for path in folder.rglob("*"):
            with contextlib.suppress(OSError):  # removed meanwhile
                found.append((str(path), path.stat().st_size, path.stat().st_mtime_ns))
        return sorted(found)

    start = last_change = time.monotonic()
    seen = state()
    while time.monotonic() - last_change < quiet_s and time.monotonic() - start < limit_s:
        time.sleep(0.05)
        if (now := state()) != seen:
            seen, last_change = now, time.monotonic()
