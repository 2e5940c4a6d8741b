"""Planning to a memory budget, framework-free: the per-unit profile and the peak model.

A plan gives each unit (`shared_configs.planning.units`) a choice. The `Profile` holds per unit and choice the
bytes measured in a step whose units all had it (`Cost`), and the peaks no plan changes; `predict` walks a
plan's units in forward order::

    peak = scale * max(optimizer and phase peaks, max over u of max(K(u) + H(u) + fwd_peak(u), K(u) + bwd_peak(u)))

K(u) and H(u): the keep and hold of the units before u. docs/planning.md "The profile", "The peak model".
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from shared_configs.files import json_digest, locked, write_sealed
from shared_configs.planning.units import (
    CHOICES,
    FULL,
    PLAIN,
    SELECTIVE,
    Assignment,
    StepSpec,
    assignment_of,
    block_layers,
    is_pseudo,
    leaf_units,
)
from shared_configs.spec import SpecError

# The uniform plans a profile measures, (choice, level): together they give every (unit, choice).
PROFILE_RUNS = ((PLAIN, "layers"), (FULL, "blocks"), (SELECTIVE, "blocks"), (FULL, "layers"), (SELECTIVE, "layers"))
# Raised whenever a profile's figures change meaning (9: torch prices recompute by the unit's forward seconds).
SCHEMA = 9


@dataclass(frozen=True)
class Cost:
    """One unit under one choice (bytes, seconds, FLOPs), measured in a step where every unit had it."""

    keep: int
    fwd_peak: int
    bwd_peak: int
    time_s: float = 0.0  # recompute time paid in the backward (0 for plain)
    flops: float = 0.0  # recompute FLOPs (conv, matmul, attention)
    hold: int = 0  # bytes its forward leaves alive to the end of the forward only (autocast's weight casts)


@dataclass(frozen=True)
class Profile:
    """A framework's per-unit costs for one (spec, batch size, sample size), as JSON."""

    framework: str
    config: str
    sample_size: int
    batch_size: int
    units: dict[str, dict[str, Cost]]
    opt_peak: int  # the optimizer step's peak (no activations left by then)
    step_time_s: float  # the plain step (the reference of every overhead)
    scale: float = 1.0  # measured peak / modelled live bytes (JAX: buffer packing), mean of the profile runs
    mode: str = "measured"  # or "shapes": bytes from shapes, time from FLOPs at `flops_per_s`
    flops_per_s: float | None = None
    context_length: int = 77
    attention_chunk: int | None = None
    regime: str = "fp32, all weights trained, adamw"  # `Regime.describe` of the step profiled
    # What FSDP shards (`per_rank`): parameters + optimizer state, the gradients, the largest block's parameters.
    static_bytes: int = 0
    grad_bytes: int = 0
    block_param_bytes: int = 0
    meta: dict[str, Any] = field(default_factory=dict)  # method, versions, load, profile runs
    # Peaks outside the units that no plan changes, by name ("optimizer", "vae encode", ...): `opt_peak`
    # is their largest (`shared_configs.planning.encoders.whole_step`); empty: the optimizer's alone.
    phases: dict[str, int] = field(default_factory=dict)

    def cost(self, unit: str, choice: str) -> Cost:
        try:
            return self.units[unit][choice]
        except KeyError:
            raise SpecError(f"profile: no figures for {unit!r} under {choice!r} (profiled: {self.choices})") from None

    @property
    def choices(self) -> tuple[str, ...]:
        return tuple(c for c in CHOICES if any(c in per for per in self.units.values()))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Profile:
        data = {k: v for k, v in data.items() if k not in ("sha256", "schema")}  # both checked by `load`
        units = {u: {c: Cost(**v) for c, v in per.items()} for u, per in data.pop("units").items()}
        return cls(units=units, **data)

    def save(self, path: str | Path) -> None:
        """``path``, atomically (a kill leaves the old file or the new one), with the SHA-256 of its body."""
        write_sealed(path, {"schema": SCHEMA, **asdict(self)})

    @classmethod
    def load(cls, path: str | Path, expect: Mapping[str, Any] | None = None) -> Profile:
        """The profile in ``path`` holding ``expect``'s values; a one-line `ProfileError` for any file that is not."""
        try:
            data = json.loads(Path(path).read_bytes())
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise ProfileError(f"{path}: unreadable ({err})") from None
        body = {k: v for k, v in data.items() if k != "sha256"}
        if "sha256" in data and data["sha256"] != json_digest(body):
            raise ProfileError(f"{path}: damaged (its contents do not match its own SHA-256)")
        if data.get("schema") != SCHEMA:
            raise ProfileError(f"{path}: profile schema {data.get('schema')!r}, this version reads {SCHEMA}")
        if wrong := [f"{k} {data.get(k)!r} (wanted {v!r})" for k, v in (expect or {}).items() if data.get(k) != v]:
            raise ProfileError(f"{path}: the profile of another workload: {', '.join(wrong)}")
        try:
            return cls.from_json(data)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ProfileError(f"{path}: not a profile ({type(err).__name__}: {err})") from None


