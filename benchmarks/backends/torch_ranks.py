"""The torch rows under FSDP2 (``--world-size N``): N processes under torchrun, gloo on CPU.

Each rank shards the planned model as ``--distributed fsdp`` trains (`torch_impl.parallel.shard_blocks`),
steps on its slice of the global batch and measures its own step; `gather` hands rank 0, the one
that reports, the other ranks' peaks.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.harness.job import Job
from shared_configs import UNetSpec
from shared_configs.training.data import Batch, example_batch
from torch_impl.memory import state_tensors, storage_bytes
from torch_impl.parallel import shard_blocks


def init(job: Job) -> None:
    """Join the process group (once per worker), after checking torchrun started ``job.world_size``."""
    if job.world_size == 1 or dist.is_initialized():
        return
    if (started := int(os.environ.get("WORLD_SIZE", "1"))) != job.world_size:
        raise RuntimeError(f"world-size: the job asks for {job.world_size} processes, torchrun started {started}")
    dist.init_process_group("gloo")


def shard(job: Job, model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 over the ranks (``world_size`` > 1); the model as it is otherwise."""
    return shard_blocks(model) if job.world_size > 1 else model


def rank_batch(spec: UNetSpec, batch_size: int, job: Job) -> Batch:
    """This rank's ``batch_size`` samples: its slice of the global batch (``world_size`` x ``batch_size``)."""
    if job.world_size == 1:
        return example_batch(spec, batch_size, job.context_length)
    whole = example_batch(spec, job.world_size * batch_size, job.context_length)
    return whole.shard(dist.get_rank(), job.world_size)


def static_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """This rank's parameters (its shards under FSDP2) and optimizer state, between steps."""
    return storage_bytes(model.parameters()) + storage_bytes(state_tensors(optimizer))


def gather(job: Job, row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with ``world_size`` and the largest per-rank peak (every rank's own step, gathered)."""
    if job.world_size == 1:
        return {**row, "world_size": 1, "max_rank_peak_bytes": row["peak_bytes"]}
    peaks: list[Any] = [None] * job.world_size
    dist.all_gather_object(peaks, row["peak_bytes"])
    return {**row, "world_size": job.world_size, "max_rank_peak_bytes": max(peaks)}
