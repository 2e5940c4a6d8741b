"""JAX checkpoints: `orbax.checkpoint` folders carrying the run's manifest.

Every run, one device or a mesh, replicated or FSDP-sharded, saves the `TrainState` pytree with
orbax's `StandardCheckpointer` (each array written from its shards, no gather onto one device),
and `shared_configs.training.run_folder` hashes the files and commits the folder with its manifest.
Restoring takes a target of `jax.ShapeDtypeStruct` leaves carrying the shardings wanted now, so a
run resumes onto the same mesh, another one, or a single device. The mirror of
`torch_impl.checkpoint_io`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from shared_configs.training.manifest import Manifest
from shared_configs.training.run_folder import STATE, read_checkpoint, save, verify

FRAMEWORK, LAYOUT = "jax_impl", "orbax"


def save_checkpoint(out: Path, state: Any, manifest: Manifest) -> Path:
    """Save ``state`` (a pytree of arrays, e.g. a `TrainState`) as the checkpoint of ``manifest.step``."""

    def write(folder: Path) -> None:
        with ocp.StandardCheckpointer() as checkpointer:  # asynchronous: leaving the block waits for it
            checkpointer.save(folder.absolute(), state)

    return save(out, manifest, write)


def abstract_target(abstract_state: Any, shardings: Any) -> Any:
    """``abstract_state`` (e.g. from `jax.eval_shape`) as `jax.ShapeDtypeStruct` leaves placed by
    ``shardings`` (a matching pytree of `jax.sharding.Sharding`): what `load_checkpoint` restores onto."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)


def load_checkpoint(path: Path, target: Any) -> tuple[Any, Manifest]:
    """Check the checkpoint folder ``path`` against its manifest, then restore it onto ``target``
    (see `abstract_target`). Returns (state, manifest)."""
    manifest = read_checkpoint(path, FRAMEWORK, LAYOUT)
    verify(path, manifest)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore((path / STATE).absolute(), target), manifest
