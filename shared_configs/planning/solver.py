"""The cheapest plan under a memory budget, exactly: the peak model (`budget.predict`) is linear in one binary per
unit and choice, `scipy.optimize.milp` (HiGHS) minimises recompute time under it, and `predict` checks the answer
in exact integers. The programme: docs/planning.md "The solver".
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from shared_configs.planning.budget import Prediction, Profile, predict
from shared_configs.planning.units import PLAIN, Assignment, StepSpec, is_pseudo, policy_string, segments
from shared_configs.sizes import MIB
from shared_configs.spec import SpecError

Expr = dict[int, float]  # column -> coefficient (MiB), with the constant under key -1
# A potential unit's peak row: (profile, K(u) [+ H(u)] as an expression, its peak in MiB, the column
# that makes it a unit (None: always one), the columns any of which unmakes it (a sampler's block's)).
PeakRow = tuple[int, Expr, float, int | None, tuple[int, ...]]
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
    """Columns (unit, choice) and, per profile, the rows ``K(u) + M * x[u, c] <= limit - peak + M``."""

    def __init__(self, profiles: Sequence[Profile], spec: StepSpec) -> None:
        self.profiles, self.spec = profiles, spec
        self.cols: list[tuple[str, str]] = []
        self.eq: list[Expr] = []  # expressions == 1
        self.le1: list[Expr] = []  # expressions <= 1
        self.peaks: list[PeakRow] = []
        self._build()

    def _col(self, unit: str, choice: str) -> int:
        self.cols.append((unit, choice))
        return len(self.cols) - 1

    def _choices(self, unit: str) -> list[str]:
        return [c for c in self.profiles[0].units[unit] if all(c in p.units[unit] for p in self.profiles)]

    def _mib(self, f: int, unit: str, choice: str, field: str) -> float:
        return getattr(self.profiles[f].cost(unit, choice), field) / MIB

    def _rows(
        self, f: int, kept: Expr, held: Expr, unit: str, choice: str, on: int | None, off: tuple[int, ...] = ()
    ) -> None:
        """``unit``'s two peak rows under ``choice``: forward (what is kept and held before it) and backward."""
        both = {k: kept.get(k, 0.0) + held.get(k, 0.0) for k in kept.keys() | held.keys()}
        self.peaks.append((f, both, self._mib(f, unit, choice, "fwd_peak"), on, off))
        self.peaks.append((f, dict(kept), self._mib(f, unit, choice, "bwd_peak"), on, off))

    def _build(self) -> None:
        nf = len(self.profiles)
        # Per profile, K(u) and H(u) (`shared_configs.planning.budget.predict`) as expressions.
        kept: list[Expr] = [{-1: 0.0} for _ in range(nf)]
        held: list[Expr] = [{} for _ in range(nf)]
        for block, layers in segments(self.spec):  # a pseudo-unit (stem, head) is a block of one, never whole
            whole = {} if is_pseudo(block) else {c: self._col(block, c) for c in self._choices(block) if c != PLAIN}
            if whole:
                self.le1.append(dict.fromkeys(whole.values(), 1.0))
            for f in range(nf):
                for c, col in whole.items():
                    self._rows(f, kept[f], held[f], block, c, col)
            inner = [(dict(k), dict(h)) for k, h in zip(kept, held, strict=True)]
            for name in layers:
                self._layer(name, whole, inner)
            for f in range(nf):
                kept[f], held[f] = inner[f]
                for c, col in whole.items():
                    for expr, field in ((kept[f], "keep"), (held[f], "hold")):
                        expr[col] = expr.get(col, 0.0) + self._mib(f, block, c, field)

    def _layer(self, name: str, whole: dict[str, int], inner: list[tuple[Expr, Expr]]) -> None:
        """A layer (or sampler) of a block: active when no ``whole`` block column is set."""
        if is_pseudo(name):  # always plain: active iff the block is not recomputed
            for f, (kept, held) in enumerate(inner):
                self._rows(f, kept, held, name, PLAIN, None, tuple(whole.values()))
                for expr, field in ((kept, "keep"), (held, "hold")):
                    value = self._mib(f, name, PLAIN, field)
                    expr[-1] = expr.get(-1, 0.0) + value
                    for col in whole.values():
                        expr[col] = expr.get(col, 0.0) - value
            return
        cols = {c: self._col(name, c) for c in self._choices(name)}
        self.eq.append({**dict.fromkeys(cols.values(), 1.0), **dict.fromkeys(whole.values(), 1.0)})
        for f, (kept, held) in enumerate(inner):
            for c, col in cols.items():
                self._rows(f, kept, held, name, c, col)
            for c, col in cols.items():
                for expr, field in ((kept, "keep"), (held, "hold")):
                    expr[col] = expr.get(col, 0.0) + self._mib(f, name, c, field)

    def cut(self, assignment: Assignment) -> Cut:
        """The row ``sum(x[j], j in S) - sum(x[j], j not in S) <= |S| - 1`` over the recompute columns, S those
        ``assignment`` sets: every other plan meets it, ``assignment`` does not."""
        row = np.array([0.0 if c == PLAIN else 1.0 if assignment.get(u) == c else -1.0 for u, c in self.cols])
        return row, float(np.sum(row > 0) - 1)

    def solve(
        self, cost: np.ndarray, limits: list[float], peak_col: bool = False, cuts: Sequence[Cut] = ()
    ) -> np.ndarray | None:
        """Minimise ``cost`` under every peak row (``limits``: MiB per profile; ``peak_col``: a last, continuous
        column is the peak, rows read ``<= peak / scale``), leaving out the plans of ``cuts``."""
        n = len(self.cols) + peak_col
        a, hi = [np.r_[row, np.zeros(int(peak_col))] for row, _ in cuts], [bound for _, bound in cuts]
        for f, expr, peak, on, off in self.peaks:
            row = np.zeros(n)
            for key, v in expr.items():
                if key >= 0:
                    row[key] += v
            bound = limits[f] - peak - expr.get(-1, 0.0)
            # The smallest M that relaxes the row when the unit is not chosen: all it could reach.
            big = sum(v for v in row if v > 0) - bound + 1.0
            if on is not None:
                row[on] += big
                bound += big
            for col in off:
                row[col] -= big
            if peak_col:
                row[-1] = -1.0 / self.profiles[f].scale
            a.append(row)
            hi.append(bound)
        lo = [-np.inf] * len(a)
        for exprs, low in ((self.eq, 1.0), (self.le1, -np.inf)):
            for expr in exprs:
                row = np.zeros(n)
                row[list(expr)] = list(expr.values())
                a.append(row)
                lo.append(low)
                hi.append(1.0)
        from scipy.optimize import Bounds, LinearConstraint, milp  # here: the workers import this module, never solve

        integrality = np.r_[np.ones(len(self.cols)), np.zeros(int(peak_col))]
        upper = np.r_[np.ones(len(self.cols)), np.full(int(peak_col), np.inf)]
        with _quiet_stdout():
            res = milp(
                cost,
                integrality=integrality,
                bounds=Bounds(np.zeros(n), upper),
                constraints=LinearConstraint(np.array(a), lo, hi),
                options={"mip_rel_gap": 0.0, "disp": False},
            )
        return res.x if res.status == 0 else None

    def assignment(self, x: np.ndarray) -> dict[str, str]:
        return {u: c for (u, c), v in zip(self.cols, x, strict=False) if v > 0.5 and c != PLAIN}


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


