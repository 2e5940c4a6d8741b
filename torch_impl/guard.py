"""`BudgetGuard`: keep a memory budget in the user's own training step, on the user's own device.

The decisions (when to measure, tighten, loosen, fall back to `full`, the out-of-memory ladder) are
`shared_configs.planning.closed_loop`'s. This adapter measures whole optimizer steps (the allocator on
CUDA, `torch_impl.memory.step_peak` on CPU), puts plans on the model, restores a failed attempt
(`torch_impl.guard_retry`) and reads the regime the step runs in (`torch_impl.guard_model`). Several
processes agree on each judgement and plan (`agreed_peak`, `from_rank0`). Mirror: `jax_impl/guard.py`.
The rules and the measured runs: docs/guard.md.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shared_configs.planning import gpu, pipeline, whole
from shared_configs.planning.closed_loop import DEFAULT_ROUNDS, Action, ClosedLoop, GuardRecord, mib, split_options
from shared_configs.planning.pipeline import Workload
from shared_configs.progress import SILENT, say
from shared_configs.regime import Regime
from torch_impl.compat import tree_leaves
from torch_impl.diffusers_adapter import apply_plan
from torch_impl.guard_model import RegimeWatch, described, gpu_flavour, regime_seen, step_spec, take_over_checkpointing
from torch_impl.guard_retry import (
    RetryPoint,
    accelerator_of,
    agreed_peak,
    base_optimizer,
    from_rank0,
    processes,
    why_not_retry,
)
from torch_impl.pair import ControlNetPair
from torch_impl.wrappers import compiled, unwrap


class BudgetGuard:
    """Plan ``model`` for ``budget_bytes`` and keep its training step within it (module docstring).

    ``model``: what `torch_impl.guard_model.step_spec` reads, wrapped or not. ``batch_size``, ``regime``
    (default: what the model shows), ``sample_size`` and ``planner_options`` describe the step as
    `torch_impl.plan_for_budget` takes them. ``policy``: start from this plan (a resumed run's last)
    instead of planning. ``rounds``: re-plans for a measured excess before `full`. ``optimizers`` (else
    those among the step's arguments, or seen stepping the model's parameters) and ``accelerator`` (else
    the owner of `step`'s context) are what a retry restores. ``planner_log``: where re-plans' progress
    goes. Raises `shared_configs.planning.solver.Infeasible` when no plan fits at all.
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
        rounds: int = DEFAULT_ROUNDS,
        optimizers: Iterable[torch.optim.Optimizer] = (),
        accelerator: Any = None,
        planner_log: logging.Logger = SILENT,
        **planner_options: Any,
    ) -> None:
        self._step = 0
        self.model, self._compiled = unwrap(model), compiled(model)
        spec = step_spec(self.model)
        self._plan_options, workload = split_options(planner_options)
        workload.setdefault("device", gpu_flavour(self._device()))  # on CUDA: plans for what the card holds
        given = regime is not None
        if regime is None:
            regime, notes = regime_seen(self.model)
            for note in notes:
                self._say(note)
        self._workload = Workload.of(spec, sample_size, batch_size=batch_size, regime=regime, **workload)
        self._watch = RegimeWatch(self.model, given, "optimizer_impl" in planner_options)
        self._optimizer_steps = 0
        self._params = {id(p) for p in self.model.parameters()}
        self._optimizers: list[torch.optim.Optimizer] = []
        self._adopt(list(optimizers))
        self._accelerators = [] if accelerator is None else [accelerator]
        self._pending: list[dict[str, int]] = []  # this optimizer step's measured micro-steps
        self._stepped = False  # an optimizer over the model's parameters began a step (since the last look)
        self._fresh = False  # the last call ended with an optimizer step: no gradient accumulated since
        _spot_optimizers(self)
        if taken := take_over_checkpointing(self.model):
            self._say(f"{' and '.join(taken)}: its own gradient checkpointing is off; the guard's plan replaces it")
        planner = lambda budget: from_rank0(lambda: self._planned(budget))  # noqa: E731 (every rank: rank 0's plan)
        self.loop = ClosedLoop(budget_bytes, planner, self._predict, self._say, rounds=rounds, log=planner_log)
        self.budget = self.loop.budget
        self._put_on(self.loop.start(policy))

    @property
    def plan(self) -> str:
        """The policy in force."""
        return self.loop.plan

    @property
    def history(self) -> list[GuardRecord]:
        """One record per measurement, out-of-memory error or change of plan."""
        return self.loop.history

    # -- the step ------------------------------------------------------------------------------

    def run(self, step_fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``step_fn(*args, **kwargs)`` under the plan in force, measured when due; after an out-of-memory
        error, run again from the state it started from under a plan that recomputes more, or re-raised."""
        self._step += 1
        if self._stepped:  # the optimizer stepped outside ``step_fn`` since the last call
            self._fresh = True
            self._optimizer_stepped()
        self._adopt(tree_leaves((args, kwargs)))
        point = RetryPoint(self._retried_params(), self._device(), self._accelerators, self._fresh)
        while True:  # the ladder ends: under `full` the loop gives up
            self._stepped = False
            try:
                return self._attempt(step_fn, args, kwargs)
            except torch.OutOfMemoryError:
                if not self.loop.out_of_memory(self._step, why_not_retry(self._stepped)):
                    point.restore()
                    self._free()
                    raise
            # Out of the handler: the error's traceback, and the failed step's tensors it held, are gone.
            point.restore()
            self._put_on(self.loop.recompute_more(self._step))  # what the failed step left freed first

    def step(self, context: Callable[..., Any] | None = None, *context_args: Any) -> Callable[[Callable[[], Any]], Any]:
        """A decorator that runs the function at once as `run` does, inside ``context(*context_args)``
        entered afresh for each attempt (``accelerator.accumulate, unet``; docs/guard.md's recipes)."""
        if (owner := accelerator_of(context)) is not None and owner not in self._accelerators:
            self._accelerators.append(owner)  # its accumulation counter, which each entry advances

        def body(fn: Callable[[], Any]) -> Any:
            with contextlib.nullcontext() if context is None else context(*context_args):
                return fn()

        return lambda fn: self.run(body, fn)

    def _attempt(self, step_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if not self.loop.due:
            out = step_fn(*args, **kwargs)
        else:  # CPU: the step's tensors, its arguments among them (`step_peak`); CUDA: the allocator's peaks
            from torch_impl.memory import step_peak  # here: `import torch_impl` stays light

            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            with step_peak(self.model, self._optimizers, tensors) as found:
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
        if self._pending:  # CUDA: judged by what the device holds, the allocator's reserve
            found = max(self._pending, key=lambda f: f.get("reserved", f["peak"]))
            self._pending, measured = [], found.get("reserved", found["peak"])
            allocated = found["peak"] if "reserved" in found else None
            if (policy := self.loop.judge(self._step, agreed_peak(measured, self._device()), allocated)) is not None:
                self._put_on(policy)

    def _regime_differs(self) -> bool:
        """The first optimizer step shows a workload unlike the one planned (`RegimeWatch.workload`): re-planned."""
        was = self._workload
        self._workload, lines = self._watch.workload(was, self._optimizers)
        for line in lines:
            self._say(line)
        if self._workload == was:
            return False
        policy, predicted = self.loop.whole_budget()
        how = "as given" if self._watch.given else "as guessed from the model"
        self._say(
            f"the step runs in {described(self._workload)}, not in {described(was)} {how}; "
            f"re-planned for it: {policy} (predicted {mib(predicted)})"
        )
        self._put_on(self.loop.change(self._step, policy, predicted, Action.REGIME, 0))
        return True

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- the optimizers ----------------------------------------------------------------------

    def _adopt(self, leaves: list[Any]) -> None:
        """The optimizers among ``leaves`` (given, the step's arguments): the tracker counts them, a retry restores."""
        for opt in (base_optimizer(x) for x in leaves if isinstance(x, torch.optim.Optimizer)):
            if opt not in self._optimizers:
                self._optimizers.append(opt)

    def _spot(self, opt: torch.optim.Optimizer) -> None:
        """An optimizer begins a step: one over the model's parameters ends the guarded optimizer step."""
        opt = base_optimizer(opt)
        if opt in self._optimizers or any(id(p) in self._params for g in opt.param_groups for p in g["params"]):
            self._stepped = True
            self._adopt([opt])

    def _retried_params(self) -> list[nn.Parameter]:
        """The parameters whose gradients a retry restores."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        params += [p for o in self._optimizers for g in o.param_groups for p in g["params"]]
        return list({id(p): p for p in params}.values())

    # -- putting plans on ----------------------------------------------------------------------

    def _put_on(self, policy: str) -> None:
        """``policy`` on the model (a pair plan on both networks of a pair); the next steps are measured anew."""
        if isinstance(self.model, ControlNetPair):
            self.model.enable_gradient_checkpointing(policy)
        else:
            apply_plan(self.model, policy)
        if self._compiled:  # compiled code traced the old plan's forwards
            torch.compiler.reset()
        self._pending = []
        self._free()  # on CUDA the old plan's cached blocks: the next peak is the new plan's

    def _free(self) -> None:
        """What a failed step or the old plan left: unreachable tensors, CUDA's cache."""
        gc.collect()
        if self._device().type == "cuda":
            torch.cuda.empty_cache()

    # -- the planner ---------------------------------------------------------------------------

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


def _spot_optimizers(guard: BudgetGuard) -> None:
    """A hook on every optimizer's step for ``guard``'s life (`BudgetGuard._spot`); removed with it."""
    ref = weakref.ref(guard)

    def spot(opt: torch.optim.Optimizer, *_: Any) -> None:
        if (live := ref()) is not None:
            live._spot(opt)

    weakref.finalize(guard, register_optimizer_step_pre_hook(spot).remove)
