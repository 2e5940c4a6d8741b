"""`plan_for_step`: a plan whose compiled *user* step fits the budget, judged by XLA (docs/guard.md).

The user's step may hold more than the model's (a teacher's features, a doubled batch). In JAX the
whole step is one compiled program, so its peak is known before anything runs: plan for the budget
(`shared_configs.planning.pipeline.plan`), compile the user's step for that plan, and when its
``memory_analysis()`` peak is over the budget re-plan for ``budget - excess``, up to ``rounds``
times, then `full`. Its torch twin is `torch_impl.guard.BudgetGuard`, which measures instead.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from jax_impl.memory import compiled_peak
from shared_configs.planning import pipeline
from shared_configs.planning.pipeline import Workload
from shared_configs.planning.solver import Infeasible
from shared_configs.planning.workers import XLA_CPU_OPTIONS
from shared_configs.progress import say
from shared_configs.regime import DEFAULT as DEFAULT_REGIME
from shared_configs.regime import Regime
from shared_configs.sizes import MIB
from shared_configs.spec import UNetSpec

FULL = "full"
DEFAULT_ROUNDS = 3  # re-plans before `full`
OOM_HALVINGS = 2  # after an out-of-memory error: plans halfway to `full`'s peak before `full` (as torch's guard)
_PLAN_OPTIONS = ("world_size", "distributed")  # `pipeline.plan`'s; the rest of ``planner_options``: `Workload`'s


@dataclass(frozen=True)
class StepRecord:
    """One compile of the user's step (as `torch_impl.guard.GuardRecord`, the step being the round)."""

    round: int  # plan_for_step: the compile's round, 0 the first plan's; GuardedStep: the step that ran out
    plan: str  # the policy compiled
    predicted: int  # the planner's peak of ``plan`` for the model's own step (bytes)
    compiled: int  # XLA's peak of the user's compiled step (bytes)
    outside: int  # what the user's step holds beyond the model's step: compiled - predicted
    action: str  # "fits", "re-planned", "full", "full failed"; GuardedStep: "out of memory", "consumed"


@dataclass(frozen=True)
class StepPlan:
    """The plan in force, its compiled peak and prediction, and every compile that led to it."""

    plan: str
    compiled: int
    predicted: int
    budget: int
    history: list[StepRecord] = field(default_factory=list)
    # What the planner was asked, for `GuardedStep`'s re-plans after an out-of-memory error.
    workload: Workload | None = field(default=None, repr=False, compare=False)
    plan_options: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


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
    **planner_options: Any,
) -> StepPlan:
    """A plan whose compiled user step (``build_step(plan)`` on ``example_args``) fits ``budget_bytes``.

    The keyword arguments describe the model's step to the planner; ``policy`` starts from that plan
    (a resumed run's own) instead of planning. Raises `Infeasible` (one line) when even `full` is over."""
    plan_opts = {k: v for k, v in planner_options.items() if k in _PLAN_OPTIONS}
    work = Workload.of(
        spec,
        sample_size,
        batch_size=batch_size,
        regime=regime or DEFAULT_REGIME,
        **{k: v for k, v in planner_options.items() if k not in _PLAN_OPTIONS},
    )
    budget = int(budget_bytes)
    if policy is None:
        planned = pipeline.plan(work, budget, "jax", **plan_opts)
        policy, predicted = planned.policy, planned.solution.prediction.peak_bytes
    else:
        predicted = pipeline.predict_policy(work, policy, "jax", **plan_opts)[0].prediction.peak_bytes
    history: list[StepRecord] = []
    for rnd in range(rounds + 2):  # the first plan, ``rounds`` re-plans, then `full`
        peak = compiled_peak(compile_for(build_step, policy, example_args))
        outside = peak - predicted
        if peak <= budget:
            history.append(StepRecord(rnd, policy, predicted, peak, outside, "fits"))
            return StepPlan(policy, peak, predicted, budget, history, work, plan_opts)
        if policy == FULL:
            history.append(StepRecord(rnd, policy, predicted, peak, outside, "full failed"))
            err = Infeasible(budget, peak)
            err.history = history  # type: ignore[attr-defined]  # what was compiled, for a caller's record
            raise err
        policy_next, predicted_next = _replan(work, budget - outside, rnd >= rounds, plan_opts)
        history.append(
            StepRecord(rnd, policy, predicted, peak, outside, "full" if policy_next == FULL else "re-planned")
        )
        say(
            f"plan_for_step: {policy} compiles to {peak / MIB:.1f} MiB, over the {budget / MIB:.1f} MiB budget "
            f"({outside / MIB:+.1f} MiB beyond the model's step); now {policy_next}"
        )
        policy, predicted = policy_next, predicted_next
    raise AssertionError("unreachable: the last round moves to `full`, which fits or raises")


