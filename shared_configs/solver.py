"""The cheapest plan under a memory budget, exactly: a dynamic programme over the units.

The peak model (`shared_configs.budget.predict`) is a walk over the units in forward order with
one running quantity per framework, the bytes kept so far (K). A unit under a choice is feasible
when ``K + max(fwd_peak, bwd_peak)`` fits, and adds its ``keep`` to K and its recompute time to
the cost. So a partial plan is summed up by (K..., cost), and one that another beats on every
term can never be completed more cheaply: keeping, after each unit, only the partial plans no
other beats (a Pareto front) loses no optimum. Blocks branch: recomputed whole (one unit) or layer
by layer (their layers in turn). With several profiles (torch and JAX) the plan must fit in each;
the cost is the sum of their recompute times as fractions of each plain step. The same walk with
the running peak as the cost gives the smallest budget any plan fits (`smallest_peak`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shared_configs.budget import (
    HEAD,
    PLAIN,
    STEM,
    Prediction,
    Profile,
    block_layers,
    is_pseudo,
    policy_string,
    predict,
)
from shared_configs.spec import SpecError, UNetSpec

# A partial plan: (kept bytes per profile, cost, choices as a linked list ((unit, choice), parent))
State = tuple[tuple[int, ...], float, tuple | None]
Step = Callable[[State, str, str], State | None]
MIB = 2**20


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
        self.smallest = smallest


def _front(states: list[State]) -> list[State]:
    """The states no other beats on every kept term and on cost (one or two kept terms)."""
    states.sort(key=lambda s: (s[0], s[1]))
    out: list[State] = []
    if states and len(states[0][0]) == 1:
        best = math.inf
        for s in states:
            if s[1] < best:
                out.append(s)
                best = s[1]
        return out
    stair: list[tuple[int, float]] = []  # (second kept, cost): kept ascending, cost descending
    for s in states:
        k2, cost = s[0][1], s[1]
        i = bisect.bisect_right(stair, (k2, math.inf))
        if i and stair[i - 1][1] <= cost:
            continue  # an earlier state keeps no more of either and costs no more
        out.append(s)
        lo = j = bisect.bisect_left(stair, (k2, -math.inf))
        while j < len(stair) and stair[j][1] >= cost:  # points it now beats
            j += 1
        stair[lo:j] = [(k2, cost)]
    return out


def _walk(profiles: Sequence[Profile], spec: UNetSpec, step: Step) -> list[State]:
    """Complete plans on the front, after every unit of ``spec`` has been stepped through."""

    def advance(states: list[State], unit: str, choices: tuple[str, ...]) -> list[State]:
        return _front([new for s in states for c in choices if (new := step(s, unit, c)) is not None])

    def choices(unit: str) -> tuple[str, ...]:
        return tuple(c for c in profiles[0].units[unit] if all(c in p.units[unit] for p in profiles))

    states = advance([((0,) * len(profiles), 0.0, None)], STEM, (PLAIN,))
    for block, layers in block_layers(spec).items():
        whole = advance(states, block, tuple(c for c in choices(block) if c != PLAIN))
        for name in layers:
            states = advance(states, name, (PLAIN,) if is_pseudo(name) else choices(name))
        states = _front(whole + states)
    return advance(states, HEAD, (PLAIN,))


def _assignment(path: tuple | None) -> dict[str, str]:
    out: dict[str, str] = {}
    while path is not None:
        (unit, choice), path = path
        if choice != PLAIN:
            out[unit] = choice
    return dict(reversed(out.items()))


def _objective(profiles: Sequence[Profile]) -> Callable[[str, str], float]:
    """Recompute seconds as fractions of each plain step, summed; FLOPs where a profile has no times."""
    if all(p.step_time_s > 0 for p in profiles):
        return lambda u, c: sum(p.cost(u, c).time_s / p.step_time_s for p in profiles)
    return lambda u, c: profiles[0].cost(u, c).flops


def _cheapest(profiles: Sequence[Profile], spec: UNetSpec, budget_bytes: int) -> dict[str, str] | None:
    """The least-cost assignment whose predicted peaks are all at most ``budget_bytes``, or None."""
    limits = [(budget_bytes + 0.5) / p.scale for p in profiles]  # predict() rounds peak * scale
    objective = _objective(profiles)

    def step(state: State, unit: str, choice: str) -> State | None:
        kept, cost, path = state
        costs = [p.cost(unit, choice) for p in profiles]
        if any(k + max(c.fwd_peak, c.bwd_peak) > lim for k, c, lim in zip(kept, costs, limits, strict=True)):
            return None
        new = tuple(k + c.keep for k, c in zip(kept, costs, strict=True))
        return new, cost + objective(unit, choice), ((unit, choice), path)

    if any(p.opt_peak > lim for p, lim in zip(profiles, limits, strict=True)):
        return None
    done = _walk(profiles, spec, step)
    return _assignment(min(done, key=lambda s: s[1])[2]) if done else None


def solve(profiles: Profile | Sequence[Profile], spec: UNetSpec, budget_bytes: int) -> Solution:
    """The plan of least recompute time whose predicted peak fits ``budget_bytes`` (in every profile).

    Raises `Infeasible` (naming the smallest feasible budget) when none fits.
    """
    profiles = [profiles] if isinstance(profiles, Profile) else list(profiles)
    assignment = _cheapest(profiles, spec, budget_bytes)
    if assignment is None:
        raise Infeasible(budget_bytes, max(p.peak_bytes for p in smallest_peak(profiles, spec).predictions))
    return _solution(profiles, spec, assignment)


def smallest_peak(profiles: Profile | Sequence[Profile], spec: UNetSpec) -> Solution:
    """The plan of least predicted peak (the largest over the profiles); of those, the cheapest."""
    profiles = [profiles] if isinstance(profiles, Profile) else list(profiles)

    def step(state: State, unit: str, choice: str) -> State:
        kept, peak, path = state
        costs = [p.cost(unit, choice) for p in profiles]
        here = max((k + max(c.fwd_peak, c.bwd_peak)) * p.scale for k, c, p in zip(kept, costs, profiles, strict=True))
        new = tuple(k + c.keep for k, c in zip(kept, costs, strict=True))
        return new, max(peak, here), ((unit, choice), path)

    lowest = min(_walk(profiles, spec, step), key=lambda s: s[1])
    floor = max(predict(p, spec, _assignment(lowest[2])).peak_bytes for p in profiles)
    assignment = _cheapest(profiles, spec, floor)
    assert assignment is not None  # the lowest plan itself fits its own peak
    return _solution(profiles, spec, assignment)


def _solution(profiles: Sequence[Profile], spec: UNetSpec, assignment: dict[str, str]) -> Solution:
    predictions = tuple(predict(p, spec, assignment) for p in profiles)
    return Solution(assignment, predictions, policy_string(assignment))
