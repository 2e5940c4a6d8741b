"""Plan to a memory budget, from training code or the CLI: profile once (cached), solve, check.

    policy = plan_for_budget("small", batch_size=8, budget_bytes=3 << 30, sample_size=32)

`plan` is the one pipeline (`plan_for_budget` and the plan command call it). Profiles are measured
in a worker process per framework (`shared_configs.planning.workers`; this module imports neither
framework) and cached as JSON under ``$UNET_REMAT_PLAN_CACHE`` (default ``~/.cache/unet-remat/plan``).
``shapes=True`` profiles without allocating; time is then FLOPs at ``flops_per_s``.
torch_impl and jax_impl export `for_framework`'s; docs/planning.md.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from shared_configs.defaults import defaults
from shared_configs.loader import load_spec, spec_from_dict
from shared_configs.pair import ControlNetPairSpec, check_pair_workload, controlnet_pair
from shared_configs.planning import whole
from shared_configs.planning.budget import (
    SAFETY,
    SCHEMA,
    Profile,
    cached_profile,
    per_rank,
    predict,
    safety_margin,
    with_static_bytes,
)
from shared_configs.planning.cache import CACHE_ENV as CACHE_ENV
from shared_configs.planning.cache import cache_dir, versions
from shared_configs.planning.candidates import (
    DEFAULT_ROUNDS,
    MIN_ROUNDS,
    RACE_WITHIN,
    REFERENCE,
    measured_choice,
    unmeasurable,
)
from shared_configs.planning.recompute_time import at_stated_rates
from shared_configs.planning.solver import Solution, solve
from shared_configs.planning.units import assignment_of
from shared_configs.planning.workers import kept_alive, run_worker
from shared_configs.progress import note, say
from shared_configs.regime import DEFAULT as DEFAULT_REGIME
from shared_configs.regime import Regime, check_planned
from shared_configs.sizes import MIB
from shared_configs.spec import SpecError, UNetSpec

FRAMEWORKS = ("torch", "jax")
# Shapes-only time: stated rates (a current GPU's order in float32), not measurements.
DEFAULT_FLOPS_PER_S = 100e12
DEFAULT_BYTES_PER_S = 2e12


# The workers run on the CPU (torch's tracker; JAX_PLATFORMS=cpu in `worker_env`): its defaults.
DEVICE = "cpu"
_DEFAULTS = defaults(DEVICE)


@dataclass(frozen=True)
class Workload:
    """What is profiled: the spec at a sample size (a U-Net's step, or with a `ControlNetPairSpec` the
    ControlNet step: `shared_configs.pair`), the batch, the training regime, the inputs, the JAX
    attention chunking (by default those of every tool on the device, `shared_configs.defaults`)."""

    spec: UNetSpec | ControlNetPairSpec
    batch_size: int
    regime: Regime = DEFAULT_REGIME  # how the step trains (precision, what is trained, optimizer, EMA)
    context_length: int = _DEFAULTS.context_length
    attention_chunk: int | None = _DEFAULTS.attention_chunk  # JAX only: queries per attention chunk; None: unchunked
    shapes: bool = False  # profile from shapes only (nothing allocated, nothing run)
    flops_per_s: float = DEFAULT_FLOPS_PER_S  # shapes only: the throughput conv/matmul/attention run at
    bytes_per_s: float = DEFAULT_BYTES_PER_S  # shapes only: the memory bandwidth elementwise recompute runs at
    # The whole step (torch; `shared_configs.planning.whole`): a GPU flavour to solve against (cuda, cuda-sm90),
    # the family's VAE and text encoder(s) beside the U-Net, latents cached (no VAE), the text encoder trained.
    device: str = "cpu"
    with_encoders: bool = False
    cached_latents: bool = False
    train_text_encoder: bool = False
    unfused_attention: bool = False  # on a GPU: attention keeping its probabilities (no SDPA, no xformers)
    optimizer_impl: str | None = None  # on a GPU: how the optimizer runs (`optimizer_step`); None: torch's default
    encoder_configs: str | None = None  # a pipeline folder's VAE and text encoder configs (JSON): its own encoders

    def __post_init__(self) -> None:
        if isinstance(self.spec, ControlNetPairSpec):
            check_pair_workload(self.spec, self.regime)

    @classmethod
    def of(
        cls,
        spec: UNetSpec | ControlNetPairSpec | str,
        sample_size: int | None = None,
        controlnet: bool = False,
        **kwargs: Any,
    ) -> Workload:
        """``controlnet``: the ControlNet step on this U-Net (`shared_configs.pair.controlnet_pair`)."""
        spec = load_spec(spec) if isinstance(spec, str) else spec
        if sample_size is not None and sample_size != spec.sample_size:
            if isinstance(spec, ControlNetPairSpec):
                spec = spec.with_sample_size(sample_size)
            else:
                spec = spec_from_dict({**spec.model_dump(), "sample_size": sample_size})
        if controlnet and isinstance(spec, UNetSpec):
            spec = controlnet_pair(spec)
        return cls(spec=spec, **kwargs)

    def used(self, frameworks: tuple[str, ...], cache: bool = True) -> str:
        """What the workers use, as every tool says it (`shared_configs.defaults.Defaults.describe`);
        ``cache``: the JAX compilation cache of measured and checked steps (a profile never uses it)."""
        jax = ("attention_chunk", "jax_cache")[: 1 + cache] if "jax" in frameworks else ()
        used = replace(
            defaults(DEVICE),
            attention_chunk=self.attention_chunk,
            context_length=self.context_length,
            dtype=self.regime.compute_dtype or "float32",
        )
        return used.describe(("dtype", "context_length", *jax))

    def request(self, framework: str, kind: str, **extra: Any) -> dict[str, Any]:
        """The worker's instructions (JSON)."""
        data = {k: v for k, v in asdict(self).items() if k not in ("spec", "flops_per_s", "bytes_per_s", *WHOLE_STEP)}
        return {"kind": kind, "framework": framework, "spec": self.spec.model_dump(mode="json"), **data, **extra}