def _replan(work: Workload, target: int, last: bool, plan_opts: dict[str, Any]) -> tuple[str, int]:
    """The plan for ``target``, or `full` (which recomputes the most) after the last round or when nothing fits."""
    if not last and target > 0:
        try:
            planned = pipeline.plan(work, target, "jax", **plan_opts)
            return planned.policy, planned.solution.prediction.peak_bytes
        except Infeasible:
            pass  # no plan is predicted to fit what is left: try `full`, the least memory there is
    return FULL, pipeline.predict_policy(work, FULL, "jax", **plan_opts)[0].prediction.peak_bytes


class GuardedStep:
    """The user's compiled step under ``sp.plan``, run again with the same arguments under a plan that recomputes
    more when XLA runs out of device memory (halfway to `full`'s peak, twice, then `full`), as torch's guard.
    Under `full`, or when the failed run consumed donated arguments, it says so in one line and re-raises."""

    def __init__(self, build_step: Callable[[str], Any], sp: StepPlan, example_args: Sequence[Any]) -> None:
        if sp.workload is None:
            raise ValueError("GuardedStep: sp must come from plan_for_step (it carries the planner's workload)")
        self._build, self._work, self._opts = build_step, sp.workload, sp.plan_options
        self.plan, self.predicted, self.history = sp.plan, sp.predicted, list(sp.history)
        self._compiled = compile_for(build_step, sp.plan, example_args)
        self._step = 0

    def __call__(self, *args: Any) -> Any:
        self._step += 1
        for rung in range(OOM_HALVINGS + 2):  # the halvings, `full`, and the failure under `full`
            try:
                return self._compiled(*args)
            except jax.errors.JaxRuntimeError as err:
                if not is_out_of_memory(err):
                    raise
                self._record("out of memory")
                if any(isinstance(a, jax.Array) and a.is_deleted() for a in jax.tree.leaves(args)):  # donated
                    self._record("consumed")
                    say(
                        f"GuardedStep: step {self._step} ran out of memory under {self.plan} after consuming "
                        "its donated arguments: nothing is left to run again; re-raising"
                    )
                    raise
                if self.plan == FULL:
                    say(
                        f"GuardedStep: step {self._step} ran out of memory under {FULL}, which recomputes "
                        "the most: the step does not fit this device; re-raising"
                    )
                    raise
            # Out of the handler: the error and what the failed run held are gone before the retry.
            self._recompute_more(rung, args)
        raise AssertionError("unreachable: the last rung is `full`, which re-raises")

    def _recompute_more(self, rung: int, args: tuple) -> None:
        # The planner's progress lines are kept off stderr (the profile is cached): one line is said.
        with contextlib.redirect_stderr(io.StringIO()):
            full = pipeline.predict_policy(self._work, FULL, "jax", **self._opts)[0].prediction.peak_bytes
            policy, predicted = FULL, full
            if rung < OOM_HALVINGS:
                policy, predicted = _replan(self._work, (self.predicted + full) // 2, False, self._opts)
                if predicted >= self.predicted:
                    policy, predicted = FULL, full
        say(
            f"GuardedStep: step {self._step} ran out of memory under {self.plan} (predicted "
            f"{self.predicted / MIB:.1f} MiB); running it again under {policy} "
            f"(predicted {predicted / MIB:.1f} MiB)"
        )
        self._compiled = compile_for(self._build, policy, args)
        self.plan, self.predicted = policy, predicted

    def _record(self, action: str) -> None:
        peak = compiled_peak(self._compiled)
        self.history.append(StepRecord(self._step, self.plan, self.predicted, peak, peak - self.predicted, action))


def is_out_of_memory(err: BaseException) -> bool:
    """XLA's out-of-memory error: a ``JaxRuntimeError`` whose message carries ``RESOURCE_EXHAUSTED``."""
    return isinstance(err, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(err)
