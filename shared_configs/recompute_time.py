"""Recompute seconds from FLOPs and bytes, at rates that are stated or fitted to measured steps.

A recompute redoes its unit's conv/matmul/attention FLOPs and, for the elementwise work those
FLOPs do not count (norms, activations), writes the bytes the unit no longer keeps and reads them
back. So a choice costs ``flops * per_flop + 2 * (plain keep - keep) * per_byte`` seconds.

The shapes-only profile takes the rates as stated (`benchmarks.planner.with_flop_time`). The JAX
profile fits them to its own measured steps (`fit_rates`): each uniform plan's step minus the plain
step is recompute time, and a non-negative least-squares fit over those differences gives the two
rates (or, where it finds recompute free, the plain step's FLOP throughput). A unit's share then
follows its FLOPs and bytes, where per-op timing of one XLA:CPU run is too noisy to split a few
percent of the step between units.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np
from scipy.optimize import nnls

from shared_configs.budget import PLAIN, Assignment, Cost, block_layers, leaf_units
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


def fit_rates(
    spec: UNetSpec, units: Units, runs: Sequence[tuple[Assignment, float]], plain_step: tuple[float, float]
) -> tuple[float, float, str]:
    """Seconds per FLOP and per byte (both >= 0) that best explain ``runs``: (plan, its measured
    step minus the plain step); columns are scaled to one before the fit (FLOPs outnumber bytes).
    Where the fit finds FLOPs free (the recompute drowned in noise, or remat steps ran faster than
    the plain one), the plain step's own throughput instead: ``plain_step`` is (its seconds, its
    FLOPs). The third value names which."""
    plain = plain_keeps(spec, units)
    rows = [
        np.sum([work(units[u][c], plain[u]) for u, c in leaf_units(spec, assignment)], axis=0) for assignment, _ in runs
    ]
    a = np.array(rows, float).reshape(len(runs), 2)
    norm = np.where(a.max(axis=0) > 0, a.max(axis=0), 1.0)
    x, _ = nnls(a / norm, np.array([extra for _, extra in runs], float))
    per_flop, per_byte = x / norm
    if per_flop > 0:
        return float(per_flop), float(per_byte), "fitted to the profile runs"
    seconds, flops = plain_step
    return seconds / flops, 0.0, "the plain step's FLOP throughput (the fit found recompute free)"
