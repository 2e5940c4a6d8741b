"""Data parallelism and FSDP in JAX: one mesh axis, sharding annotations, jit does the rest.

``ddp`` splits the batch along the mesh axis ``data`` and replicates the state; ``fsdp`` (ZeRO-3) also
shards every large state leaf along it. The step is the same for every mode; the mesh spans every
process's devices. Mirror: `torch_impl.parallel` (DDP, FSDP2). Docs: docs/training.md.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "data"
MIN_SHARDED = 1024  # elements: smaller leaves (biases, norm scales, the step count) stay replicated


def make_mesh(batch_size: int) -> Mesh:
    """A 1-D mesh ``data`` over every device of every process, process by process; the batch splits evenly."""
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if batch_size % len(devices):
        raise ValueError(f"--batch-size {batch_size}: does not split evenly over {len(devices)} devices")
    return Mesh(np.array(devices), (AXIS,))


def fsdp_partition(shape: tuple[int, ...], devices: int) -> P:
    """Shard the largest axis of ``shape`` that ``devices`` divides; replicate small or indivisible leaves."""
    divisible = [i for i, size in enumerate(shape) if size % devices == 0]
    if devices == 1 or not divisible or math.prod(shape) < MIN_SHARDED:
        return P()
    axis = max(divisible, key=lambda i: shape[i])
    return P(*(AXIS if i == axis else None for i in range(len(shape))))


def state_shardings(mesh: Mesh, state: Any, mode: str | None) -> Any:
    """A `NamedSharding` per leaf of ``state``: `fsdp_partition` for ``mode == "fsdp"``, replicated otherwise."""
    partition = (lambda a: fsdp_partition(a.shape, mesh.size)) if mode == "fsdp" else (lambda _: P())
    return jax.tree.map(lambda a: NamedSharding(mesh, partition(a)), state)


def shard(mesh: Mesh, state: Any, batch: tuple, mode: str | None = "ddp") -> tuple[Any, tuple]:
    """The state placed as ``mode`` says and the global ``batch`` split along its first axis (BatchNorm then
    uses global-batch statistics); placing an array where it already is costs nothing, so every step calls it."""
    return jax.device_put(state, state_shardings(mesh, state, mode)), place_batch(mesh, batch)


def place_batch(mesh: Mesh, batch: tuple) -> tuple:
    """``batch`` (None kept; the same global batch in every process) as global arrays split along the first
    axis, each device given its own rows."""
    split = NamedSharding(mesh, P(AXIS))

    def place(a: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(a.shape, split, lambda index: a[index])

    return tuple(None if a is None else place(np.asarray(a)) for a in batch)