# Applied to the profile, not profiled: not in the workers' requests nor the cache key.
WHOLE_STEP = (
    "device",
    "with_encoders",
    "cached_latents",
    "train_text_encoder",
    "unfused_attention",
    "optimizer_impl",
    "encoder_configs",
)


# Rounds of timed steps per profile: torch's one round prices every unit by its forward seconds at a rate per
# choice, each rate one whole-step difference (`torch_impl.profile.priced`), not a unit's own noisy split; JAX times
# only the plain step (its throughput prices recompute FLOPs, so a JAX plan does not depend on it).
PROFILE_REPEATS = {"torch": 1, "jax": 1}


def profile_path(framework: str, workload: Workload) -> Path:
    """Where the profile of ``workload`` is cached: keyed by the request, the schema and the versions."""
    request = workload.request(framework, "profile", repeats=PROFILE_REPEATS[framework])
    key = hashlib.sha256(json.dumps([SCHEMA, request, versions(framework)], sort_keys=True).encode()).hexdigest()
    return cache_dir() / f"{workload.spec.name}-{framework}-{key[:16]}.json"


def get_profile(framework: str, workload: Workload) -> Profile:
    """The profile of ``workload`` in ``framework``: from the cache, or measured (and cached)."""
    check_planned(workload.regime, framework, DEVICE)
    whole.check(workload, framework)
    path = profile_path(framework, workload)
    # One process measures; the others (the ranks of one training run, two plans at once) wait for
    # it and read its profile (`cached_profile` locks the entry).
    spec = workload.spec
    expect = {
        "framework": framework,
        "config": spec.name,
        "sample_size": spec.sample_size,
        "batch_size": workload.batch_size,
        "context_length": workload.context_length,
        "regime": workload.regime.describe(),
    }
    profile = cached_profile(path, expect, functools.partial(_measure_profile, framework, workload, path, expect))
    if workload.shapes:  # its regime as given, not read back from the profile's describe line
        profile = at_stated_rates(
            profile,
            spec,
            workload.batch_size,
            workload.context_length,
            workload.flops_per_s,
            workload.bytes_per_s,
            workload.regime,
        )
    return whole.on_device(workload, framework, profile)


