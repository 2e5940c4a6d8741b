"""`torch_impl.BudgetGuard`'s mechanics beside its decisions: a retry, and several processes agreeing.

`RetryPoint` keeps what a retried step must find as its failed attempt found it: torch's random
generators, the trained parameters' gradients and accelerate's accumulation counter (of the
``Accelerator`` the script hands over); `why_not_retry` names what no restore can undo. `agreed_peak`
and `from_rank0` make several processes judge and plan alike. docs/guard.md says what a step may do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from torch_impl.compat import set_sync_gradients

T = TypeVar("T")


class RetryPoint:
    """The state a guarded call starts from, restorable after its attempt failed."""

    def __init__(
        self, params: Iterable[nn.Parameter], device: torch.device, accelerators: Iterable[Any], fresh: bool
    ) -> None:
        """``fresh``: an optimizer step ended since the gradients were last accumulated into (a retry
        zeroes them: none is copied)."""
        self.device = device
        self.rng = torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        # Gradients earlier micro-steps accumulated: copied to the host, out of the device's way.
        self.grads = [(p, _kept(p.grad, fresh)) for p in params]
        self.accelerators = [(a, a.step, a.gradient_state.sync_gradients) for a in accelerators]

    def restore(self) -> None:
        torch.set_rng_state(self.rng[0])
        if self.rng[1] is not None:
            torch.cuda.set_rng_state(self.rng[1], self.device)
        for p, saved in self.grads:
            if saved is None:
                p.grad = None
            elif saved is ZEROS:
                if p.grad is not None:
                    p.grad.zero_()
            elif p.grad is None or p.grad.shape != saved.shape:
                p.grad = saved.to(p.device)
            else:
                p.grad.copy_(saved)
        for accelerator, step, sync in self.accelerators:  # accelerate.Accelerator.accumulate counts entries
            accelerator.step = step
            set_sync_gradients(accelerator, sync)


ZEROS: Any = object()  # a gradient a retry zeroes (after an optimizer step), not copied


def _kept(grad: torch.Tensor | None, fresh: bool) -> Any:
    if grad is None:
        return None
    return ZEROS if fresh else grad.detach().to("cpu", copy=True)


def processes() -> int:
    """The processes of the default group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def why_not_retry(stepped: bool) -> str | None:
    """Why a failed attempt cannot run again (an optimizer step begun, other processes' collectives), or None."""
    if stepped:
        return "the optimizer step had begun (some weights may be updated already)"
    if (n := processes()) > 1:
        return f"{n} processes run this step, and the others wait in its collectives"
    return None


def accelerator_of(context: Any) -> Any | None:
    """accelerate's ``Accelerator`` whose method ``context`` is (``accelerator.accumulate``), or None."""
    owner = getattr(context, "__self__", None)
    return owner if hasattr(owner, "gradient_state") and isinstance(getattr(owner, "step", None), int) else None


def base_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """accelerate's ``AcceleratedOptimizer`` is a wrapper: the optimizer it steps."""
    return opt.optimizer if type(opt).__name__ == "AcceleratedOptimizer" else opt


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
