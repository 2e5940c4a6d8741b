"""`torch_impl.BudgetGuard`'s mechanics beside its decisions: a retry, and several processes agreeing.

`Window` keeps the guarded calls since the last optimizer step (each function, its arguments, torch's
random generators' states; accelerate's counters at the start) and replays them from the window's start
after an out-of-memory error: no gradient is copied. `agree` (one all-reduce of a `Vote`), a `Comm`'s ``max``
and `from_rank0` make several processes retry, judge and plan alike. docs/guard.md says what a step may do.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import get_device_states, set_device_states

from shared_configs.planning.closed_loop import Vote, ballot, tally
from shared_configs.training.run_folder import SOLO, Comm
from torch_impl.checkpoint_io import current_comm
from torch_impl.compat import set_sync_gradients

T = TypeVar("T")
RngState = tuple[torch.Tensor, list[int], list[torch.Tensor]]  # torch's CPU generator's; its devices', ids and states


class Window:
    """The guarded calls since the last optimizer step, replayable from the window's start (`rewind`, `replay`).

    Kept per call: the function (its closure's variables as the call found them), the arguments and torch's
    generator states; per window: which parameters had a gradient, and the counters of the ``Accelerator``s
    in ``accelerators`` (the guard's list). References and generator states only: at a window's start the
    gradients are None or dead (an optimizer step has used them), so a retry sets them to None or zeroes them.
    """

    def __init__(self, accelerators: list[Any]) -> None:
        self.accelerators = accelerators
        self.calls: list[tuple[Callable[..., Any], tuple, dict, RngState]] = []
        self.had: set[int] = set()  # ids of the parameters with a gradient at the start
        self.counters: list[tuple[Any, int, bool]] = []

    def enter(self, fn: Callable[..., Any], args: tuple, kwargs: dict, params: list[nn.Parameter]) -> None:
        """A guarded call ``fn(*args, **kwargs)`` begins: a new window when ``calls`` is empty (an optimizer step
        ended since the last call, or none was seen), or when no gradient is allocated (nothing was accumulated)."""
        if not self.calls or all(p.grad is None for p in params):
            self.calls, self.had = [], {id(p) for p in params if p.grad is not None}
            self.counters = [(a, a.step, a.gradient_state.sync_gradients) for a in self.accelerators]
        rng = (torch.get_rng_state(), *get_device_states(*params[:1]))  # CUDA's on CUDA, as checkpoint keeps it
        self.calls.append((frozen(fn), tuple(map(frozen, args)), kwargs, rng))

    def rewind(self, params: Iterable[nn.Parameter]) -> None:
        """Back to the window's start: each gradient None, or zeroed where one was allocated; accelerate's counters."""
        for p in params:
            if id(p) not in self.had:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        for accelerator, step, sync in self.counters:  # accelerate.Accelerator.accumulate counts entries
            accelerator.step = step
            set_sync_gradients(accelerator, sync)

    def replay(self) -> None:
        """After `rewind`: the window's earlier calls again, each from its generator states; then the last call's."""
        for i, (fn, args, kwargs, (cpu, devices, states)) in enumerate(self.calls, start=1):
            torch.set_rng_state(cpu)
            set_device_states(devices, states)
            if i < len(self.calls):  # the last one runs again in the guard's next attempt
                fn(*args, **kwargs)


def frozen(fn: T) -> T:
    """``fn`` with its closure's variables as they are now: a loop rebinds them (``batch``) before a replay."""
    if not isinstance(fn, types.FunctionType) or not fn.__closure__:
        return fn
    copy = types.FunctionType(
        fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(map(_now, fn.__closure__))
    )
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy  # type: ignore[return-value]


def _now(cell: types.CellType) -> types.CellType:
    try:
        return types.CellType(cell.cell_contents)
    except ValueError:  # a variable not assigned yet
        return types.CellType()


class PeerOutOfMemory(torch.OutOfMemoryError):
    """Another rank ran out of memory: raised where this rank learns it (before its optimizer step, or at the
    end of its call), so that it takes the same path as the rank that failed."""

    def __init__(self, vote: Vote, rank: int) -> None:
        super().__init__(f"rank {rank} ran out of memory in the guarded step")
        self.vote, self.rank = vote, rank


def agree(vote: Vote, comm: Comm = SOLO) -> tuple[Vote, int]:
    """Every rank's ``vote`` at a point all reach (one all-reduce of one integer): the largest, and a rank that
    cast it."""
    return tally(comm.max(ballot(vote, comm.rank, comm.world)), comm.world)


def go_on(comm: Comm = SOLO) -> None:
    """Every rank says it may go on; raises `PeerOutOfMemory` where another rank ran out of memory."""
    vote, who = agree(Vote.GO_ON, comm)
    if vote != Vote.GO_ON:
        raise PeerOutOfMemory(vote, who)


def base_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """accelerate's ``AcceleratedOptimizer`` is a wrapper: the optimizer it steps."""
    return opt.optimizer if type(opt).__name__ == "AcceleratedOptimizer" else opt


def from_rank0(fn: Callable[[], T]) -> T:
    """``fn()`` as rank 0 computes it, on every rank; rank 0's error raised on every rank."""
    comm = current_comm()
    if comm.world == 1:
        return fn()
    box: list[Any] = [None]  # rank 0's value or error
    if comm.rank == 0:
        try:
            box[0] = fn()
        except Exception as err:  # raised below on every rank, not only on rank 0
            box[0] = err
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return box[0]