def progress(message: str) -> None:
    """A line through logging (`shared_configs.progress.note`) for work that takes minutes."""
    note(f"plan: {message}")


def _measure_profile(framework: str, workload: Workload, path: Path, expect: dict[str, Any]) -> Profile:
    load, start, repeats = os.getloadavg(), time.perf_counter(), PROFILE_REPEATS[framework]
    spec = workload.spec
    timed = {"torch": "the plain and per-layer steps timed", "jax": "the plain step timed"}[framework]
    how = "from shapes" if workload.shapes else f"{timed} {repeats}x"
    kind = "compiled" if framework == "jax" else "traced"
    progress(
        f"profiling {spec.name} at {spec.sample_size}x{spec.sample_size}, batch {workload.batch_size} in "
        f"{framework} ({workload.used((framework,), cache=False)}; 5 {kind} steps, {how}; "
        f"cached in {path.parent}) ..."
    )
    fields = run_worker(workload.request(framework, "profile", repeats=repeats))
    seconds = time.perf_counter() - start
    progress(f"{framework} profile done in {seconds:.0f} s{cpu_text(fields['meta'].get('cpu_s'))}")
    fields["meta"] |= {"seconds": round(seconds, 1), "loadavg": [load, os.getloadavg()]}
    profile = Profile.from_json({"schema": SCHEMA, **expect, **fields})
    return with_static_bytes(profile, fields["meta"].get("modelled_state_bytes", 0))


def cpu_text(cpu_s: dict[str, float] | None) -> str:
    """A worker's CPU seconds by phase, as a progress line ends: `` (CPU s: setup 3.7, memory 13.2)``."""
    return f" (CPU s: {', '.join(f'{k} {v:.1f}' for k, v in cpu_s.items())})" if cpu_s else ""


