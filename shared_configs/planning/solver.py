"""The cheapest plan under a memory budget, exactly: the peak model (`budget.predict`) is linear in one binary per
unit and choice, `scipy.optimize.milp` (HiGHS) minimises recompute time under it, and `predict` checks the answer
in exact integers. The programme: docs/planning.md "The solver".
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from shared_configs.planning.budget import Prediction, Profile, predict
from shared_configs.planning.units import PLAIN, Assignment, StepSpec, is_pseudo, policy_string, segments
from shared_configs.sizes import MIB
from shared_configs.spec import SpecError

Cut = tuple[np.ndarray, float]  # a row over the columns and its upper bound: one plan left out


@dataclass(frozen=True)
class Solution:
    """A plan, its policy string, and what the model predicts of it (one per profile)."""

    assignment: dict[str, str]
    predictions: tuple[Prediction, ...]
    policy: str

    @property
    def prediction(self) -> Prediction:
        return self.predictions[0]


class Infeasible(SpecError):
    """No plan fits; ``smallest`` is the smallest budget (bytes) one does."""

    def __init__(self, budget: int, smallest: int) -> None:
        super().__init__(
            f"budget: no plan fits {budget / MIB:.1f} MiB; the smallest feasible budget is "
            f"{math.ceil(smallest / MIB)} MiB ({smallest} bytes)"
        )
        self.budget, self.smallest = budget, smallest

    def __reduce__(self) -> tuple[type, tuple[int, int]]:  # pickled by name and fields: one rank's, sent to all
        return Infeasible, (self.budget, self.smallest)


class _Programme:
    """Binary columns (unit, choice): a block's recompute choices, a layer's choices, a pseudo-unit's plain (set
    when its block is not recomputed whole); per profile and column, ``K(u) + H(u) + fwd_peak <= limit`` and
    ``K(u) + bwd_peak <= limit``, binding when the column is set."""

    def __init__(self, profiles: Sequence[Profile], spec: StepSpec) -> None:
        self.profiles = profiles
        self.cols: list[tuple[str, str]] = []
        self.eq: list[list[int]] = []  # columns summing to 1: a layer's choices and its block's
        where: list[tuple[int, int]] = []  # per column: (segment, position in it; -1: the block whole)
        for s, (block, layers) in enumerate(segments(spec)):  # a pseudo-unit (stem, head) is a block of one
            whole = [] if is_pseudo(block) else [c for c in self._choices(block) if c != PLAIN]
            whole_cols = self._add(block, whole, (s, -1), where)
            for i, name in enumerate(layers):
                choices = [PLAIN] if is_pseudo(name) else self._choices(name)
                self.eq.append(whole_cols + self._add(name, choices, (s, i), where))
        self.segment, self.position = np.array(where).T

    def _choices(self, unit: str) -> list[str]:
        return [c for c in self.profiles[0].units[unit] if all(c in p.units[unit] for p in self.profiles)]

    def _add(self, unit: str, choices: list[str], at: tuple[int, int], where: list[tuple[int, int]]) -> list[int]:
        self.cols += [(unit, c) for c in choices]
        where += [at] * len(choices)
        return list(range(len(self.cols) - len(choices), len(self.cols)))

    def _peak_rows(self, f: int, limit: float) -> Iterator[Cut]:
        """Profile ``f``'s two rows per column (MiB), each relaxed by the smallest M that frees it when the column is
        not set: K(u) and H(u) sum the columns before u (earlier segments; earlier layers of its own block)."""
        costs = [self.profiles[f].cost(u, c) for u, c in self.cols]
        keep, hold = (np.array([getattr(c, field) for c in costs]) / MIB for field in ("keep", "hold"))
        seg, pos = self.segment, self.position
        for j, cost in enumerate(costs):
            before = (seg < seg[j]) | ((seg == seg[j]) & (pos >= 0) & (pos < pos[j]))
            for coefs, peak in ((keep + hold, cost.fwd_peak), (keep, cost.bwd_peak)):
                row = np.where(before, coefs, 0.0)
                bound = limit - peak / MIB
                big = row[row > 0].sum() - bound + 1.0  # all the others could reach
                row[j] = big
                yield row, bound + big

    def cut(self, assignment: Assignment) -> Cut:
        """The row ``sum(x[j], j in S) - sum(x[j], j not in S) <= |S| - 1`` over the recompute columns, S those
        ``assignment`` sets: every other plan meets it, ``assignment`` does not."""
        row = np.array([0.0 if c == PLAIN else 1.0 if assignment.get(u) == c else -1.0 for u, c in self.cols])
        return row, float(np.sum(row > 0) - 1)

    def solve(
        self, cost: np.ndarray, limits: list[float], minimise_peak: bool = False, cuts: Sequence[Cut] = ()
    ) -> np.ndarray | None:
        """Minimise ``cost`` (per column) under every peak row (``limits``: MiB per profile), leaving out the plans of
        ``cuts``. A last, continuous column is the peak (rows read ``<= limit + peak / scale``): 0, or with
        ``minimise_peak`` free and the objective."""
        n = len(self.cols)
        rows, hi = [np.r_[row, 0.0] for row, _ in cuts], [bound for _, bound in cuts]
        for f, limit in enumerate(limits):
            for row, bound in self._peak_rows(f, limit):
                rows.append(np.r_[row, -1.0 / self.profiles[f].scale])
                hi.append(bound)
        lo = [-np.inf] * len(rows) + [1.0] * len(self.eq)
        for cols in self.eq:
            rows.append(np.isin(np.arange(n + 1), cols).astype(float))
            hi.append(1.0)
        from scipy.optimize import Bounds, LinearConstraint, milp  # here: the workers import this module, never solve

        with _quiet_stdout():
            res = milp(
                np.r_[cost, float(minimise_peak)],
                integrality=np.r_[np.ones(n), 0.0],
                bounds=Bounds(0.0, np.r_[np.ones(n), np.inf if minimise_peak else 0.0]),
                constraints=LinearConstraint(np.array(rows), lo, hi),
                options={"mip_rel_gap": 0.0, "disp": False},
            )
        return res.x[:n] if res.status == 0 else None

    def assignment(self, x: np.ndarray) -> dict[str, str]:
        return {u: c for (u, c), v in zip(self.cols, x, strict=True) if v > 0.5 and c != PLAIN}


@contextmanager
def _quiet_stdout() -> Iterator[None]:
    """HiGHS (1.x) prints a stray debug line to the process's stdout on some problems: silenced."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _objective(profiles: Sequence[Profile], unit: str, choice: str) -> float:
    """Recompute seconds as fractions of each plain step, summed (else TFLOP), plus a hair per recompute (ties)."""
    tie = 1e-5 * (choice != PLAIN)
    if all(p.step_time_s > 0 for p in profiles):
        return sum(p.cost(unit, choice).time_s / p.step_time_s for p in profiles) + tie
    return profiles[0].cost(unit, choice).flops / 1e12 + tie


