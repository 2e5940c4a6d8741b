"""Several processes under one `torch_impl.BudgetGuard` each (torchrun, ``accelerate launch``).

`agreed_peak` (the largest peak of all ranks) makes their judgement one, `from_rank0` (rank 0 plans
and broadcasts) their plans: every rank puts on the same plan before the same step. docs/guard.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def processes() -> int:
    """The processes of the default group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def agreed_peak(peak: int, device: torch.device) -> int:
    """The largest of every rank's ``peak`` (bytes)."""
    if processes() == 1:
        return peak
    on = device if dist.get_backend() == "nccl" else torch.device("cpu")
    value = torch.tensor([peak], dtype=torch.int64, device=on)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def from_rank0(fn: Callable[[], T]) -> T:
    """``fn()`` as rank 0 computes it, on every rank; rank 0's error raised on every rank."""
    if processes() == 1:
        return fn()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as err:  # raised below on every rank, not only on rank 0
            box[0] = ("error", err)
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value
