"""What a retried step must find as its failed attempt found it (`torch_impl.BudgetGuard`'s retry).

`RetryPoint` keeps torch's random generators, the trained parameters' gradients and accelerate's
accumulation counter; `why_not_retry` names what no restore can undo. docs/guard.md says what a
step may do.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


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
            accelerator.gradient_state._set_sync_gradients(sync)


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


def accelerators_among(objects: Iterable[Any]) -> list[Any]:
    """accelerate's ``Accelerator`` objects among ``objects`` (none when accelerate is not imported)."""
    import sys

    module = sys.modules.get("accelerate")
    if module is None:
        return []
    return [x for x in objects if issubclass(type(x), module.Accelerator)]


def base_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """accelerate's ``AcceleratedOptimizer`` is a wrapper: the optimizer it steps."""
    return opt.optimizer if type(opt).__name__ == "AcceleratedOptimizer" else opt
