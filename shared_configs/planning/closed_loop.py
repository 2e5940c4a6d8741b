"""The closed loop's decisions, once and framework-free: arithmetic on bytes (docs/guard.md, "The rules").

A guard measures the user's step and puts plans on the model; `ClosedLoop` decides the rest: how many
peaks to measure after a change (`MEASURED_STEPS`), whether a peak is over the budget, what to plan for
next (tightened or loosened with one margin, `REPLAN_MARGIN`; ``rounds`` re-plans, then `full`), and
the out-of-memory ladder (`OOM_HALVINGS` plans halfway to `full`, then `full`, the last resort), and how
several processes agree on a retry (`Vote`: every rank acts on the largest). The planner is a function
handed in. Its adapters: `torch_impl.guard.BudgetGuard` (measured steps) and `jax_impl.guard` (compiled
steps).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any

from shared_configs.planning.units import FULL
from shared_configs.progress import SILENT, reporting_to
from shared_configs.sizes import MIB
from shared_configs.spec import SpecError

MEASURED_STEPS = 2  # peaks measured at the start and after every change (the first step makes AdamW's state)
LOOSEN_BELOW = 0.10  # loosen once when the first window peaks this fraction or more under the budget
REPLAN_MARGIN = 0.02  # of the budget, left by a re-plan: two plans' predictions err by different amounts
OOM_HALVINGS = 2  # plans tried between one that ran out of memory and `full`, per step
DEFAULT_ROUNDS = 3  # re-plans for a measured excess before `full`
NONE = "none"
PLAN_OPTIONS = ("world_size", "distributed", "candidates")  # `pipeline.plan`'s keywords; the rest are `Workload`'s

Planner = Callable[[int], tuple[str, int]]  # a budget -> (policy, predicted peak), `SpecError` when none fits


class Action(StrEnum):
    """What a `GuardRecord` says: a peak judged, an out-of-memory error, or (from `PLANNED` on) a change of plan."""

    MEASURED = "measured"  # a measured step's peak, within budget
    FITS = "fits"  # a compiled step's peak, within budget: exact, so the search ends
    OVER_BUDGET = "over budget"
    OUT_OF_MEMORY = "out of memory"
    NOT_RETRIED = "not retried"  # the failed attempt cannot be undone (the guard says why)
    CONSUMED = "consumed"  # the failed compiled step consumed its donated arguments
    FULL_FAILED = "full failed"  # out of memory under `full`: nothing recomputes more
    PLANNED = "planned"
    GIVEN = "given"
    REGIME = "regime"
    TIGHTENED = "tightened"
    LOOSENED = "loosened"
    RECOMPUTE_MORE = "recompute more"


class Vote(IntEnum):
    """A rank's word at a point every rank reaches once per attempt (before its optimizer step, at the end of
    a guarded call, or at its out-of-memory error): all ranks act on the largest, so they act alike."""

    GO_ON = 0
    RETRY = 1  # out of memory, and the attempt can be undone: every rank runs it again under one plan
    REFUSE = 2  # out of memory once its optimizer step had begun: every rank re-raises


def ballot(vote: Vote, rank: int, ranks: int) -> int:
    """``vote`` as one integer for a max-reduction over ``ranks``: the largest names the largest vote and a rank."""
    return vote * ranks + rank


def tally(largest: int, ranks: int) -> tuple[Vote, int]:
    """The agreed vote and a rank that cast it, from the largest `ballot`."""
    return Vote(largest // ranks), largest % ranks


@dataclass(frozen=True)
class GuardRecord:
    """One peak judged or error met (``measured`` set where there was one), or one change of plan."""

    step: int  # the guarded step (0: before the first); judging compiles, the compile's round
    plan: str  # the policy measured, or put on
    predicted: int  # the planner's peak of ``plan`` for the model's own step (bytes; on CUDA as reserved)
    measured: int | None  # the step's peak (CUDA: max reserved; CPU: step_peak; JAX: the compiled step's)
    outside: int | None  # bytes the step held beyond the model's step (measured - predicted)
    action: Action
    allocated: int | None = None  # CUDA only: max_memory_allocated over the step


def replan_target(budget: int, outside: int) -> int:
    """The model step's budget in a re-plan: the budget, less the margin and what the step holds beyond it."""
    return round(budget * (1 - REPLAN_MARGIN)) - outside


