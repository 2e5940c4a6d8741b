"""`torch_impl.BudgetGuard`'s mechanics beside its decisions: a retry, and several processes agreeing.

`Window` keeps the guarded calls since the last optimizer step (each function, its arguments, torch's
random generators' states; accelerate's counters at the start) and replays them from the window's start
after an out-of-memory error: no gradient is copied. `agree` (one all-reduce of a `Vote`), `largest` and
`from_rank0` make several processes retry, judge and plan alike. docs/guard.md says what a step may do.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from shared_configs.planning.closed_loop import Vote, ballot, tally
from torch_impl.compat import set_sync_gradients

T = TypeVar("T")
RngState = tuple[torch.Tensor, torch.Tensor | None, torch.device]  # torch's CPU generator's, CUDA's on CUDA


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

    def enter(self, fn: Callable[..., Any], args: tuple, kwargs: dict, params: list[nn.Parameter], fresh: bool) -> None:
        """A guarded call ``fn(*args, **kwargs)`` begins. ``fresh``: an optimizer step ended since the last call
        (or none was seen); with no gradient allocated, nothing was accumulated either: a new window."""
        if fresh or all(p.grad is None for p in params):
            self.calls, self.had = [], {id(p) for p in params if p.grad is not None}
            self.counters = [(a, a.step, a.gradient_state.sync_gradients) for a in self.accelerators]
        self.calls.append((frozen(fn), tuple(map(frozen, args)), kwargs, rng_state(params)))

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
        for fn, args, kwargs, rng in self.calls[:-1]:
            set_rng_state(rng)
            fn(*args, **kwargs)
        set_rng_state(self.calls[-1][3])


def frozen(fn: T) -> T:
    """``fn`` with its closure's variables as they are now: a loop rebinds them (``batch``) before a replay."""
    if not isinstance(fn, types.FunctionType) or not fn.__closure__:
        return fn
    cells = tuple(map(_now, fn.__closure__))
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return copy  # type: ignore[return-value]


def _now(cell: types.CellType) -> types.CellType:
    try:
        return types.CellType(cell.cell_contents)
    except ValueError:  # a variable not assigned yet
        return types.CellType()


def rng_state(params: list[nn.Parameter]) -> RngState:
    device = next((p.device for p in params), torch.device("cpu"))
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None, device


def set_rng_state(state: RngState) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], state[2])


class PeerOutOfMemory(torch.OutOfMemoryError):
    """Another rank ran out of memory: raised where this rank learns it (before its optimizer step, or at the
    end of its call), so that it takes the same path as the rank that failed."""

    def __init__(self, vote: Vote, rank: int) -> None:
        super().__init__(f"rank {rank} ran out of memory in the guarded step")
        self.vote, self.rank = vote, rank


def processes() -> int:
    """The processes of the default group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if processes() > 1 else 0


def host_group() -> Any:
    """The group the guard's integers are all-reduced in: gloo, on the host (no device sync under NCCL); None, the
    default group, where that is gloo or there is one process. Every rank makes it, as it makes its guard."""
    return dist.new_group(backend="gloo") if processes() > 1 and dist.get_backend() != "gloo" else None


def largest(value: int, group: Any = None) -> int:
    """The largest of every rank's ``value`` (one all-reduce of one integer)."""
    if processes() == 1:
        return value
    found = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
    return int(found.item())


def agree(vote: Vote, group: Any = None) -> tuple[Vote, int]:
    """Every rank's ``vote`` at a point all reach: the largest, and a rank that cast it."""
    n = processes()
    return (vote, 0) if n == 1 else tally(largest(ballot(vote, rank(), n), group), n)


def go_on(group: Any = None) -> None:
    """Every rank says it may go on; raises `PeerOutOfMemory` where another rank ran out of memory."""
    vote, who = agree(Vote.GO_ON, group)
    if vote != Vote.GO_ON:
        raise PeerOutOfMemory(vote, who)


def why_not_retry(vote: Vote, who: str) -> str | None:
    """Why an attempt cannot run again (an optimizer step had begun, on this rank or ``who``'s), or None."""
    if vote == Vote.RETRY:
        return None
    return f"{'its' if who else 'the'} optimizer step had begun (some weights may be updated already)"


def accelerator_of(context: Any) -> Any | None:
    """accelerate's ``Accelerator`` whose method ``context`` is (``accelerator.accumulate``), or None."""
    owner = getattr(context, "__self__", None)
    return owner if hasattr(owner, "gradient_state") and isinstance(getattr(owner, "step", None), int) else None


def base_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """accelerate's ``AcceleratedOptimizer`` is a wrapper: the optimizer it steps."""
    return opt.optimizer if type(opt).__name__ == "AcceleratedOptimizer" else opt


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
