"""JAX checkpoints: `orbax.checkpoint` folders carrying the run's manifest. Mirror: `torch_impl.checkpoint_io`.

Every run saves its `TrainState` with orbax's `StandardCheckpointer`, each array written from its shards
(each process its own devices'); `shared_configs.training.run_folder` hashes and commits the folder. The
files hold global arrays, so a run resumes onto any mesh, any number of processes, or a single device.
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
    """Save ``state`` as the checkpoint of ``manifest.step``; over several processes every one calls it."""

    def write(folder: Path) -> None:
        try:
            with ocp.StandardCheckpointer() as checkpointer:  # asynchronous: leaving the block waits for it
                checkpointer.save(folder.absolute(), state)
        except BaseException:
            _settle(folder.parent)  # so that the partial folder can be removed
            raise

    return save(out, manifest, write, comm, nbytes=sum(leaf.nbytes for leaf in jax.tree.leaves(state)))


def abstract_target(abstract_state: Any, shardings: Any) -> Any:
    """``abstract_state`` as `jax.ShapeDtypeStruct` leaves placed by ``shardings``: what `load_checkpoint` takes."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)


def load_checkpoint(path: Path, target: Any, comm: Comm = SOLO) -> tuple[Any, Manifest]:
    """(state, manifest): the folder ``path`` checked against its manifest, restored onto ``target``."""
    manifest = read_checkpoint(path, FRAMEWORK, LAYOUT)
    verify(path, manifest, comm)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore((path / STATE).absolute(), target), manifest


# ---- a failed write as one line: orbax's own echoes of it are dropped ----------------------


def _no_orbax_echoes(record: logging.LogRecord) -> bool:
    """A logging filter: drops the tracebacks orbax's threads log of a failed write (orbax raises the error
    itself, made one line)."""
    tb = record.exc_info[2] if record.exc_info else None
    return not any("/orbax/" in frame.filename for frame in traceback.extract_tb(tb))


for _logger in ("absl", "asyncio"):
    logging.getLogger(_logger).addFilter(_no_orbax_echoes)


def _quiet_closed_loops(previous: Any) -> Any:
    """``sys.unraisablehook`` less the "Event loop is closed" tracebacks tensorstore leaves after a failed write."""

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