class ProfileError(SpecError):
    """A cached profile that cannot be used: one line naming the file and why."""


def cached_profile(path: Path, expect: Mapping[str, Any], make: Callable[[], Profile]) -> Profile:
    """The profile cached in ``path`` (processes take turns), else ``make()``'s, cached there."""
    with locked(path):
        if path.is_file():
            try:
                return Profile.load(path, expect)
            except ProfileError as err:
                print(f"note: {err}; profiling again", file=sys.stderr)
        profile = make()
        profile.save(path)
        return profile


@dataclass(frozen=True)
class Prediction:
    """What the model says of a plan: peak bytes (and where), recompute seconds and FLOPs."""

    peak_bytes: int
    peak_unit: str
    time_s: float
    flops: float

    def overhead(self, profile: Profile) -> float:
        """Recompute time as a fraction of the plain step."""
        return self.time_s / profile.step_time_s if profile.step_time_s else float("nan")


def predict(profile: Profile, spec: StepSpec, assignment: Assignment) -> Prediction:
    """Peak bytes, recompute seconds and FLOPs of ``assignment`` (see the module doc)."""
    where = max(profile.phases, key=profile.phases.__getitem__) if profile.phases else "optimizer"
    kept, held, peak, seconds, flops = 0, 0, profile.opt_peak, 0.0, 0.0
    for unit, choice in leaf_units(spec, assignment):
        c = profile.cost(unit, choice)
        here = kept + max(held + c.fwd_peak, c.bwd_peak)
        if here > peak:
            peak, where = here, unit
        kept += c.keep
        held += c.hold
        seconds += c.time_s
        flops += c.flops
    return Prediction(round(peak * profile.scale), where, seconds, flops)


def raised(units: Mapping[str, Mapping[str, Cost]], delta: int) -> dict[str, dict[str, Cost]]:
    """``units`` with every forward and backward peak ``delta`` bytes higher."""
    return {
        u: {c: replace(v, fwd_peak=v.fwd_peak + delta, bwd_peak=v.bwd_peak + delta) for c, v in per.items()}
        for u, per in units.items()
    }


def with_static_bytes(profile: Profile, delta: int) -> Profile:
    """``profile`` with ``delta`` more bytes alive throughout the step (a modelled optimizer state)."""
    units = raised(profile.units, delta)
    opt_peak = profile.opt_peak + delta if profile.opt_peak else 0
    phases = {k: v + delta for k, v in profile.phases.items()}
    return replace(profile, units=units, opt_peak=opt_peak, static_bytes=profile.static_bytes + delta, phases=phases)


DISTRIBUTED: tuple[str, ...] = ("ddp", "fsdp")


def per_rank(profile: Profile, world_size: int = 1, distributed: str = "ddp") -> Profile:
    """The profile of one of ``world_size`` ranks, each training ``profile.batch_size`` samples (DDP: as it is;
    FSDP: every peak less (1 - 1/N) of the sharded bytes but the largest block's, gathered while it runs)."""
    if distributed not in DISTRIBUTED:
        raise SpecError(f"--distributed: expected one of {', '.join(DISTRIBUTED)}, got {distributed!r}")
    if world_size < 1:
        raise SpecError(f"--world-size: expected a positive integer, got {world_size!r}")
    if distributed == "ddp" or world_size == 1:
        return profile
    if not profile.static_bytes:  # a profile from before these fields: sharding it would change nothing, silently
        raise SpecError("profile: no parameter or optimizer bytes recorded (made by an older planner); profile again")
    share = 1 - 1 / world_size
    shed = round(share * (profile.static_bytes - profile.block_param_bytes))
    units = raised(profile.units, -shed)
    opt_peak = max(profile.opt_peak - shed - round(share * profile.grad_bytes), 0) if profile.opt_peak else 0
    return replace(profile, units=units, opt_peak=opt_peak)


SAFETY = 0.005  # beyond what the profile's own steps show: plans it never ran may be off a little more


def safety_margin(profile: Profile, spec: StepSpec) -> float:
    """How far below a budget to plan: the model's largest under-prediction of the profile's own runs, plus `SAFETY`."""
    # the runs held the profiled regime's state; the profile holds the modelled one (adamw8bit's)
    modelled = profile.meta.get("modelled_state_bytes", 0)
    under = [
        (run["peak_bytes"] + modelled) / predict(profile, spec, assignment_of(spec, policy)).peak_bytes - 1
        for policy, run in profile.meta.get("runs", {}).items()
    ]
    return max([0.0, *under]) + SAFETY


def random_assignment(spec: StepSpec, rng: np.random.Generator, choices: tuple[str, ...] = CHOICES) -> dict[str, str]:
    """A random plan: each block recomputed whole (one of the recompute choices) or per layer."""
    out: dict[str, str] = {}
    recompute = [c for c in choices if c != PLAIN]
    for block, layers in block_layers(spec).items():
        if rng.random() < 0.35:
            out[block] = str(rng.choice(recompute))
            continue
        for name in layers:
            pick = str(rng.choice(choices))
            if not is_pseudo(name) and pick != PLAIN:
                out[name] = pick
    return out
