"""`BudgetGuard`: keep a memory budget in the user's own training step, on the user's own device.

A plan is exact on the step the planner profiled; the user's step holds more (text encoders, a
teacher's features, an EMA, the CUDA allocator's cache). The guard closes the loop (docs/guard.md)::

    guard = BudgetGuard(unet, 20 << 30, batch_size=4)        # plans, and puts the plan on the model
    for batch in loader:
        loss = guard.run(train_step, unet, optimizer, batch)  # the user's whole step

* **Measures** the step's peak over its first `MEASURED_STEPS` steps and the `MEASURED_STEPS` after
  every change, never otherwise. CUDA: the allocator's peak, ``max_memory_reserved`` (judged; it is
  what the device holds) beside ``max_memory_allocated``. CPU: PyTorch's ``MemTracker`` following
  the model, its optimizer(s) (among ``step_fn``'s arguments, found among live objects, or seen
  stepping the model's parameters) and the tensors among ``step_fn``'s arguments: memory the step holds beyond them
  (made inside the step) is seen, tensors alive before it and out of its reach are not.
* **Over budget** (measured > budget): re-plans for ``budget - (measured - predicted)``, the budget
  less what the step holds beyond the model's step; the plan is on before the next step; one line.
* **Far under budget**: once, after the first window, if no step went over budget or out of memory,
  the window's peak is more than `LOOSEN_BELOW` under the budget and the plan recomputes something,
  re-plans for the same ``budget - (measured - predicted)``, taken only if it recomputes less.
* **Out of memory** in ``step_fn``: frees what the failed step left (gradients set to None, the
  CUDA cache emptied), moves to a plan that recomputes more (planned halfway between the failed
  plan's predicted peak and `full`'s, at most `OOM_HALVINGS` times a step, then `full`) and runs
  the same step again: same arguments, torch's random generators restored. Under `full` it says so
  in one line and re-raises. ``step_fn`` must therefore be retryable up to its optimizer step.

Cost (this 2-core CPU, one thread, medians of 5 interleaved steps; docs/guard.md): an unmeasured
guarded step is the plain step (0.99x-1.01x: a counter, torch's RNG state kept for a retry); a
measured CPU step, under ``MemTracker``'s per-op bookkeeping, takes 6x a plain one on sd_narrow
32x32 batch 8 (4.8 s against 0.79 s) and 30x on the tiny U-Net, whose ops are tiny; on CUDA
measuring is two counter reads and a reset. A run with one change measures 4 steps. A re-plan takes
seconds to tens of seconds (the planner's fake-tensor check in a worker process; the profile is cached).
"""

from __future__ import annotations

import contextlib
import gc
import io
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_leaves

from shared_configs.pair import ControlNetPairSpec
from shared_configs.planning import planner
from shared_configs.planning.planner import Workload
from shared_configs.regime import DEFAULT as DEFAULT_REGIME
from shared_configs.regime import Regime
from shared_configs.spec import SpecError, UNetSpec
from shared_configs.units import MIB
from torch_impl.diffusers_plan import apply_plan, diffusers_spec
from torch_impl.pair import ControlNetPair
from torch_impl.unet import UNet

MEASURED_STEPS = 2  # steps measured at the start and after every change (the first one makes AdamW's state)
LOOSEN_BELOW = 0.10  # loosen once when the first window's peak is this fraction or more under the budget
OOM_HALVINGS = 2  # plans tried between one that ran out of memory and `full`, per step
FULL, NONE = "full", "none"
_PLAN_OPTIONS = ("world_size", "distributed", "candidates", "rounds")  # `planner.plan`'s; the rest: `Workload`'s