def _objective(profiles: Sequence[Profile]) -> Callable[[str, str], float]:
    """Recompute seconds as fractions of each plain step, summed (else TFLOP), plus a hair per recompute (ties)."""
    tie = 1e-5
    if all(p.step_time_s > 0 for p in profiles):
        return lambda u, c: sum(p.cost(u, c).time_s / p.step_time_s for p in profiles) + tie * (c != PLAIN)
    return lambda u, c: profiles[0].cost(u, c).flops / 1e12 + tie * (c != PLAIN)


def _list(profiles: Profile | Sequence[Profile]) -> list[Profile]:
    return [profiles] if isinstance(profiles, Profile) else list(profiles)


def _cheapest(
    profiles: list[Profile], spec: StepSpec, budget_bytes: int, exclude: Sequence[Assignment] = ()
) -> dict[str, str] | None:
    """The least-cost assignment, not in ``exclude``, whose predicted peaks fit ``budget_bytes``; None if none."""
    if any(p.opt_peak * p.scale > budget_bytes + 0.5 for p in profiles):
        return None
    prog = _Programme(profiles, spec)
    objective = _objective(profiles)
    cost = np.array([objective(u, c) for u, c in prog.cols])
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
    cost = np.r_[np.full(len(prog.cols), 1e-9), 1.0]  # the peak column; a hair per choice
    x = prog.solve(cost, [0.0] * len(profiles), peak_col=True)
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
