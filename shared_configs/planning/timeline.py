"""One training step's memory over time, filed by unit: the measurement the profile is made of.

Both profilers reduce what they see to a `Timeline` (positions, the unit and phase at each, every
buffer's first and last position and size); `unit_costs` turns it into the per-unit figures of
`shared_configs.planning.budget.Cost`, one definition for both frameworks. What a unit *keeps* and
*holds*, K(u), H(u), ``fwd_peak`` and ``bwd_peak``: docs/planning.md "The profile", "The peak model".
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from shared_configs.planning.budget import PROFILE_RUNS, Cost
from shared_configs.planning.unit_flops import recompute_flops, unit_flops
from shared_configs.planning.units import PLAIN, StepSpec, uniform

FWD, BWD, OPT = "fwd", "bwd", "opt"


@dataclass(frozen=True)
class Timeline:
    units: list[str]  # the unit running at each position
    phases: list[str]  # fwd | bwd | opt at each position
    starts: np.ndarray  # per buffer: first position alive
    ends: np.ndarray  # per buffer: last position alive (len(units) - 1 or more: to the end)
    sizes: np.ndarray  # per buffer: bytes
    static: np.ndarray  # per buffer: True for what exists before the step (parameters, state, inputs)

    def levels(self) -> np.ndarray:
        """Live bytes at every position."""
        n = len(self.units)
        delta = np.zeros(n + 1, np.int64)
        np.add.at(delta, np.minimum(self.starts, n - 1), self.sizes)
        np.add.at(delta, np.minimum(self.ends, n - 1) + 1, -self.sizes)
        return np.cumsum(delta[:-1])

    def split(self) -> int:
        """The first backward position (the end if there is none)."""
        return next((i for i, p in enumerate(self.phases) if p == BWD), len(self.phases))


def profile_assignments(spec: StepSpec) -> list[dict[str, str]]:
    """The uniform plans a profile measures, in `PROFILE_RUNS`' order (the plain one first, ``{}``)."""
    return [{} if choice == PLAIN else uniform(spec, choice, level) for choice, level in PROFILE_RUNS]


def filed_units(
    spec: StepSpec,
    batch_size: int,
    context_length: int,
    assignments: list[dict[str, str]],
    costs: list[dict[str, Cost]],
) -> dict[str, dict[str, Cost]]:
    """Per unit and choice, the `Cost` of the run that measured that choice, with its recompute FLOPs."""
    flops = unit_flops(spec, batch_size, context_length)
    units: dict[str, dict[str, Cost]] = {}
    for (choice, _), assignment, per_unit in zip(PROFILE_RUNS, assignments, costs, strict=True):
        for unit, cost in per_unit.items():
            if assignment.get(unit, PLAIN) == choice:
                units.setdefault(unit, {})[choice] = replace(cost, flops=recompute_flops(flops[unit], choice))
    return units


def unit_costs(timeline: Timeline, leaves: list[str]) -> tuple[dict[str, Cost], int, int]:
    """Per leaf unit (forward order) its `Cost` (bytes only); the optimizer's peak; the step's peak."""
    levels = timeline.levels()
    n, split = len(levels), timeline.split()
    phases = np.array([p if p == OPT else FWD if i < split else BWD for i, p in enumerate(timeline.phases)])
    units = np.array(timeline.units)
    across = (timeline.starts < split) & (timeline.ends >= split) & (timeline.ends < n - 1) & ~timeline.static
    owners, sizes = units[np.minimum(timeline.ends[across], n - 1)], timeline.sizes[across]
    last = int(next(iter(np.flatnonzero(units[:split] == leaves[-1])), split))  # the last unit's forward start
    held = (timeline.starts < last) & (timeline.ends >= last) & (timeline.ends < split) & ~timeline.static
    makers, held_sizes = units[timeline.starts[held]], timeline.sizes[held]
    costs, before, before_held = {}, 0, 0
    for unit in leaves:
        keep = int(sizes[owners == unit].sum())
        hold = int(held_sizes[makers == unit].sum())
        mine = units == unit
        fwd = levels[mine & (phases == FWD)]
        bwd = levels[mine & (phases == BWD)]
        # A unit with no position of a phase (all its work fused elsewhere) bounds nothing there.
        costs[unit] = Cost(
            keep=keep,
            fwd_peak=int(fwd.max()) - before - before_held if fwd.size else -before - before_held,
            bwd_peak=int(bwd.max()) - before if bwd.size else -before,
            hold=hold,
        )
        before += keep
        before_held += hold
    opt = levels[phases == OPT]
    return costs, int(opt.max()) if opt.size else 0, int(levels.max())
