"""The cheapest plan under a memory budget, exactly: a dynamic programme over the units.

The peak model (`shared_configs.budget.predict`) is a walk over the units in forward order with
one running quantity, the bytes kept so far (K). A unit under a choice is feasible when
``K + max(fwd_peak, bwd_peak)`` fits, and adds its ``keep`` to K and its recompute time to the
cost. So a partial plan is summed up by (K, cost), and one with both larger than another's can
never be completed more cheaply: keeping, after each unit, only the partial plans that no other
beats on both (a Pareto front) loses no optimum. Blocks branch: recomputed whole (one unit) or
layer by layer (their layers in turn). The same walk with the running peak as the cost gives
the smallest budget any plan fits (`smallest_peak`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
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

# A partial plan: (kept bytes, cost, choices as a linked list ((unit, choice), parent) or None)
State = tuple[int, float, tuple | None]
Step = Callable[[State, str, str], State | None]


@dataclass(frozen=True)
class Solution:
    assignment: dict[str, str]
    prediction: Prediction
    policy: str


class Infeasible(SpecError):
    """No plan fits; ``smallest`` is the smallest budget (bytes) one does."""

    def __init__(self, budget: int, smallest: int) -> None:
        mib = 2**20
        super().__init__(
            f"budget: no plan fits {budget / mib:.1f} MiB; the smallest feasible budget is "
            f"{math.ceil(smallest / mib)} MiB ({smallest} bytes)"
        )
        self.smallest = smallest


def _front(states: list[State]) -> list[State]:
    """The partial plans no other beats on both kept bytes and cost."""
    out: list[State] = []
    best = math.inf
    for state in sorted(states, key=lambda s: (s[0], s[1])):
        if state[1] < best:
            out.append(state)
            best = state[1]
    return out


def _walk(profile: Profile, spec: UNetSpec, step: Step) -> list[State]:
    """Complete plans on the front, after every unit of ``spec`` has been stepped through."""

    def advance(states: list[State], unit: str, choices: tuple[str, ...]) -> list[State]:
        nxt = [new for s in states for c in choices if (new := step(s, unit, c)) is not None]
        return _front(nxt)

    states = advance([(0, 0.0, None)], STEM, (PLAIN,))
    for block, layers in block_layers(spec).items():
        options = [] if not states else advance(states, block, tuple(c for c in profile.units[block] if c != PLAIN))
        layer_states = states
        for name in layers:
            choices = (PLAIN,) if is_pseudo(name) else tuple(profile.units[name])
            layer_states = advance(layer_states, name, choices)
        states = _front(options + layer_states)
    return advance(states, HEAD, (PLAIN,))


def _assignment(path: tuple | None) -> dict[str, str]:
    out: dict[str, str] = {}
    while path is not None:
        (unit, choice), path = path
        if choice != PLAIN:
            out[unit] = choice
    return dict(reversed(out.items()))


def _seconds_or_flops(profile: Profile) -> Callable[[str, str], float]:
    """The objective: measured recompute seconds, or FLOPs where a profile has no times (shapes)."""
    timed = any(c.time_s > 0 for per in profile.units.values() for c in per.values())
    if timed:
        return lambda u, c: profile.cost(u, c).time_s
    return lambda u, c: profile.cost(u, c).flops


def _cheapest(profile: Profile, spec: UNetSpec, budget_bytes: int) -> dict[str, str] | None:
    """The least-cost assignment whose predicted peak is at most ``budget_bytes``, or None."""
    limit = (budget_bytes + 0.5) / profile.scale  # predict() rounds peak * scale
    objective = _seconds_or_flops(profile)

    def step(state: State, unit: str, choice: str) -> State | None:
        kept, cost, path = state
        c = profile.cost(unit, choice)
        if kept + max(c.fwd_peak, c.bwd_peak) > limit:
            return None
        return kept + c.keep, cost + objective(unit, choice), ((unit, choice), path)

    done = _walk(profile, spec, step) if profile.opt_peak <= limit else []
    return _assignment(min(done, key=lambda s: s[1])[2]) if done else None


def solve(profile: Profile, spec: UNetSpec, budget_bytes: int) -> Solution:
    """The plan of least recompute time whose predicted peak fits ``budget_bytes``.

    Raises `Infeasible` (naming the smallest feasible budget) when none fits.
    """
    assignment = _cheapest(profile, spec, budget_bytes)
    if assignment is None:
        raise Infeasible(budget_bytes, smallest_peak(profile, spec).prediction.peak_bytes)
    return _solution(profile, spec, assignment)


def smallest_peak(profile: Profile, spec: UNetSpec) -> Solution:
    """The plan of least predicted peak; of those, the cheapest."""

    def step(state: State, unit: str, choice: str) -> State:
        kept, peak, path = state
        c = profile.cost(unit, choice)
        return kept + c.keep, max(peak, kept + max(c.fwd_peak, c.bwd_peak)), ((unit, choice), path)

    lowest = min(_walk(profile, spec, step), key=lambda s: s[1])
    floor = predict(profile, spec, _assignment(lowest[2])).peak_bytes
    assignment = _cheapest(profile, spec, floor)
    assert assignment is not None  # the lowest plan itself fits its own peak
    return _solution(profile, spec, assignment)


def _solution(profile: Profile, spec: UNetSpec, assignment: dict[str, str]) -> Solution:
    return Solution(assignment, predict(profile, spec, assignment), policy_string(assignment))
