"""Recompute seconds from FLOPs and bytes, at stated rates.

A recompute redoes its unit's conv/matmul/attention FLOPs and, for the elementwise work those
FLOPs do not count (norms, activations), writes the bytes the unit no longer keeps and reads them
back. So a choice costs ``flops * per_flop + 2 * (plain keep - keep) * per_byte`` seconds.

The shapes-only profile takes the rates as stated (`at_stated_rates`); the JAX
profile takes FLOPs at its plain step's own throughput and no byte term (`jax_impl.profile`
says why its measured steps price nothing).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from shared_configs.planning.budget import PLAIN, Cost, Profile, block_layers, leaf_units
from shared_configs.planning.unit_flops import unit_flops
from shared_configs.spec import UNetSpec

Units = Mapping[str, Mapping[str, Cost]]


def plain_keeps(spec: UNetSpec, units: Units) -> dict[str, int]:
    """What each unit keeps when plain (a block: its layers and sampler)."""
    out = {u: per[PLAIN].keep for u, per in units.items() if PLAIN in per}
    for block, layers in block_layers(spec).items():
        out[block] = sum(out[n] for n in layers)
    return out


def step_flops(spec: UNetSpec, flops: Mapping[str, Mapping[str, float]]) -> float:
    """The plain step's FLOPs from `unit_flops`: three forwards (the backward costs about two)."""
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


def at_stated_rates(
    profile: Profile, spec: UNetSpec, batch_size: int, context_length: int, flops_per_s: float, bytes_per_s: float
) -> Profile:
    """A shapes-only profile with time estimated at stated rates: FLOPs at ``flops_per_s``,
    elementwise bytes at ``bytes_per_s`` (`at_rates`). The plain step is three forwards' FLOPs (the
    backward costs about two) plus writing and reading what it keeps."""
    units = at_rates(spec, profile.units, 1 / flops_per_s, 1 / bytes_per_s)
    flops = unit_flops(spec, batch_size, context_length)
    plain = plain_keeps(spec, profile.units)
    step = step_flops(spec, flops) / flops_per_s + 2 * sum(plain[u] for u, _ in leaf_units(spec, {})) / bytes_per_s
    return replace(profile, units=units, flops_per_s=flops_per_s, step_time_s=step)