def measure(
    framework: str,
    workload: Workload,
    policies: list[str],
    steps: int = 3,
    ratios: list[float] | None = None,
    race_to: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Each policy's measured peak and step time in one worker; torch with ``ratios``: also torch.compile
    rows (``torch.compile:RATIO``); ``race_to``: the policies that fit race (`stepclock.measured_rounds`)."""
    start = time.perf_counter()
    many = f"up to {steps}" if race_to else f"{steps}"
    progress(
        f"measuring {len(policies)} plan(s) in {framework}, one process: a compile, a warm-up and {many} steps each ..."
    )
    request = workload.request(framework, "measure", policies=policies, steps=steps, ratios=ratios or [])
    rows = run_worker(request | ({"race_to": race_to} if race_to else {}))
    progress(f"{framework} measurement done in {time.perf_counter() - start:.0f} s")
    return rows


def checked_frameworks(framework: str, workload: Workload) -> tuple[str, ...]:
    """`frameworks_of`, each checked to run ``workload``'s regime here before any worker starts."""
    frameworks = frameworks_of(framework)
    for fw in frameworks:
        check_planned(workload.regime, fw, DEVICE)
    return frameworks


CHECKS = 4  # checks of a plan's peak before giving up on fitting it
CHECK_HOW = {"jax": "compiling the step", "torch": "a step of fake tensors"}


def frameworks_of(framework: str) -> tuple[str, ...]:
    """``"both"`` -> both frameworks; otherwise the one named."""
    if framework != "both" and framework not in FRAMEWORKS:
        raise SpecError(f"framework: expected one of torch, jax, both, got {framework!r}")
    return FRAMEWORKS if framework == "both" else (framework,)


# The checked peak's distance below the measured one: torch's fake-tensor step runs a little under
# the real step (docs/planning.md#checks); XLA's is exact.
CHECK_SLACK = 0.001


def checked_solve(
    profiles: list[Profile], workload: Workload, budget: int, margin: float, frameworks: tuple, world_size: int = 1
) -> Solution:
    """`solve`, then `fit_checked` (the solution only)."""
    sol = solve(profiles, workload.spec, budget, margin)
    return fit_checked(sol, profiles, workload, budget, margin, frameworks, world_size)[0]


def fit_checked(
    sol: Solution,
    profiles: list[Profile],
    workload: Workload,
    budget: int,
    margin: float,
    frameworks: tuple,
    world_size: int = 1,
) -> tuple[Solution, float]:
    """``sol``'s peak as `measure` would take it, with nothing allocated (`CHECK_HOW`), taken `CHECK_SLACK`
    high; while over the budget, plan lower by the excess and solve again (docs/planning.md#checks).
    Several ranks: not checked. Returns the solution and the margin it was planned at."""
    if world_size != 1:
        return sol, margin
    for _ in range(CHECKS):
        peaks = {}
        for fw, profile in zip(frameworks, profiles, strict=True):
            progress(f"{fw}: {CHECK_HOW[fw]} to check the plan's peak (nothing allocated) ...")
            start = time.perf_counter()
            found = run_worker(workload.request(fw, "peaks", policies=[sol.policy]))
            progress(f"{fw}: checked in {time.perf_counter() - start:.0f} s{cpu_text(found.get('cpu_s'))}")
            checked = found["peaks"][sol.policy]
            peaks[fw] = whole.checked_peak(workload, fw, checked, sol.assignment, profile, get_profile)
        fw, peak = max(peaks.items(), key=lambda kv: kv[1])
        peak = round(peak * (1 + CHECK_SLACK))
        if peak <= budget:
            return sol, margin
        margin += peak / budget - 1 + SAFETY
        progress(
            f"{fw}: the plan peaks at {peak / MIB:.1f} MiB, over the budget; planning {100 * margin:.1f}% below it"
        )
        sol = solve(profiles, workload.spec, budget, margin)
    raise SpecError(
        f"budget: no plan checked under {budget / MIB:.1f} MiB in {CHECKS} tries (the last: "
        f"{fw} {peak / MIB:.1f} MiB); try a budget {100 * margin:.0f}% higher"
    )


@dataclass(frozen=True)
class Planned:
    """What `plan` found: the solution (policy and per-framework predictions), the per-rank profiles
    it was solved on, the margin below the budget it was planned at, and the solver's seconds."""

    solution: Solution
    profiles: list[Profile]
    margin: float
    solve_seconds: float
    candidates: dict[str, Any] | None = None  # measured candidates (`plan`'s ``candidates``): `candidates.decide`

    @property
    def policy(self) -> str:
        return self.solution.policy


# Where a user's first plan races the hand policies by default (`plan_for_budget`, the plan command). Not JAX:
# XLA:CPU runs every policy but `full` within a few % of `none` (docs/planning.md#limits), and a race
# there compiles each contender for minutes. `plan` itself does not race unless asked: a guard re-plans through it.
RACED = ("torch",)


@kept_alive()  # the profile and the check share each framework's worker
def plan(
    workload: Workload,
    budget_bytes: int,
    framework: str = "torch",
    world_size: int = 1,
    distributed: str = "ddp",
    candidates: int = 0,
    rounds: int = DEFAULT_ROUNDS,
) -> Planned:
    """The one pipeline from a workload and a budget to a checked plan: profile (cached), solve a
    `safety_margin` below the budget, check the plan's peak with nothing allocated (`fit_checked`).
    ``candidates`` > 0: the solver's best ``candidates`` plans and the hand policies that fit (and are predicted
    within `RACE_WITHIN` of the plan) race for up to ``rounds`` rounds; the fastest that fits is the plan
    (`shared_configs.planning.candidates`); a hand policy that wins is said in one line."""
    frameworks = checked_frameworks(framework, workload)
    budget_bytes = whole.device_budget(workload, budget_bytes)  # on a GPU: the allocated peak its memory allows
    measured = [get_profile(fw, workload) for fw in frameworks]
    # The margin comes from the one-process profile: its runs are what was measured.
    margin = max(safety_margin(p, workload.spec) for p in measured)
    profiles = [per_rank(p, world_size, distributed) for p in measured]
    start = time.perf_counter()
    sol = solve(profiles, workload.spec, budget_bytes, margin)
    solve_s = time.perf_counter() - start
    sol, margin = fit_checked(sol, profiles, workload, budget_bytes, margin, frameworks, world_size)
    if not candidates:
        return Planned(sol, profiles, margin, solve_s)
    why = unmeasurable(measured, world_size, distributed)
    if why or sol.policy == REFERENCE:
        progress(f"candidates: nothing measured: {why or 'the plain step fits, no plan is cheaper'}")
        return Planned(sol, profiles, margin, solve_s)
    how = "; ".join(f"{fw}: {CHECK_HOW[fw]}" for fw in frameworks)
    progress(f"candidates: those near the plan checked with nothing allocated ({how}), raced where they fit ...")
    chosen, report = measured_choice(
        sol,
        profiles,
        workload.spec,
        budget_bytes,
        margin,
        frameworks,
        candidates,
        check=lambda fw, policies: run_worker(workload.request(fw, "peaks", policies=policies))["peaks"],
        race=lambda fw, policies, race_to: measure(fw, workload, policies, rounds, race_to=race_to)["rows"],
    )
    if report is None:
        progress(f"candidates: none but the plan fits of those predicted within {RACE_WITHIN:.0%}: nothing raced")
        return Planned(sol, profiles, margin, solve_s)
    if any(c["chosen"] and c["source"] == "hand" for c in report["candidates"]):
        say(f"plan: the hand policy {chosen.policy!r} measured faster than the solver's plan; it is the plan")
    return Planned(chosen, profiles, margin, solve_s, report | {"rounds": rounds})


def predict_policy(
    workload: Workload, policy: str, framework: str = "torch", world_size: int = 1, distributed: str = "ddp"
) -> tuple[Solution, list[Profile]]:
    """What the profiles `plan` solves on predict of a given ``policy`` (any form `resolve_plan`
    takes), per framework: no solving, no check. A bad policy is refused before any profiling."""
    frameworks = checked_frameworks(framework, workload)
    assignment = assignment_of(workload.spec, policy)
    profiles = [per_rank(get_profile(fw, workload), world_size, distributed) for fw in frameworks]
    predictions = tuple(predict(p, workload.spec, assignment) for p in profiles)
    return Solution(assignment, predictions, policy), profiles


def plan_for_budget(
    spec: UNetSpec | str,
    batch_size: int,
    budget_bytes: int,
    sample_size: int | None = None,
    framework: str = "torch",
    world_size: int = 1,
    distributed: str = "ddp",
    candidates: int | None = None,
    rounds: int = MIN_ROUNDS,
    **workload: Any,
) -> str:
    """The policy string of the cheapest plan predicted to fit ``budget_bytes`` (see `plan`), in a framework of
    `RACED` raced for ``rounds`` rounds against the hand policies that fit (``candidates`` None: 1; 0: no race).

    ``framework``: "torch", "jax" or "both". ``world_size`` ranks each train ``batch_size`` samples
    (``distributed="fsdp"``: sharded, `shared_configs.planning.budget.per_rank`). Further keywords go to
    `Workload`. Raises `shared_configs.planning.solver.Infeasible` naming the smallest feasible budget.
    """
    work = Workload.of(spec, sample_size, batch_size=batch_size, **workload)
    candidates = int(framework in RACED) if candidates is None else candidates
    return plan(work, budget_bytes, framework, world_size, distributed, candidates, rounds).policy


def for_framework(framework: str) -> Callable[..., str]:
    """`plan_for_budget` with ``framework`` fixed: what ``torch_impl`` and ``jax_impl`` export, so a
    training loop plans from the framework package it already imports."""
    (fw,) = frameworks_of(framework)

    def plan_for_framework(
        spec: UNetSpec | str,
        batch_size: int,
        budget_bytes: int,
        sample_size: int | None = None,
        world_size: int = 1,
        distributed: str = "ddp",
        **workload: Any,
    ) -> str:
        return plan_for_budget(spec, batch_size, budget_bytes, sample_size, fw, world_size, distributed, **workload)

    plan_for_framework.__name__ = plan_for_framework.__qualname__ = "plan_for_budget"
    plan_for_framework.__doc__ = (
        f"The policy string of the cheapest plan whose {fw} step is predicted, and checked, to fit "
        "``budget_bytes`` (in torch raced against the hand policies that fit near it); the arguments as "
        "`shared_configs.planning.pipeline.plan_for_budget`'s."
    )
    return plan_for_framework
