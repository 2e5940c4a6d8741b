"""`BudgetGuard`: keep a memory budget in the user's own training step, on the user's own device.

The decisions (when to measure, tighten, loosen, fall back to `full`, the out-of-memory ladder) are
`shared_configs.planning.closed_loop`'s. This adapter measures whole optimizer steps (the allocator on
CUDA, `torch_impl.memory.step_peak` on CPU, with what the script holds beside the step), puts plans on
the model, replays a failed attempt's accumulation window (`torch_impl.guard_retry`) and reads the regime
the step runs in (`torch_impl.guard_model`). Several processes agree on each retry, judgement and plan
(`agree`, the all-reduce of `current_comm`, `from_rank0`). Mirror: `jax_impl/guard.py`.
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
from shared_configs.planning.closed_loop import DEFAULT_ROUNDS, ClosedLoop, GuardRecord, Vote, split_options
from shared_configs.planning.pipeline import Workload
from shared_configs.progress import SILENT, say
from shared_configs.regime import Regime
from torch_impl import memory
from torch_impl.checkpoint_io import current_comm
from torch_impl.compat import tree_leaves
from torch_impl.diffusers_adapter import apply_plan
from torch_impl.guard_model import (
    HeldWatch,
    RegimeWatch,
    described,
    gpu_flavour,
    regime_seen,
    step_spec,
    take_over_checkpointing,
)
from torch_impl.guard_retry import PeerOutOfMemory, Window, agree, base_optimizer, from_rank0, go_on
from torch_impl.pair import ControlNetPair
from torch_impl.wrappers import compiled, sharding, unwrap


class BudgetGuard:
    """Plan ``model`` for ``budget_bytes`` and keep its training step within it (module docstring).

    ``model``: what `torch_impl.guard_model.step_spec` reads, wrapped or not. ``batch_size``, ``regime``
    (default: what the model shows), ``sample_size`` and ``planner_options`` describe the step as
    `torch_impl.plan_for_budget` takes them. ``policy``: start from this plan (a resumed run's last)
    instead of planning. ``rounds``: re-plans for a measured excess before `full`. ``optimizers`` (else
    those among the step's arguments, or seen stepping the model's parameters) and ``accelerator`` (else
    the owner of `step`'s context) are what a retry restores. ``holds``: modules and tensors the script
    keeps on the device that the step does not read (a teacher, a cache), counted in the plan and the
    measurement (an EMA updated after the step is found). ``planner_log``: where re-plans' progress goes.
    A model ``fully_shard``-ed by FSDP2 is planned per rank (``distributed="fsdp"``, its mesh's size), unless
    given. Raises `shared_configs.planning.solver.Infeasible` when no plan fits at all.
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
        holds: Iterable[nn.Module | torch.Tensor] = (),
        planner_log: logging.Logger = SILENT,
        **planner_options: Any,
    ) -> None:
        self._step = 0
        self._comm = current_comm(host=True)  # the ranks' retries, judgements and EMA found agreed through it
        self.model, self._compiled = unwrap(model), compiled(model)
        self._plan_options, workload = split_options(sharding(self.model) | planner_options)
        workload.setdefault("device", gpu_flavour(self._device()))  # on CUDA: plans for what the card holds
        given = regime is not None
        if regime is None:
            regime, notes = regime_seen(self.model)
            self._say(*notes)
        self._workload = Workload.of(
            step_spec(self.model), sample_size, batch_size=batch_size, regime=regime, **workload
        )
        self._watch = RegimeWatch(self.model, given, "optimizer_impl" in planner_options)
        self._optimizer_steps = 0
        self._params = {id(p) for p in self.model.parameters()}
        self._optimizers: list[torch.optim.Optimizer] = []
        self._adopt(list(optimizers))
        self._window = Window([] if accelerator is None else [accelerator])
        self._holds = [t for h in holds for t in ([*h.parameters(), *h.buffers()] if isinstance(h, nn.Module) else [h])]
        self._held_bytes = memory.storage_bytes(self._holds)
        self._ema: list[weakref.ref[torch.Tensor]] = []  # what `HeldWatch` found held beside the step
        self._gap: weakref.finalize | None = None  # ends the gap's `HeldWatch`, also when the guard is collected
        # this optimizer step's measured micro-steps: their peaks (CUDA: the allocator's reserve, what the device
        # holds) and, on CUDA, the allocated peaks beside them
        self._pending: list[tuple[int, int | None]] = []
        self._stepped = False  # an optimizer over the model's parameters began a step (since the last look)
        # every optimizer's step, for the guard's life: a weak reference, so that the hook keeps no guard alive
        spot = weakref.WeakMethod(self._spot)
        hook = register_optimizer_step_pre_hook(lambda opt, *_: None if spot() is None else spot()(opt))
        weakref.finalize(self, hook.remove)
        if taken := take_over_checkpointing(self.model):
            self._say(f"{' and '.join(taken)}: its own gradient checkpointing is off; the guard's plan replaces it")
        self.loop = ClosedLoop(
            budget_bytes,
            lambda budget: from_rank0(lambda: self._planned(budget)),  # every rank: rank 0's plan
            self._predict,
            self._say,
            rounds=rounds,
            log=planner_log,
        )
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
        error (on any rank), its accumulation window replayed from its start under a plan that recomputes
        more, or re-raised."""
        self._step += 1
        if self._gap is not None:
            self._gap_ended()
        if self._stepped:  # the optimizer stepped outside ``step_fn`` since the last call
            self._optimizer_stepped()
        self._adopt(tree_leaves((args, kwargs)))
        # what a retry restores: the gradients of the model's trained parameters and of its optimizers'
        params = [p for p in self.model.parameters() if p.requires_grad]
        params = list(
            dict.fromkeys(params + [p for o in self._optimizers for g in o.param_groups for p in g["params"]])
        )
        self._window.enter(step_fn, args, kwargs, params)
        replay = False
        while True:  # the ladder ends: under `full` the loop gives up (an attempt that stepped is not retried)
            try:
                if replay:
                    self._window.replay()
                return self._attempt(step_fn, args, kwargs)
            except torch.OutOfMemoryError as err:  # every rank votes once (`agree`), here or where it learns
                failed = Vote.REFUSE if self._stepped else Vote.RETRY
                vote, by = (err.vote, err.rank) if isinstance(err, PeerOutOfMemory) else agree(failed, self._comm)
                who = "" if by == self._comm.rank else f"rank {by} "
                began = f"{'its' if who else 'the'} optimizer step had begun (some weights may be updated already)"
                if not self.loop.out_of_memory(self._step, None if vote == Vote.RETRY else began, who=who):
                    self._window.rewind(params)
                    self._free()
                    raise
            # Out of the handler: the error's traceback, and the failed step's tensors it held, are gone.
            self._window.rewind(params)
            self._put_on(self.loop.recompute_more(self._step, who))  # what the failed step left freed first
            replay = True

    def step(self, context: Callable[..., Any] | None = None, *context_args: Any) -> Callable[[Callable[[], Any]], Any]:
        """A decorator that runs the function at once as `run` does, inside ``context(*context_args)``
        entered afresh for each attempt (``accelerator.accumulate, unet``; docs/guard.md's recipes)."""
        owner = getattr(context, "__self__", None)  # accelerate's Accelerator, for ``accelerator.accumulate``
        accelerator = hasattr(owner, "gradient_state") and isinstance(getattr(owner, "step", None), int)
        if accelerator and owner not in self._window.accelerators:
            self._window.accelerators.append(owner)  # its accumulation counter, which each entry advances

        def body(fn: Callable[[], Any]) -> Any:
            with contextlib.nullcontext() if context is None else context(*context_args):
                return fn()

        return lambda fn: self.run(body, fn)

    def _attempt(self, step_fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if not self.loop.due:
            out = step_fn(*args, **kwargs)
        else:  # CPU: the step's tensors (its arguments, what the device holds beside it); CUDA: the allocator's peaks
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            held = [*self._holds, *(t for ref in self._ema if (t := ref()) is not None)]  # an EMA found, while alive
            with memory.step_peak(self.model, self._optimizers, tensors, held) as found:
                out = step_fn(*args, **kwargs)
            self._pending.append((found.get("reserved", found["peak"]), found["peak"] if "reserved" in found else None))
        go_on(self._comm)  # every rank reaches the end of its call, or votes at its error
        if self._stepped:  # else the next micro-step accumulates into this one's gradients (the window stays open)
            self._optimizer_stepped()
            if self._optimizer_steps == 1:  # until the next call: what the script updates from the weights
                watch = HeldWatch([p for p in self.model.parameters() if p.requires_grad])
                self._gap = weakref.finalize(self, watch.start().end)
        return out

    def _gap_ended(self) -> None:
        """After the first optimizer step's gap: tensors held beside the step on the model's device (an EMA's shadow
        weights) counted in each measurement from now on, and in the regime (on every rank, if on any)."""
        found, self._gap = [t for t in self._gap().values() if t.device == self._device()], None
        self._ema = [weakref.ref(t) for t in found]
        if self._comm.max(int(bool(found))):
            self._watch.ema = True
            self._regime_differs()

    def _optimizer_stepped(self) -> None:
        """One optimizer step ended: the next call opens a new window; judge the peak over its measured micro-steps
        (after the first, its regime)."""
        self._stepped = False
        self._window.calls = []
        self._optimizer_steps += 1
        if self._optimizer_steps == 1 and self._regime_differs():
            return
        if self._pending:
            measured, allocated = max(self._pending, key=lambda found: found[0])
            self._pending = []
            if (policy := self.loop.judge(self._step, self._comm.max(measured), allocated)) is not None:
                self._put_on(policy)

    def _regime_differs(self) -> bool:
        """The first optimizer step shows a workload unlike the one planned (`RegimeWatch.workload`): re-planned."""
        was = self._workload
        self._workload, lines = self._watch.workload(was, self._optimizers)
        self._say(*lines)
        if self._workload == was:
            return False
        how = "as given" if self._watch.given else "as guessed from the model"
        self._put_on(
            self.loop.regime(self._step, f"the step runs in {described(self._workload)}, not in {described(was)} {how}")
        )
        return True

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    # -- the optimizers ----------------------------------------------------------------------

    def _adopt(self, leaves: list[Any]) -> None:
        """The optimizers among ``leaves`` (given, the step's arguments): the tracker counts them, a retry restores."""
        found = (base_optimizer(x) for x in leaves if isinstance(x, torch.optim.Optimizer))
        self._optimizers = list(dict.fromkeys([*self._optimizers, *found]))

    def _spot(self, opt: torch.optim.Optimizer) -> None:
        """An optimizer begins a step: one over the model's parameters ends the guarded optimizer step."""
        opt = base_optimizer(opt)
        if opt in self._optimizers or any(id(p) in self._params for g in opt.param_groups for p in g["params"]):
            if not self._stepped:  # before any weight changes, every rank meets here or votes at its error
                go_on(self._comm)
            self._stepped = True
            self._adopt([opt])

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
        torch.cuda.empty_cache()  # a no-op where CUDA is not initialised

    # -- the planner ---------------------------------------------------------------------------

    def _planned(self, budget: int) -> tuple[str, int]:
        # A GPU flavour's budget is the card's, the CUDA context in it; the guard's is the allocator's reserve.
        context = 0 if self._workload.device == "cpu" else whole.card(self._workload).context
        planned = pipeline.plan(self._workload, budget + context - self._held_bytes, "torch", **self._plan_options)
        return planned.policy, self._reserved(planned.solution.prediction.peak_bytes + self._held_bytes)

    def _predict(self, policy: str) -> int:
        options = {k: v for k, v in self._plan_options.items() if k in ("world_size", "distributed")}
        found = from_rank0(lambda: pipeline.predict_policy(self._workload, policy, "torch", **options))
        return self._reserved(found[0].prediction.peak_bytes + self._held_bytes)

    def _reserved(self, allocated: int) -> int:
        """A predicted peak as the guard judges it: on a GPU flavour, the allocator's reserve (`gpu.FRAGMENTATION`)."""
        return allocated if self._workload.device == "cpu" else round(allocated * gpu.FRAGMENTATION)

    def _say(self, *lines: str) -> None:
        ranks = f"rank {self._comm.rank}: " if self._comm.world > 1 else ""
        for line in lines:
            say(f"guard: {ranks}step {self._step}: {line}")  # through logging when it is on
