"""`BudgetGuard`: keep a memory budget in the user's own training step, on the user's own device.

The guard plans, measures the step's peak over whole optimizer steps, re-plans for ``budget -
(measured - predicted)`` when over, loosens once when far under, and after an out-of-memory error
runs the micro-step again under a plan that recomputes more (`torch_impl.guard_retry`). What it reads
from the model: `torch_impl.guard_model`. Several processes agree on each judgement and plan
(`agreed_peak`, `from_rank0`). Mirror: `jax_impl/guard.py`. The rules and the measured runs: docs/guard.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_leaves

from shared_configs.planning import gpu, pipeline, whole
from shared_configs.planning.pipeline import Workload
from shared_configs.progress import say
from shared_configs.regime import Regime
from shared_configs.sizes import MIB
from shared_configs.spec import SpecError
from torch_impl.diffusers_adapter import apply_plan
from torch_impl.guard_model import RegimeWatch, gpu_flavour, regime_seen, step_spec, take_over_checkpointing
from torch_impl.guard_retry import RetryPoint, accelerators_among, base_optimizer, processes, why_not_retry
from torch_impl.pair import ControlNetPair
from torch_impl.wrappers import compiled, unwrap

MEASURED_STEPS = 2  # steps measured at the start and after every change (the first one makes AdamW's state)
LOOSEN_BELOW = 0.10  # loosen once when the first window's peak is this fraction or more under the budget
REPLAN_MARGIN = 0.02  # of the budget, left by a re-plan: two plans' predictions err by different amounts
OOM_HALVINGS = 2  # plans tried between one that ran out of memory and `full`, per step
FULL, NONE = "full", "none"
_PLAN_OPTIONS = ("world_size", "distributed", "candidates", "rounds")  # `pipeline.plan`'s; the rest: `Workload`'s
T = TypeVar("T")


@dataclass(frozen=True)
class GuardRecord:
    """One measurement (``measured`` set) or one change of plan (``outside``: the bytes it leaves for the rest)."""

    step: int  # the guarded step (1 = the first `BudgetGuard.run`; 0: construction)
    plan: str  # the policy measured, or put on
    predicted: int  # the planner's peak of ``plan`` for the model's own step (bytes; on CUDA as reserved)
    measured: int | None  # the step's peak (CUDA: max reserved; CPU: step_peak); None for a change
    outside: int | None  # bytes the step held beyond the model's step (measured - predicted)
    action: str  # "measured", "over budget", "out of memory", "full failed", "not retried", or a change:
    # "planned", "given", "tightened", "loosened", "recompute more", "regime"
    allocated: int | None = None  # CUDA only: max_memory_allocated over the step


class BudgetGuard:
    """Plan ``model`` for ``budget_bytes`` and keep its training step within it (module docstring).

    ``model``: what `torch_impl.guard_model.step_spec` reads, wrapped or not. ``batch_size``, ``regime``
    (default: what the model shows), ``sample_size`` and ``planner_options`` describe the step as
    `torch_impl.plan_for_budget` takes them. ``policy``: start from this plan (a resumed run's last)
    instead of planning. Raises `shared_configs.planning.solver.Infeasible` when no plan fits at all.
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
        self._step = 0
        self.model, self.budget = unwrap(model), int(budget_bytes)
        self._compiled = compiled(model)
        spec = step_spec(self.model)
        self._plan_options = {k: v for k, v in planner_options.items() if k in _PLAN_OPTIONS}
        workload = {k: v for k, v in planner_options.items() if k not in _PLAN_OPTIONS}
        workload.setdefault("device", gpu_flavour(self._device()))  # on CUDA: plans for what the card holds
        self._regime_given, self._watch, self._optimizer_steps = regime is not None, RegimeWatch(self.model), 0
        self._impl_given = "optimizer_impl" in planner_options
        if regime is None:
            regime, notes = regime_seen(self.model)
            for note in notes:
                self._say(note)
        self._workload = Workload.of(spec, sample_size, batch_size=batch_size, regime=regime, **workload)
        self.history: list[GuardRecord] = []
        self.plan, self._predicted = NONE, 0
        self._left, self._window, self._pending = 0, [], []  # optimizer steps to measure; their peaks; this one's
        self._may_loosen = True
        self._params = {id(p) for p in self.model.parameters()}
        self._optimizers: list[torch.optim.Optimizer] = []
        self._accelerators: list[Any] = []
        self._scanned = False  # live objects searched for the model's optimizers and accelerate's Accelerator
        self._stepped = False  # an optimizer over the model's parameters began a step (since the last look)
        self._fresh = False  # the last call ended with an optimizer step: no gradient accumulated since
        _spot_optimizers(self)
        if taken := take_over_checkpointing(self.model):
            self._say(f"{' and '.join(taken)}: its own gradient checkpointing is off; the guard's plan replaces it")
        if policy is not None:  # a plan already made for this step (a resumed run's last one): predicted only
            self._switch(policy, self._predict(policy), "given", None)
            return
        policy, predicted = from_rank0(lambda: self._planned(self.budget))  # every rank puts on rank 0's plan
        self._switch(policy, predicted, "planned", 0)

    # -- the step ------------------------------------------------------------------------------

    def run(self, step_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``step_fn(*args, **kwargs)`` under the plan in force, measured when due; after an out-of-memory
        error, run again from the state it started from under a plan that recomputes more, or re-raised."""
        self._step += 1
        if self._stepped:  # the optimizer stepped outside ``step_fn`` since the last call
            self._fresh = True
            self._optimizer_stepped()
        self._find_optimizers(tree_leaves((args, kwargs)))
        point = RetryPoint(self._retried_params(), self._device(), self._accelerators, self._fresh)
        for rung in range(OOM_HALVINGS + 2):  # the halvings, `full`, and the failure under `full`
            self._stepped = False
            try:
                return self._attempt(step_fn, args, kwargs)
            except torch.OutOfMemoryError:
                why = why_not_retry(self._stepped)
                if self.plan == FULL or why:
                    self._cannot_retry(why)
                    point.restore()
                    self._free()
                    raise
            # Out of the handler: the error's traceback, and the failed step's tensors it held, are gone.
            point.restore()
            self._free()
            self._recompute_more(rung)
        raise AssertionError("unreachable: the last rung is `full`, which re-raises")

    def step(self, context: Callable[..., Any] | None = None, *context_args: Any) -> Callable[[Callable[[], Any]], Any]:
        """A decorator that runs the function at once as `run` does, inside ``context(*context_args)``
        entered afresh for each attempt (``accelerator.accumulate, unet``; docs/guard.md's recipes)."""

        def body(fn: Callable[[], Any]) -> Any:
            with contextlib.nullcontext() if context is None else context(*context_args):
                return fn()

        return lambda fn: self.run(body, fn)

    def _attempt(self, step_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self._left <= 0:
            out = step_fn(*args, **kwargs)
        else:
            with self._measured(args, kwargs) as found:
                out = step_fn(*args, **kwargs)
            self._pending.append(found)
        self._fresh = self._stepped  # else the next micro-step accumulates into this one's gradients
        if self._stepped:
            self._optimizer_stepped()
        return out

    def _optimizer_stepped(self) -> None:
        """One optimizer step ended: judge the peak over its measured micro-steps (after the first, its regime)."""
        self._stepped = False
        self._optimizer_steps += 1
        if self._optimizer_steps == 1 and self._regime_differs():
            return
        if self._pending:
            found = max(self._pending, key=lambda f: f["measured"])
            self._pending = []
            self._judge({**found, "measured": agreed_peak(found["measured"], self._device())})

    def _regime_differs(self) -> bool:
        """A regime the first optimizer step shows unlike the one planned: a guessed one is replaced and re-planned;
        on a GPU also the update the optimizer runs (`RegimeWatch.update`), unless ``optimizer_impl`` given."""
        planned = self._workload.regime
        if not self._watch.forwarded:
            return False
        seen, notes = self._watch.seen(planned, self._optimizers)
        if self._regime_given:
            if seen != planned:
                self._say(
                    f"the step runs in {seen.describe()}, not in the regime given ({planned.describe()}); "
                    "planned for the one given"
                )
            seen, notes = planned, []
        impl = self._workload.optimizer_impl
        if self._workload.device != "cpu" and not self._impl_given:  # on a GPU: the update as the optimizer says
            impl = self._watch.update(self._optimizers, seen.optimizer)
        if (seen, impl) == (planned, self._workload.optimizer_impl):
            return False
        for note in notes:
            self._say(note)
        was = _described(planned, self._workload.optimizer_impl)
        self._workload = dataclasses.replace(self._workload, regime=seen, optimizer_impl=impl)
        policy, predicted = self._plan_for(self.budget) or (FULL, self._predict(FULL))
        how = "as given" if self._regime_given else "as guessed from the model"
        self._say(
            f"the step runs in {_described(seen, impl)}, not in {was} {how}; "
            f"re-planned for it: {policy} (predicted {_mib(predicted)})"
        )
        self._switch(policy, predicted, "regime", 0)
        return True

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- measuring -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _measured(self, args: tuple, kwargs: dict) -> Iterator[dict[str, int]]:
        """The step's peak bytes in the block: ``found["measured"]`` (and CUDA's ``allocated``)."""
        from torch_impl.memory import step_peak  # here: `import torch_impl` stays light

        found: dict[str, int] = {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        with step_peak(self.model, self._optimizers, tensors) as tracked:
            yield found
        if "reserved" in tracked:  # CUDA: judged by what the device holds, the allocator's reserve
            found.update(measured=tracked["reserved"], allocated=tracked["peak"])
        else:
            found["measured"] = tracked["peak"]

    def _find_optimizers(self, leaves: list[Any]) -> None:
        """The optimizers the tracker counts and a retry restores: among ``step_fn``'s arguments, at the
        first call among all live objects (an optimizer in a closure; accelerate's ``Accelerator`` too)."""
        found = [base_optimizer(x) for x in leaves if isinstance(x, torch.optim.Optimizer)]
        if not self._scanned:
            self._scanned = True
            # type(), not isinstance: some live objects warn when their __class__ is read (torch.distributed.reduce_op)
            objects = gc.get_objects()
            live = [x for x in objects if issubclass(type(x), torch.optim.Optimizer)]
            found += [base_optimizer(x) for x in live if self._steps_model(x)]
            self._accelerators = accelerators_among(objects)
        self._optimizers += [x for x in dict.fromkeys(found) if x not in self._optimizers]

    def _steps_model(self, opt: torch.optim.Optimizer) -> bool:
        return any(id(p) in self._params for g in opt.param_groups for p in g["params"])

    def _spot(self, opt: torch.optim.Optimizer) -> None:
        opt = base_optimizer(opt)
        if opt in self._optimizers or self._steps_model(opt):
            self._stepped = True
            if opt not in self._optimizers:
                self._optimizers.append(opt)

    def _retried_params(self) -> list[nn.Parameter]:
        """The parameters whose gradients a retry restores."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        params += [p for o in self._optimizers for g in o.param_groups for p in g["params"]]
        return list({id(p): p for p in params}.values())

    def _judge(self, found: dict[str, int]) -> None:
        """Record a measurement; tighten when over budget, loosen once when far under."""
        measured = found["measured"]
        outside, over = measured - self._predicted, measured > self.budget
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
        target = round(self.budget * (1 - REPLAN_MARGIN)) - outside
        found = self._plan_for(target)
        if found is None and self.plan == FULL:
            self._say(
                f"peaked at {_mib(measured)}, over the {_mib(self.budget)} budget, under {FULL}: nothing "
                f"recomputes more ({_mib(outside)} held outside the model's step)"
            )
            self._left = 0
            return
        policy, predicted = found or (FULL, self._predict(FULL))
        how = f"planned for {_mib(target)}" if found else f"no plan fits {_mib(target)}: {FULL}"
        self._say(
            f"peaked at {_mib(measured)}, over the {_mib(self.budget)} budget (predicted "
            f"{_mib(self._predicted)}, {_mib(outside)} held outside the model's step); {how}: "
            f"{policy} (predicted {_mib(predicted)})"
        )
        self._switch(policy, predicted, "tightened", outside)

    def _loosen(self, outside: int) -> None:
        target = round(self.budget * (1 - REPLAN_MARGIN)) - outside
        found = self._plan_for(target)
        if found is None or found[1] <= self._predicted:
            return  # nothing faster fits
        policy, predicted = found
        self._say(
            f"peaked at {_mib(self._predicted + outside)}, over {100 * LOOSEN_BELOW:.0f}% under the "
            f"{_mib(self.budget)} budget; planned for {_mib(target)}: {policy} (predicted "
            f"{_mib(predicted)}, recomputes less)"
        )
        self._switch(policy, predicted, "loosened", outside)

    def _recompute_more(self, rung: int) -> None:
        """After an out-of-memory error: halfway to `full`'s predicted peak, or `full`."""
        self._may_loosen = False
        failed, full = self.plan, self._predict(FULL)
        self.history.append(GuardRecord(self._step, failed, self._predicted, None, None, "out of memory"))
        found = self._plan_for((self._predicted + full) // 2) if rung < OOM_HALVINGS else None
        if found is None or found[1] >= self._predicted:
            found = (FULL, full)
        self._say(
            f"ran out of memory under {failed} (predicted {_mib(self._predicted)}); running it again "
            f"under {found[0]} (predicted {_mib(found[1])})"
        )
        self._switch(*found, "recompute more", None)

    def _cannot_retry(self, why: str | None) -> None:
        if why is None:
            self.history.append(GuardRecord(self._step, FULL, self._predicted, None, None, "full failed"))
            self._say(
                f"ran out of memory under {FULL} (predicted {_mib(self._predicted)}), which recomputes "
                "the most: the step does not fit this device; re-raising"
            )
            return
        self.history.append(GuardRecord(self._step, self.plan, self._predicted, None, None, "not retried"))
        self._say(f"ran out of memory under {self.plan}; not run again: {why}; re-raising")

    def _switch(self, policy: str, predicted: int, action: str, outside: int | None) -> None:
        """Put ``policy`` on the model (a pair plan on both networks of a pair); measure the next steps."""
        if isinstance(self.model, ControlNetPair):
            self.model.enable_gradient_checkpointing(policy)
        else:
            apply_plan(self.model, policy)
        if self._compiled:  # compiled code traced the old plan's forwards
            torch.compiler.reset()
        self.plan, self._predicted = policy, predicted
        self._left, self._window, self._pending = MEASURED_STEPS, [], []
        if self._device().type == "cuda":
            torch.cuda.empty_cache()  # the old plan's cached blocks: the next peak is the new plan's
        self.history.append(GuardRecord(self._step, policy, predicted, None, outside, action))

    def _free(self) -> None:
        """What a failed step left (its gradients restored already): unreachable tensors, CUDA's cache."""
        gc.collect()
        if self._device().type == "cuda":
            torch.cuda.empty_cache()

    # -- the planner ---------------------------------------------------------------------------

    def _plan_for(self, budget: int) -> tuple[str, int] | None:
        return from_rank0(lambda: self._plan_here(budget))  # every rank puts on rank 0's plan

    def _plan_here(self, budget: int) -> tuple[str, int] | None:
        """The planner's plan for ``budget`` and its peak, None if none fits; its progress lines kept off stderr."""
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                return self._planned(budget)
        except SpecError:  # `Infeasible`, or no plan checked under the budget
            return None

    def _planned(self, budget: int) -> tuple[str, int]:
        # A GPU flavour's budget is the card's, the CUDA context in it; the guard's is the allocator's reserve.
        context = 0 if self._workload.device == "cpu" else whole.card(self._workload).context
        planned = pipeline.plan(self._workload, budget + context, "torch", **self._plan_options)
        return planned.policy, self._reserved(planned.solution.prediction.peak_bytes)

    def _predict(self, policy: str) -> int:
        options = {k: v for k, v in self._plan_options.items() if k in ("world_size", "distributed")}
        found = from_rank0(lambda: pipeline.predict_policy(self._workload, policy, "torch", **options))
        return self._reserved(found[0].prediction.peak_bytes)

    def _reserved(self, allocated: int) -> int:
        """A predicted peak as the guard judges it: on a GPU flavour, the allocator's reserve (`gpu.FRAGMENTATION`)."""
        return allocated if self._workload.device == "cpu" else round(allocated * gpu.FRAGMENTATION)

    def _say(self, message: str) -> None:
        rank = f"rank {torch.distributed.get_rank()}: " if processes() > 1 else ""
        say(f"guard: {rank}step {self._step}: {message}")  # through logging when it is on


def _described(regime: Regime, impl: str | None) -> str:
    return regime.describe() + (f" ({impl} update)" if impl else "")


def _spot_optimizers(guard: BudgetGuard) -> None:
    """A hook on every optimizer's step for ``guard``'s life (`BudgetGuard._spot`); removed with it."""
    ref = weakref.ref(guard)

    def spot(opt: torch.optim.Optimizer, *_: Any) -> None:
        if (live := ref()) is not None:
            live._spot(opt)

    weakref.finalize(guard, register_optimizer_step_pre_hook(spot).remove)


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


def _mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"