def _list(profiles: Profile | Sequence[Profile]) -> list[Profile]:
    return [profiles] if isinstance(profiles, Profile) else list(profiles)


def _cheapest(
    profiles: list[Profile], spec: StepSpec, budget_bytes: int, exclude: Sequence[Assignment] = ()
) -> dict[str, str] | None:
    """The least-cost assignment, not in ``exclude``, whose predicted peaks fit ``budget_bytes``; None if none."""
    if any(p.opt_peak * p.scale > budget_bytes + 0.5 for p in profiles):
        return None
    prog = _Programme(profiles, spec)
    cost = np.array([_objective(profiles, u, c) for u, c in prog.cols])
    cuts = [prog.cut(a) for a in exclude]
    slack = 0.0  # bytes taken off the limit when solver tolerance overshoots
    for _ in range(4):
        x = prog.solve(cost, [((budget_bytes + 0.5) / p.scale - slack) / MIB for p in profiles], cuts=cuts)
        if x is None:
            return None
        assignment = prog.assignment(x)
        if all(predict(p, spec, assignment).peak_bytes <= budget_bytes for p in profiles):
            return assignment
        slack = 2 * slack + 64
    raise RuntimeError("solver: the programme's answer keeps overshooting the budget")  # pragma: no cover


def solve(profiles: Profile | Sequence[Profile], spec: StepSpec, budget_bytes: int, margin: float = 0.0) -> Solution:
    """The plan of least recompute time whose predicted peak fits ``budget_bytes`` less a fraction ``margin``
    (`budget.safety_margin`) in every profile; `Infeasible`, naming the smallest budget that fits, when none does."""
    profiles = _list(profiles)
    assignment = _cheapest(profiles, spec, int(budget_bytes * (1 - margin)))
    if assignment is None:
        lowest = max(p.peak_bytes for p in smallest_peak(profiles, spec).predictions)
        raise Infeasible(budget_bytes, math.ceil(lowest / (1 - margin)))
    return solution(profiles, spec, assignment)


def next_best(
    profiles: Profile | Sequence[Profile], spec: StepSpec, budget_bytes: int, margin: float, first: Solution, count: int
) -> list[Solution]:
    """Up to ``count`` plans after ``first`` (`solve`'s answer), each the cheapest that fits but those before it."""
    profiles = _list(profiles)
    found = [first]
    for _ in range(count):
        assignment = _cheapest(profiles, spec, int(budget_bytes * (1 - margin)), [s.assignment for s in found])
        if assignment is None:
            break
        found.append(solution(profiles, spec, assignment))
    return found[1:]


def smallest_peak(profiles: Profile | Sequence[Profile], spec: StepSpec) -> Solution:
    """The plan of least predicted peak (the largest over the profiles); of those, the cheapest."""
    profiles = _list(profiles)
    prog = _Programme(profiles, spec)
    x = prog.solve(np.full(len(prog.cols), 1e-9), [0.0] * len(profiles), minimise_peak=True)  # a hair per choice
    assert x is not None  # every unit has a plan; the peak is free
    floor = max(max(predict(p, spec, prog.assignment(x)).peak_bytes, round(p.opt_peak * p.scale)) for p in profiles)
    assignment = _cheapest(profiles, spec, floor)
    assert assignment is not None  # the lowest plan itself fits its own peak
    return solution(profiles, spec, assignment)


def peak_range(profiles: Profile | Sequence[Profile], spec: StepSpec) -> tuple[int, int]:
    """(The smallest feasible predicted peak, ``none``'s), each the largest over the profiles."""
    profiles = _list(profiles)
    low = max(p.peak_bytes for p in smallest_peak(profiles, spec).predictions)
    return low, max(predict(p, spec, {}).peak_bytes for p in profiles)


def solution(profiles: Sequence[Profile], spec: StepSpec, assignment: Assignment) -> Solution:
    """``assignment`` as a `Solution`: its policy string and what each profile predicts of it."""
    predictions = tuple(predict(p, spec, assignment) for p in profiles)
    return Solution(dict(assignment), predictions, policy_string(assignment))