def far_under(peak: int, budget: int) -> bool:
    """A window's peak low enough under the budget to loosen for."""
    return peak < budget * (1 - LOOSEN_BELOW)


def halfway(predicted: int, full: int) -> int:
    """After an out-of-memory error, the peak to plan for: halfway from the failed plan's to `full`'s."""
    return (predicted + full) // 2


def split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A guard's planner keywords as (`pipeline.plan`'s, `Workload`'s)."""
    plan = {k: v for k, v in options.items() if k in PLAN_OPTIONS}
    return plan, {k: v for k, v in options.items() if k not in plan}


def mib(n: int) -> str:
    return f"{n / MIB:.1f} MiB"


class ClosedLoop:
    """One guard's plan in force, its records (`history`) and its decisions.

    ``planner(budget)``: the plan for a budget and its predicted peak; ``predict(policy)``: a policy's;
    ``say``: a line the user must see. ``exact``: the peaks judged are compiled ones (one per plan; within
    budget the search ends, `Action.FITS`; nothing is loosened). ``log``: where re-plans' progress goes.
    """

    def __init__(
        self,
        budget: int,
        planner: Planner,
        predict: Callable[[str], int],
        say: Callable[[str], None],
        *,
        rounds: int = DEFAULT_ROUNDS,
        exact: bool = False,
        log: logging.Logger = SILENT,
    ) -> None:
        self.budget, self.rounds, self.exact = int(budget), rounds, exact
        self._planner, self._predict, self.say, self._log = planner, predict, say, log
        self.history: list[GuardRecord] = []
        self.plan, self.predicted = NONE, 0
        self.left = 0  # peaks still to measure in this window
        self._window: list[int] = []
        self._may_loosen = not exact
        self._replans = 0
        self._ladder = (0, 0)  # (step, halvings made in it) of the last out-of-memory error

    @property
    def due(self) -> bool:
        """Whether the next step is measured."""
        return self.left > 0

    def start(self, policy: str | None = None) -> str:
        """The first plan: the planner's for the budget (its `Infeasible` raised), or ``policy`` (a resumed run's)."""
        if policy is None:
            return self.change(0, *self._planner(self.budget), Action.PLANNED, 0)
        return self.change(0, policy, self._predict(policy), Action.GIVEN, None)

    def change(self, step: int, policy: str, predicted: int, action: Action, outside: int | None) -> str:
        """Record a change to ``policy`` and measure a window under it; returns the policy to put on."""
        self.plan, self.predicted = policy, predicted
        self.left, self._window = 1 if self.exact else MEASURED_STEPS, []
        self.history.append(GuardRecord(step, policy, predicted, None, outside, action))
        return policy

    def judge(self, step: int, measured: int, allocated: int | None = None) -> str | None:
        """Record a measured peak; the plan to put on next (tightened when over budget, loosened once when the
        first window is far under it), or None to keep the plan."""
        outside, over = measured - self.predicted, measured > self.budget
        action = Action.OVER_BUDGET if over else Action.FITS if self.exact else Action.MEASURED
        self._record(step, measured, action, allocated)
        self.left -= 1
        self._window.append(measured)
        if over:
            self._may_loosen = False
            return self._tighten(step, measured, outside)
        if self.left > 0 or not self._may_loosen:
            return None
        self._may_loosen = False
        peak = max(self._window)
        return self._loosen(step, peak - self.predicted) if far_under(peak, self.budget) and self.plan != NONE else None

    def _tighten(self, step: int, measured: int, outside: int) -> str | None:
        target = replan_target(self.budget, outside)
        self._replans += 1
        found = self._plan_for(target) if self._replans <= self.rounds else None
        over = f"peaked at {mib(measured)}, over the {mib(self.budget)} budget"
        if found is None and self.plan == FULL:
            self.say(f"{over}, under {FULL}: nothing recomputes more ({mib(outside)} held outside the model's step)")
            self.left = 0
            return None
        policy, predicted = found or (FULL, self._full())
        why = f"no plan fits {mib(target)}" if self._replans <= self.rounds else f"{self.rounds} re-plans made"
        how = f"planned for {mib(target)}" if found else why
        self.say(
            f"{over} (predicted {mib(self.predicted)}, {mib(outside)} held outside the model's step); {how}: "
            f"{policy} (predicted {mib(predicted)})"
        )
        return self.change(step, policy, predicted, Action.TIGHTENED, outside)

    def _loosen(self, step: int, outside: int) -> str | None:
        target = replan_target(self.budget, outside)
        found = self._plan_for(target)
        if found is None or found[1] <= self.predicted:
            return None  # nothing faster fits
        policy, predicted = found
        self.say(
            f"peaked at {mib(self.predicted + outside)}, over {100 * LOOSEN_BELOW:.0f}% under the "
            f"{mib(self.budget)} budget; planned for {mib(target)}: {policy} (predicted {mib(predicted)}, "
            "recomputes less)"
        )
        return self.change(step, policy, predicted, Action.LOOSENED, outside)

    def out_of_memory(
        self,
        step: int,
        why: str | None = None,
        measured: int | None = None,
        refusal: Action = Action.NOT_RETRIED,
        who: str = "",
    ) -> bool:
        """Record an out-of-memory error at ``step`` (``measured``: the failed step's peak, where known; ``who``:
        another rank's, "rank 1 "); whether to run the step again (after `recompute_more`). Not when ``why`` says
        the attempt cannot be undone (recorded as ``refusal``, its peak kept), nor under `full`."""
        self._may_loosen = False
        self._record(step, measured, Action.OUT_OF_MEMORY)
        if why is not None:
            self._record(step, measured, refusal)
            self.say(f"{who}ran out of memory under {self.plan}; not run again: {why}; re-raising")
        elif self.plan == FULL:
            self._record(step, None, Action.FULL_FAILED)
            self.say(
                f"{who}ran out of memory under {FULL} (predicted {mib(self.predicted)}), which recomputes the most: "
                "the step does not fit this device; re-raising"
            )
        return why is None and self.plan != FULL

    def recompute_more(self, step: int, who: str = "") -> str:
        """After `out_of_memory`: the plan for halfway to `full`'s predicted peak, at most `OOM_HALVINGS` times a
        step, else `full` (also where the halfway plan would not recompute more); returns it."""
        made = self._ladder[1] + 1 if self._ladder[0] == step else 1
        self._ladder = (step, made)
        full = self._full()
        found = self._plan_for(halfway(self.predicted, full)) if made <= OOM_HALVINGS else None
        if found is None or found[1] >= self.predicted:
            found = (FULL, full)
        self.say(
            f"{who}ran out of memory under {self.plan} (predicted {mib(self.predicted)}); running it again under "
            f"{found[0]} (predicted {mib(found[1])})"
        )
        return self.change(step, *found, Action.RECOMPUTE_MORE, None)

    def whole_budget(self) -> tuple[str, int]:
        """The plan for the whole budget and its peak (the step seen anew), `full` where none fits."""
        return self._plan_for(self.budget) or (FULL, self._full())

    def _plan_for(self, target: int) -> tuple[str, int] | None:
        if target <= 0:
            return None
        try:
            with reporting_to(self._log):
                return self._planner(target)
        except SpecError:  # `Infeasible`, or no plan checked under the target
            return None

    def _full(self) -> int:
        with reporting_to(self._log):
            return self._predict(FULL)

    def _record(self, step: int, measured: int | None, action: Action, allocated: int | None = None) -> None:
        outside = None if measured is None else measured - self.predicted
        self.history.append(GuardRecord(step, self.plan, self.predicted, measured, outside, action, allocated))


def measured(history: list[GuardRecord]) -> list[GuardRecord]:
    """The records that carry a peak (the JAX guard's history: the compiles it judged, or ran out of memory)."""
    return [r for r in history if r.measured is not None]
