"""Recompute seconds from FLOPs and bytes, at rates that are stated or fitted to measured steps.

A recompute redoes its unit's conv/matmul/attention FLOPs and, for the elementwise work those
FLOPs do not count (norms, activations), writes the bytes the unit no longer keeps and reads them
back. So a choice costs ``flops * per_flop + 2 * (plain keep - keep) * per_byte`` seconds.

The shapes-only profile takes the rates as stated (`benchmarks.planner.with_flop_time`). The JAX
profile measures its uniform plans instead (four are hand policies: ``full``, ``save_convs``,
``layers``, ``layers/save=conv,matmul``) and prices each unit's choice at its share of what its
uniform plan measured beyond the plain step (`split_measured`). Per-op timing of one XLA:CPU run is
too noisy to split a few percent of the step between units; and a measured extra may be negative:
on XLA:CPU a step that keeps less allocates less, and can run faster than the plain one. The
uniform plans are then priced at exactly what they measured, so the solver ranks its plans against
the hand policies by the same measurements.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from shared_configs.budget import FULL, PLAIN, Assignment, Cost, block_layers, leaf_units
from shared_configs.spec import UNetSpec

Units = Mapping[str, Mapping[str, Cost]]


def plain_keeps(spec: UNetSpec, units: Units) -> dict[str, int]:
    """What each unit keeps when plain (a block: its layers and sampler)."""
    out = {u: per[PLAIN].keep for u, per in units.items() if PLAIN in per}
    for block, layers in block_layers(spec).items():
        out[block] = sum(out[n] for n in layers)
    return out


def step_flops(spec: UNetSpec, flops: Mapping[str, Mapping[str, float]]) -> float:
    """The plain step's FLOPs from `shared_configs.unit_flops`: three forwards (the backward costs about two)."""
    return 3 * sum(sum(flops[u].values()) for u, _ in leaf_units(spec, {}))


def work(cost: Cost, plain_keep: int) -> tuple[float, float]:
    """(FLOPs, bytes) a choice redoes: its recompute FLOPs; the bytes it no longer keeps, written and read."""
    return cost.flops, 2.0 * max(plain_keep - cost.keep, 0)


def at_rates(spec: UNetSpec, units: Units, per_flop: float, per_byte: float) -> dict[str, dict[str, Cost]]:
    """``units`` with each choice's ``time_s`` its work at the given seconds per FLOP and per byte."""
    plain = plain_keeps(spec, units)

    def seconds(cost: Cost, unit: str) -> float:
        flops, nbytes = work(cost, plain[unit])
        return flops * per_flop + nbytes * per_byte

    return {u: {c: replace(v, time_s=seconds(v, u)) for c, v in per.items()} for u, per in units.items()}


def split_measured(
    spec: UNetSpec, units: Units, runs: Sequence[tuple[Assignment, float]]
) -> dict[str, dict[str, Cost]]:
    """``units`` with each recompute choice's ``time_s`` its share of the measured extra seconds of the
    run that measured it (``runs``: a uniform plan, its step minus the plain step; any sign). A full
    recompute's share follows its FLOPs; a selective one's the bytes it no longer keeps (it redoes
    only elementwise work); equal shares where those are all nil."""
    out = {u: dict(per) for u, per in units.items()}
    plain = plain_keeps(spec, units)
    for assignment, extra in runs:
        members = [(u, c) for u, c in leaf_units(spec, assignment) if c != PLAIN]
        weights = np.array([work(units[u][c], plain[u])[c != FULL] for u, c in members], float)
        if weights.sum() <= 0:
            weights = np.ones(len(members))
        for (u, c), share in zip(members, weights / weights.sum(), strict=True):
            out[u][c] = replace(out[u][c], time_s=extra * float(share))
    return out
