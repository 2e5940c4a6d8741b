"""Torch checkpoints: `torch.distributed.checkpoint` (DCP) folders carrying the run's manifest.

One process or many, DDP or FSDP2, a run saves the same way: each rank writes its own shards of the
model and optimizer state, and `shared_configs.training.run_folder` hashes and commits the folder.
`dcp.load` reshards on the way in, so a run resumes on any number of ranks. Mirror: `jax_impl.checkpoint_io`.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shared_configs.training.manifest import Manifest
from shared_configs.training.run_folder import SOLO, STATE, Comm, read_checkpoint, save, verify
from torch_impl.compat import tree_leaves

FRAMEWORK, LAYOUT = "torch_impl", "torch.distributed.checkpoint"


@dataclass(frozen=True)
class ProcessGroupComm:
    """`shared_configs.training.run_folder.Comm` over the default torch process group."""

    rank: int
    world: int

    def barrier(self) -> None:
        dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def max(self, value: int) -> int:
        total = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return int(total.item())


def current_comm() -> Comm:
    """The process group's ranks when one is initialised, else `SOLO`."""
    return ProcessGroupComm(dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else SOLO


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every save and load without a process group that it assumes one process: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*unavailable or uninitialized")
        yield


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: Extra | None) -> dict[str, Any]:
    # DCP is imported where a checkpoint is read or written: its import is slow, and most processes never do
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    if extra:  # the regime's own state: the EMA copy, the loss scale
        state["extra"] = {name: obj.state_dict() for name, obj in extra.items()}
    return state


Extra = Mapping[str, Any]  # name -> an object with state_dict() / load_state_dict() (EMA, GradScaler)


def save_checkpoint(
    out: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, manifest: Manifest, extra: Extra | None = None
) -> Path:
    """Save a checkpoint of ``manifest.step`` into the run folder ``out`` (every rank calls it)."""
    state = _state(model, optimizer, extra)

    def write(folder: Path) -> None:
        import torch.distributed.checkpoint as dcp

        with _quiet_single_process():
            dcp.save(state, checkpoint_id=folder, no_dist=not dist.is_initialized())

    return save(out, manifest, write, current_comm(), nbytes=_nbytes(state))


def _nbytes(tree: Any) -> int:
    """The bytes of every tensor in ``tree`` (whole tensors: a DTensor counts all its shards)."""
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: Extra | None = None
) -> Manifest:
    """Check ``path`` against its manifest, then restore ``model``, ``optimizer`` and ``extra`` (every rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    manifest = read_checkpoint(path, FRAMEWORK, LAYOUT)
    verify(path, manifest, current_comm())
    state = _state(model, optimizer, extra)
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=path / STATE, no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    for name, obj in (extra or {}).items():
        obj.load_state_dict(state["extra"][name])
    return manifest
