"""Data parallelism and FSDP in JAX: one mesh axis, sharding annotations, jit does the rest.

``--distributed ddp``: the batch is split along the mesh axis ``data``, the train state
replicated; jit's sharding propagation inserts the gradient all-reduce. ``--distributed fsdp``
(ZeRO-3, as MaxText's ``fsdp`` axis): the same axis also shards every large leaf of the state
(parameters, AdamW moments; the gradients follow, being combined with them elementwise) along one
of its axes that the device count divides; small or indivisible leaves stay replicated. jit then
all-gathers each parameter where the forward and backward use it and reduce-scatters its gradient.
No wrapper, no hand-written communication: the step function is the same for every mode.

On CPU, ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` gives N devices. The mirror of
`torch_impl.parallel` (DDP, FSDP2).
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
    """A 1-D mesh over every device, axis ``data``; the batch must split evenly over it."""
    devices = jax.devices()
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
    """A `NamedSharding` per leaf of ``state`` (arrays or `jax.ShapeDtypeStruct`): `fsdp_partition`
    for ``mode == "fsdp"``, replicated otherwise."""
    if mode == "fsdp":
        return jax.tree.map(lambda a: NamedSharding(mesh, fsdp_partition(a.shape, mesh.size)), state)
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), state)


def shard(mesh: Mesh, state: Any, batch: tuple, mode: str | None = "ddp") -> tuple[Any, tuple]:
    """Place the state as ``mode`` says (see `state_shardings`), the batch split along its first
    axis. BatchNorm then normalises with global-batch statistics: jit inserts the reductions.
    Placing an array where it already is costs nothing, so this runs before every step."""
    split = NamedSharding(mesh, P(AXIS))
    placed = tuple(None if a is None else jax.device_put(a, split) for a in batch)
    return jax.device_put(state, state_shardings(mesh, state, mode)), placed


def device_bytes(tree: Any, device: jax.Device) -> int:
    """The bytes of ``tree``'s arrays held on ``device`` (its shards of them)."""
    return sum(s.data.nbytes for a in jax.tree.leaves(tree) for s in a.addressable_shards if s.device == device)
