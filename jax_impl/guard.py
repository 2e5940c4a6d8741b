"""`plan_for_step`: a plan whose compiled *user* step fits the budget, judged by XLA (docs/guard.md).

The user's step may hold more than the model's (a teacher's features, a doubled batch). In JAX the
whole step is one compiled program, so its peak is known before anything runs: the closed loop
(`shared_configs.planning.closed_loop`) judges each compile's ``memory_analysis()`` peak as exact and
re-plans for what the step holds beyond the model's, ``rounds`` times, then `full`. `GuardedStep` runs
it and, after XLA's out-of-memory error, runs it again under a plan that recomputes more. Mirror:
`torch_impl.guard.BudgetGuard`, which measures steps instead.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from jax_impl.memory import compiled_peak
from shared_configs.planning import pipeline
from shared_configs.planning.closed_loop import DEFAULT_ROUNDS, Action, ClosedLoop, GuardRecord, measured, split_options
from shared_configs.planning.pipeline import Workload
from shared_configs.planning.solver import Infeasible
from shared_configs.planning.workers import XLA_CPU_OPTIONS
from shared_configs.progress import SILENT, say
from shared_configs.regime import DEFAULT as DEFAULT_REGIME
from shared_configs.regime import Regime
from shared_configs.spec import UNetSpec


@dataclass(frozen=True)
class StepPlan:
    """The plan in force, its compiled peak and prediction, and every compile that led to it."""

    plan: str
    compiled: int
    predicted: int
    budget: int
    history: list[GuardRecord] = field(default_factory=list)  # one per compile (its round as ``step``)
    loop: ClosedLoop | None = field(default=None, repr=False, compare=False)  # for `GuardedStep`'s re-plans


def compile_for(build_step: Callable[[str], Any], policy: str, example_args: Sequence[Any]) -> Any:
    """The user's step for ``policy`` (jitted here if a plain function), compiled for ``example_args``."""
    step = build_step(policy)
    return xla_compile((step if hasattr(step, "lower") else jax.jit(step)).lower(*example_args))


def xla_compile(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """``lowered`` compiled as the planner compiles it: on XLA:CPU with remat's barriers kept."""
    return lowered.compile(compiler_options=XLA_CPU_OPTIONS if jax.default_backend() == "cpu" else {})


def plan_for_step(
    build_step: Callable[[str], Any],
    example_args: Sequence[Any],
    budget_bytes: int,
    *,
    spec: UNetSpec | str,
    batch_size: int,
    regime: Regime | None = None,
    sample_size: int | None = None,
    rounds: int = DEFAULT_ROUNDS,
    policy: str | None = None,
    planner_log: logging.Logger = SILENT,
    **planner_options: Any,
) -> StepPlan:
    """A plan whose compiled user step (``build_step(plan)`` on ``example_args``) fits ``budget_bytes``.

    The keyword arguments describe the model's step to the planner; ``policy`` starts from that plan
    (a resumed run's own) instead of planning; ``rounds``: re-plans before `full`; ``planner_log``: where
    re-plans' progress goes. Raises `Infeasible` (one line) when even `full` is over."""
    options, workload = split_options(planner_options)
    work = Workload.of(spec, sample_size, batch_size=batch_size, regime=regime or DEFAULT_REGIME, **workload)

    def plan(budget: int) -> tuple[str, int]:
        planned = pipeline.plan(work, budget, "jax", **options)
        return planned.policy, planned.solution.prediction.peak_bytes

    def predict(policy: str) -> int:
        return pipeline.predict_policy(work, policy, "jax", **options)[0].prediction.peak_bytes

    loop = ClosedLoop(
        budget_bytes, plan, predict, lambda m: say(f"plan_for_step: {m}"), rounds=rounds, exact=True, log=planner_log
    )
    loop.start(policy)
    peak = compiled_peak(compile_for(build_step, loop.plan, example_args))
    while loop.judge(len(measured(loop.history)), peak) is not None:  # a compile per plan; the loop ends it
        peak = compiled_peak(compile_for(build_step, loop.plan, example_args))
    if peak > loop.budget:  # over under `full`
        err = Infeasible(loop.budget, peak)
        err.history = measured(loop.history)  # type: ignore[attr-defined]  # what was compiled, for a caller's record
        raise err
    return StepPlan(loop.plan, peak, loop.predicted, loop.budget, measured(loop.history), loop)


class GuardedStep:
    """The user's compiled step under ``sp.plan``, run again with the same arguments under a plan that recomputes
    more when XLA runs out of device memory (the closed loop's ladder: halfway to `full`'s peak, then `full`).
    Under `full`, or when the failed run consumed donated arguments, it says so in one line and re-raises."""

    def __init__(self, build_step: Callable[[str], Any], sp: StepPlan, example_args: Sequence[Any]) -> None:
        if sp.loop is None:
            raise ValueError("GuardedStep: sp must come from plan_for_step (it carries the planner's workload)")
        self._build, self._step = build_step, 0
        self._loop = copy.copy(sp.loop)  # its plan changes here, not in ``sp``
        self._loop.history = list(sp.loop.history)
        self._loop.say = lambda m: say(f"GuardedStep: step {self._step}: {m}")
        self._compiled = compile_for(build_step, sp.plan, example_args)

    @property
    def plan(self) -> str:
        return self._loop.plan

    @property
    def predicted(self) -> int:
        return self._loop.predicted

    @property
    def history(self) -> list[GuardRecord]:
        """plan_for_step's compiles, then each out-of-memory error (its step as ``step``)."""
        return measured(self._loop.history)

    def __call__(self, *args: Any) -> Any:
        self._step += 1
        while True:  # the ladder ends: under `full` the loop gives up
            try:
                return self._compiled(*args)
            except jax.errors.JaxRuntimeError as err:
                if not is_out_of_memory(err):
                    raise
                consumed = any(isinstance(a, jax.Array) and a.is_deleted() for a in jax.tree.leaves(args))
                why = "it consumed its donated arguments: nothing is left to run it on" if consumed else None
                if not self._loop.out_of_memory(self._step, why, compiled_peak(self._compiled), Action.CONSUMED):
                    raise
            # Out of the handler: the error and what the failed run held are gone before the retry.
            self._compiled = compile_for(self._build, self._loop.recompute_more(self._step), args)


def is_out_of_memory(err: BaseException) -> bool:
    """XLA's out-of-memory error: a ``JaxRuntimeError`` whose message carries ``RESOURCE_EXHAUSTED``."""
    return isinstance(err, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(err)
