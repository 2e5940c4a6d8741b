"""Recompute seconds from FLOPs and bytes at stated rates (``flops * per_flop + 2 * (plain keep - keep) *
per_byte``, and weights cast again in mixed precision), and the plain step in its regime (`step_seconds`). The
formula and what it leaves out: docs/regimes.md "A step's time follows its regime".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from shared_configs.pair import ControlNetPairSpec
from shared_configs.planning.budget import Cost, Profile
from shared_configs.planning.unit_flops import pair_step_flops, pair_weights, recompute_flops, unit_flops, unit_weights
from shared_configs.planning.unit_flops import step_flops as counted_step_flops
from shared_configs.planning.units import PLAIN, StepSpec, block_layers, leaf_units
from shared_configs.regime import DEFAULT, Regime
from shared_configs.spec import UNetSpec

Units = Mapping[str, Mapping[str, Cost]]

# Bytes per 8-bit AdamW moment value: a uint8 code and a float32 scale per 256-value block
# (`shared_configs.regime.state_bytes`; the 1 KiB code map per tensor left out).
_ADAMW8BIT_MOMENT = 1 + 4 / 256


def update_bytes(regime: Regime, trained: int) -> float:
    """Bytes the optimizer step (and an EMA update) read and write for ``trained`` weights of p bytes each
    (docs/regimes.md): AdamW 7p, 8-bit AdamW 3p and its moments, Adafactor 3p (its factors left out), EMA 8 + p."""
    p = 2 if regime.param_dtype == "bfloat16" else 4
    per = {"adamw": 7 * p, "adamw8bit": 3 * p + 2 * 2 * _ADAMW8BIT_MOMENT, "adafactor": 3 * p}
    return (per[regime.optimizer] + (8 + p if regime.ema else 0)) * trained


def cast_bytes(regime: Regime, weights: int) -> float:
    """Autocast's weight casts in a mixed-precision forward: each float32 weight read and its 16-bit copy written."""
    return 6.0 * weights if regime.compute_dtype is not None and regime.param_dtype == "float32" else 0.0


def step_flops(
    spec: UNetSpec | ControlNetPairSpec, batch_size: int, context_length: int = 77, regime: Regime = DEFAULT
) -> float:
    """The plain step's FLOPs in ``regime`` (`unit_flops.step_flops`, `unit_flops.pair_step_flops`)."""
    if isinstance(spec, ControlNetPairSpec):
        return pair_step_flops(spec, batch_size, context_length)
    return counted_step_flops(spec, batch_size, context_length, regime.lora_rank).total


def step_seconds(
    spec: UNetSpec | ControlNetPairSpec,
    batch_size: int,
    context_length: int,
    regime: Regime,
    kept: float,
    flops_per_s: float,
    bytes_per_s: float,
) -> float:
    """The plain step's seconds at the stated rates (the module's formula); ``kept``: the bytes its forward keeps."""
    if isinstance(spec, ControlNetPairSpec):
        (trained, weights), flops = pair_weights(spec), pair_step_flops(spec, batch_size, context_length)
    else:
        counted = counted_step_flops(spec, batch_size, context_length, regime.lora_rank)
        trained, weights, flops = counted.trained_weights, counted.weights, counted.total
    nbytes = 2 * kept + update_bytes(regime, trained) + cast_bytes(regime, weights)
    return flops / flops_per_s + nbytes / bytes_per_s


def plain_keeps(spec: StepSpec, units: Units) -> dict[str, int]:
    """What each unit keeps when plain (a block: its layers and sampler)."""
    out = {u: per[PLAIN].keep for u, per in units.items() if PLAIN in per}
    for block, layers in block_layers(spec).items():
        out[block] = sum(out[n] for n in layers)
    return out


def at_rates(spec: StepSpec, units: Units, per_flop: float, per_byte: float) -> dict[str, dict[str, Cost]]:
    """``units`` with each choice's ``time_s`` its work at the given seconds per FLOP and per byte."""
    plain = plain_keeps(spec, units)

    def seconds(cost: Cost, unit: str) -> float:  # its recompute FLOPs; the bytes it no longer keeps, written and read
        return cost.flops * per_flop + 2.0 * max(plain[unit] - cost.keep, 0) * per_byte

    return {u: {c: replace(v, time_s=seconds(v, u)) for c, v in per.items()} for u, per in units.items()}


def with_adapters(units: Units, spec: UNetSpec, batch_size: int, context_length: int, rank: int | None) -> Units:
    """``units`` whose recompute FLOPs include the LoRA adapters' forward (a recompute redoes them too)."""
    if rank is None:
        return units
    flops = unit_flops(spec, batch_size, context_length, rank)
    return {
        u: {c: replace(v, flops=recompute_flops(flops[u], c)) if u in flops else v for c, v in per.items()}
        for u, per in units.items()
    }


def with_recasts(
    units: Units, spec: UNetSpec | ControlNetPairSpec, regime: Regime, bytes_per_s: float
) -> dict[str, dict[str, Cost]]:
    """``units`` whose mixed-precision recomputes pay `cast_bytes` again (a fresh autocast has an empty cache)."""
    weights = unit_weights(spec)
    recast = {
        u: {
            c: cast_bytes(regime, round(recompute_flops(weights[u], c))) / bytes_per_s if u in weights else 0.0
            for c in per
        }
        for u, per in units.items()
    }
    return {u: {c: replace(v, time_s=v.time_s + recast[u][c]) for c, v in per.items()} for u, per in units.items()}


def at_stated_rates(
    profile: Profile,
    spec: UNetSpec | ControlNetPairSpec,
    batch_size: int,
    context_length: int,
    flops_per_s: float,
    bytes_per_s: float,
    regime: Regime,
) -> Profile:
    """A shapes-only profile timed at stated rates (`at_rates`), its plain step `step_seconds` in ``regime``."""
    units = with_adapters(profile.units, spec, batch_size, context_length, regime.lora_rank)
    units = at_rates(spec, units, 1 / flops_per_s, 1 / bytes_per_s)
    units = with_recasts(units, spec, regime, bytes_per_s)
    kept = sum(plain_keeps(spec, profile.units)[u] for u, _ in leaf_units(spec, {}))
    step = step_seconds(spec, batch_size, context_length, regime, kept, flops_per_s, bytes_per_s)
    return replace(profile, units=units, flops_per_s=flops_per_s, step_time_s=step)