@dataclass(frozen=True)
class GuardRecord:
    """One measurement or one change: a measurement has ``measured``; a change (``action``
    "planned", "given", "tightened", "loosened", "recompute more") has the new plan and its prediction, and
    as ``outside`` the bytes it was planned to leave for the rest of the step."""

    step: int  # the guarded step (1 = the first `BudgetGuard.run`; 0: construction)
    plan: str  # the policy measured, or put on
    predicted: int  # the planner's peak of ``plan`` for the model's own step (bytes)
    measured: int | None  # the step's peak (CUDA: max reserved; CPU: MemTracker); None for a change
    outside: int | None  # bytes the step held beyond the model's step (measured - predicted)
    action: str  # "measured", "over budget", "out of memory", "full failed", or a change's
    allocated: int | None = None  # CUDA only: max_memory_allocated over the step


class BudgetGuard:
    """Plan ``model`` for ``budget_bytes`` and keep its training step within it (module docstring).

    ``model``: a `torch_impl.UNet` or diffusers' ``UNet2DConditionModel`` / ``UNet2DModel`` (the
    U-Net itself; ``step_fn`` may call it through a wrapper), or a `torch_impl.ControlNetPair`
    (the ControlNet step: planned as the pair's workload, pair plans put on both networks). ``batch_size``, ``regime``
    (`shared_configs.regime.Regime`; default fp32 AdamW), ``sample_size`` and ``planner_options``
    (``context_length``, ``world_size``, ``distributed``, ``candidates``, ...) describe the step
    to the planner as `torch_impl.plan_for_budget` takes them; the model is not changed by them.
    ``policy``: start from this plan instead of planning (a resumed run's last plan, or one its
    preamble already made); it is measured and corrected like a planned one.
    Raises `shared_configs.planning.solver.Infeasible` when no plan fits the budget at all.
    """

    def __init__(
        self,
        model: nn.Module,
        budget_bytes: int,
        *,
        batch_size: int,
        regime: Regime | None = None,
        sample_size: int | None = None,
        policy: str | None = None,
        **planner_options: Any,
    ) -> None:
        spec = _step_spec(model)
        self.model, self.budget = model, int(budget_bytes)
        self._plan_options = {k: v for k, v in planner_options.items() if k in _PLAN_OPTIONS}
        workload = {k: v for k, v in planner_options.items() if k not in _PLAN_OPTIONS}
        regime = regime or DEFAULT_REGIME
        self._workload = Workload.of(spec, sample_size, batch_size=batch_size, regime=regime, **workload)
        self.history: list[GuardRecord] = []
        self.plan, self._predicted = NONE, 0
        self._step, self._left, self._window = 0, 0, []  # measured steps left, their peaks
        self._may_loosen = True
        self._optimizers: list[torch.optim.Optimizer] = []
        self._scanned = False  # live objects searched for the model's optimizers (`_find_optimizers`)
        if policy is not None:  # a plan already made for this step (a resumed run's last one): predicted only
            self._switch(policy, self._predict(policy), "given", None)
            return
        planned = planner.plan(self._workload, self.budget, "torch", **self._plan_options)
        self._switch(planned.policy, planned.solution.prediction.peak_bytes, "planned", 0)

    # -- the step ------------------------------------------------------------------------------

    def run(self, step_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``step_fn(*args, **kwargs)`` under the plan in force; returns what it returns. Measured
        when due; after an out-of-memory error, run again under a plan that recomputes more."""
        self._step += 1
        rng = _rng_state(self._device())
        for rung in range(OOM_HALVINGS + 2):  # the halvings, `full`, and the failure under `full`
            try:
                return self._attempt(step_fn, args, kwargs)
            except torch.OutOfMemoryError:
                if self.plan == FULL:
                    self._failed_under_full()
                    self._free()
                    raise
            # Out of the handler: the error's traceback, and the failed step's tensors it held, are gone.
            self._free()
            self._recompute_more(rung)
            _set_rng_state(self._device(), rng)
        raise AssertionError("unreachable: the last rung is `full`, which re-raises")

    def _attempt(self, step_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self._left <= 0:
            return step_fn(*args, **kwargs)
        with self._measured(args, kwargs) as found:
            out = step_fn(*args, **kwargs)
        self._judge(found)
        return out

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- measuring -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _measured(self, args: tuple, kwargs: dict) -> Iterator[dict[str, int]]:
        """The step's peak bytes in the block: ``found["measured"]`` (and CUDA's ``allocated``)."""
        found: dict[str, int] = {}
        device = self._device()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            yield found
            found["measured"] = torch.cuda.max_memory_reserved(device)
            found["allocated"] = torch.cuda.max_memory_allocated(device)
            return
        from torch_impl.memory import memtracker  # here: `import torch_impl` stays light

        leaves = tree_leaves((args, kwargs))
        self._find_optimizers(leaves)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        eager = torch.compiler.set_stance("force_eager")
        with self._spotting_optimizers(), eager, memtracker(self.model, self._optimizers, tensors) as tracked:
            yield found
        found["measured"] = tracked["peak"]

    def _find_optimizers(self, leaves: list[Any]) -> None:
        """The optimizers whose state the tracker counts: those among ``step_fn``'s arguments, and
        at the first measurement those over the model's parameters among all live objects (one
        scan of the garbage collector's objects: an optimizer in ``step_fn``'s closure)."""
        found = [x for x in leaves if isinstance(x, torch.optim.Optimizer)]
        if not self._scanned:
            self._scanned = True
            # type(), not isinstance: some live objects warn when their __class__ is read (torch.distributed.reduce_op)
            live = (x for x in gc.get_objects() if issubclass(type(x), torch.optim.Optimizer))
            found += [x for x in live if self._steps_model(x)]
        self._optimizers += [x for x in found if x not in self._optimizers]

    def _steps_model(self, opt: torch.optim.Optimizer) -> bool:
        params = {id(p) for p in self.model.parameters()}
        return any(id(p) in params for g in opt.param_groups for p in g["params"])

    @contextlib.contextmanager
    def _spotting_optimizers(self) -> Iterator[None]:
        """Note each optimizer that steps the model's parameters (one made after the scan): the
        next measurement counts its state."""

        def spot(opt: torch.optim.Optimizer, *_: Any) -> None:
            if opt not in self._optimizers and self._steps_model(opt):
                self._optimizers.append(opt)

        handle = register_optimizer_step_pre_hook(spot)
        try:
            yield
        finally:
            handle.remove()

    def _judge(self, found: dict[str, int]) -> None:
        """Record a measurement; tighten when over budget, loosen once when far under (module docstring)."""
        measured = found["measured"]
        outside = measured - self._predicted
        over = measured > self.budget
        action = "over budget" if over else "measured"
        self.history.append(
            GuardRecord(self._step, self.plan, self._predicted, measured, outside, action, found.get("allocated"))
        )
        self._left -= 1
        self._window.append(measured)
        if over:
            self._may_loosen = False
            self._tighten(measured, outside)
        elif self._left == 0 and self._may_loosen:
            self._may_loosen = False
            if max(self._window) < self.budget * (1 - LOOSEN_BELOW) and self.plan != NONE:
                self._loosen(max(self._window) - self._predicted)

    # -- changing plans ------------------------------------------------------------------------

    def _tighten(self, measured: int, outside: int) -> None:
        target = self.budget - outside
        found = self._plan_for(target)
        if found is None and self.plan == FULL:
            self._say(f"peaked at {_mib(measured)}, over the {_mib(self.budget)} budget, under {FULL}: nothing "
                      f"recomputes more ({_mib(outside)} held outside the model's step)")  # fmt: skip
            self._left = 0
            return
        policy, predicted = found or (FULL, self._predict(FULL))
        how = f"planned for {_mib(target)}" if found else f"no plan fits {_mib(target)}: {FULL}"
        self._say(f"peaked at {_mib(measured)}, over the {_mib(self.budget)} budget (predicted "
                  f"{_mib(self._predicted)}, {_mib(outside)} held outside the model's step); {how}: "
                  f"{policy} (predicted {_mib(predicted)})")  # fmt: skip
        self._switch(policy, predicted, "tightened", outside)

    def _loosen(self, outside: int) -> None:
        target = self.budget - outside
        found = self._plan_for(target)
        if found is None or found[1] <= self._predicted:
            return  # nothing faster fits
        policy, predicted = found
        self._say(f"peaked at {_mib(self._predicted + outside)}, over {100 * LOOSEN_BELOW:.0f}% under the "
                  f"{_mib(self.budget)} budget; planned for {_mib(target)}: {policy} (predicted "
                  f"{_mib(predicted)}, recomputes less)")  # fmt: skip
        self._switch(policy, predicted, "loosened", outside)

    def _recompute_more(self, rung: int) -> None:
        """After an out-of-memory error: halfway to `full`'s predicted peak, or `full`."""
        self._may_loosen = False
        failed, full = self.plan, self._predict(FULL)
        self.history.append(GuardRecord(self._step, failed, self._predicted, None, None, "out of memory"))
        found = self._plan_for((self._predicted + full) // 2) if rung < OOM_HALVINGS else None
        if found is None or found[1] >= self._predicted:
            found = (FULL, full)
        self._say(f"ran out of memory under {failed} (predicted {_mib(self._predicted)}); running it again "
                  f"under {found[0]} (predicted {_mib(found[1])})")  # fmt: skip
        self._switch(*found, "recompute more", None)

    def _failed_under_full(self) -> None:
        self.history.append(GuardRecord(self._step, FULL, self._predicted, None, None, "full failed"))
        self._say(f"ran out of memory under {FULL} (predicted {_mib(self._predicted)}), which recomputes "
                  "the most: the step does not fit this device; re-raising")  # fmt: skip

    def _switch(self, policy: str, predicted: int, action: str, outside: int | None) -> None:
        """Put ``policy`` on the model; measure the next `MEASURED_STEPS` steps."""
        _apply(self.model, policy)
        self.plan, self._predicted = policy, predicted
        self._left, self._window = MEASURED_STEPS, []
        if self._device().type == "cuda":
            torch.cuda.empty_cache()  # the old plan's cached blocks: the next peak is the new plan's
        self.history.append(GuardRecord(self._step, policy, predicted, None, outside, action))

    def _free(self) -> None:
        """What a failed step left: the model's gradients, unreachable tensors, CUDA's cache."""
        for p in self.model.parameters():
            p.grad = None
        gc.collect()
        if self._device().type == "cuda":
            torch.cuda.empty_cache()

    # -- the planner ---------------------------------------------------------------------------

    def _plan_for(self, budget: int) -> tuple[str, int] | None:
        """The planner's plan for ``budget`` and its predicted peak; None if no plan fits (or none
        passes the planner's check: `shared_configs.planning.planner.fit_checked`). Its
        progress lines are kept off stderr (the profile is cached): the guard says one line."""
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                planned = planner.plan(self._workload, budget, "torch", **self._plan_options)
        except SpecError:  # `Infeasible`, or no plan checked under the budget
            return None
        return planned.policy, planned.solution.prediction.peak_bytes

    def _predict(self, policy: str) -> int:
        options = {k: v for k, v in self._plan_options.items() if k in ("world_size", "distributed")}
        return planner.predict_policy(self._workload, policy, "torch", **options)[0].prediction.peak_bytes

    def _say(self, message: str) -> None:
        print(f"guard: step {self._step}: {message}", file=sys.stderr, flush=True)


def _step_spec(model: nn.Module) -> UNetSpec | ControlNetPairSpec:
    """What the planner plans for ``model``'s step: a U-Net's spec, or a ControlNet pair's."""
    if isinstance(model, ControlNetPair):
        return model.pair_spec
    return model.spec if isinstance(model, UNet) else diffusers_spec(model)


def _apply(model: nn.Module, policy: str) -> None:
    """Put ``policy`` on ``model``: a pair plan on both networks of a pair, else `apply_plan`."""
    if isinstance(model, ControlNetPair):
        model.enable_gradient_checkpointing(policy)
    else:
        apply_plan(model, policy)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch's CPU generator, and the device's on CUDA: a retried step draws the same numbers."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"
