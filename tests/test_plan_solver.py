"""The budget solver against brute force, plan strings, and unit FLOPs against FlopCounterMode.

The solver's reference is an exhaustive search: every plan of a small spec (each block recomputed
whole under each choice, or each of its layers under each choice) is predicted with the same peak
model, and the cheapest that fits is compared with the dynamic programme's answer, over random
profiles and budgets from infeasible to unconstrained.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch

from shared_configs import load_spec, resolve_plan
from shared_configs.planning.budget import PROFILE_RUNS, predict, random_assignment
from shared_configs.planning.recompute_time import at_rates
from shared_configs.planning.solver import Infeasible, next_best, smallest_peak, solve
from shared_configs.planning.unit_flops import recompute_flops, unit_flops
from shared_configs.planning.units import (
    CHOICES,
    PLAIN,
    assignment_of,
    block_layers,
    is_pseudo,
    leaf_units,
    policy_string,
    uniform,
)
from tests.helpers.specs import random_profile, variant


def _small_spec():
    """Five blocks, 33,275 plans: few enough to enumerate."""
    return variant("tiny", down_attention=["none", "none"], mid_attention="none", up_attention=["none", "none"])


def _every_plan(spec):
    per_block = []
    for block, layers in block_layers(spec).items():
        options = [{block: c} for c in CHOICES[1:]]
        free = [n for n in layers if not is_pseudo(n)]
        for combo in itertools.product(CHOICES, repeat=len(free)):
            options.append({n: c for n, c in zip(free, combo, strict=True) if c != PLAIN})
        per_block.append(options)
    for parts in itertools.product(*per_block):
        yield {k: v for part in parts for k, v in part.items()}


@pytest.mark.slow_for("1")  # a second random profile: the inner loop keeps one
@pytest.mark.parametrize("seed", [0, 1])
def test_solver_matches_brute_force(seed: int) -> None:
    spec = _small_spec()
    profile = random_profile(spec, seed)
    plans = [(predict(profile, spec, a), a) for a in _every_plan(spec)]
    assert len(plans) == 33_275
    units = {u: {c: replace(v, hold=0) for c, v in per.items()} for u, per in profile.units.items()}
    no_holds = replace(profile, units=units)
    changed = sum(predict(no_holds, spec, a).peak_bytes != p.peak_bytes for p, a in plans)
    assert changed > 100, changed  # the holds decide peaks
    floor = min(p.peak_bytes for p, _ in plans)
    top = max(p.peak_bytes for p, _ in plans)
    assert smallest_peak(profile, spec).prediction.peak_bytes == floor
    for budget in np.linspace(floor, top, 7).astype(int):
        best = min(p.time_s for p, _ in plans if p.peak_bytes <= budget)
        got = solve(profile, spec, int(budget))
        assert got.prediction.peak_bytes <= budget
        assert got.prediction.time_s == pytest.approx(best, abs=1e-9)
        assert predict(profile, spec, assignment_of(spec, got.policy)) == got.prediction  # the string says it
    with pytest.raises(Infeasible, match=r"budget: no plan fits .* smallest feasible budget is") as err:
        solve(profile, spec, floor - 1)
    assert err.value.smallest == floor and "\n" not in str(err.value)


@pytest.mark.slow
def test_next_best_plans_are_brute_forces_runners_up() -> None:
    """With each earlier plan cut off, the programme gives the next plans in the brute force's order
    of cost (the solver's objective: relative recompute time and a hair per recomputed unit), all
    distinct and fitting; fewer where fewer plans fit."""
    spec = _small_spec()
    profile = random_profile(spec, 5)
    plans = [(predict(profile, spec, a), a) for a in _every_plan(spec)]

    def cost(prediction, assignment) -> float:
        return prediction.time_s / profile.step_time_s + 1e-5 * len(assignment)

    floor, top = min(p.peak_bytes for p, _ in plans), max(p.peak_bytes for p, _ in plans)
    for budget in (int(floor + 0.3 * (top - floor)), int(floor + 0.8 * (top - floor))):
        ranked = sorted(cost(p, a) for p, a in plans if p.peak_bytes <= budget)
        first = solve(profile, spec, budget)
        found = [first, *next_best(profile, spec, budget, 0.0, first, 4)]
        assert len({s.policy for s in found}) == 5
        assert all(s.prediction.peak_bytes <= budget for s in found)
        assert [cost(s.prediction, s.assignment) for s in found] == pytest.approx(ranked[:5], abs=1e-9)
    few = sorted((p.peak_bytes for p, _ in plans))[2]  # three plans fit (peaks distinct at the bottom)
    first = solve(profile, spec, few)
    assert len(next_best(profile, spec, few, 0.0, first, 4)) == sum(p.peak_bytes <= few for p, _ in plans) - 1


@pytest.mark.slow
def test_joint_solver_fits_both_profiles_as_brute_force() -> None:
    """Two profiles (torch and JAX): the plan must fit in each; cost = sum of relative recompute times."""
    spec = _small_spec()
    profiles = [random_profile(spec, 3), random_profile(spec, 4)]
    plans = [([predict(p, spec, a) for p in profiles], a) for a in _every_plan(spec)]
    peaks = [max(x.peak_bytes for x in preds) for preds, _ in plans]
    floor = min(peaks)
    assert max(p.peak_bytes for p in smallest_peak(profiles, spec).predictions) == floor
    for budget in np.linspace(floor, max(peaks), 5).astype(int):
        best = min(sum(x.time_s for x in preds) for (preds, _), pk in zip(plans, peaks, strict=True) if pk <= budget)
        got = solve(profiles, spec, int(budget))
        assert all(x.peak_bytes <= budget for x in got.predictions)
        assert sum(x.time_s for x in got.predictions) == pytest.approx(best, abs=1e-9)


def test_policy_strings_round_trip_through_resolve_plan() -> None:
    spec = load_spec("small")
    rng = np.random.default_rng(0)
    for _ in range(20):
        assignment = random_assignment(spec, rng)
        policy = policy_string(assignment)
        assert assignment_of(spec, policy) == assignment
        assert set(resolve_plan(spec, policy).recompute) == set(assignment)
    assert policy_string({}) == "none" and assignment_of(spec, "save_convs") == {
        b: "save=conv,matmul" for b in resolve_plan(spec, "full").recompute
    }


def test_leaf_units_cover_every_layer_once() -> None:
    spec = load_spec("small")
    for policy in ("none", "full", "balanced", "layers"):
        units = [u for u, _ in leaf_units(spec, assignment_of(spec, policy))]
        assert len(units) == len(set(units)) and units[0] == "stem" and units[-1] == "head"
    blocks = [u for u, _ in leaf_units(spec, assignment_of(spec, "full"))]
    assert blocks == ["stem", "down.0", "down.1", "down.2", "mid", "up.0", "up.1", "up.2", "head"]


@pytest.mark.parametrize("name", ["tiny", "ddpm_style", "sd_linear_proj", "transformer_no_cross"])
def test_unit_flops_equal_flop_counter(name: str) -> None:
    """The spec-side count equals `FlopCounterMode` on the torch model, unit by unit and by op class."""
    from torch.utils.flop_counter import FlopCounterMode

    from torch_impl.checkpointing import op_class
    from torch_impl.flops import register_cpu_attention_flops
    from torch_impl.unet import UNet

    register_cpu_attention_flops()
    spec = variant(name)
    model = UNet(spec)
    ctx = None if spec.cross_attention_dim is None else torch.randn(2, 5, spec.cross_attention_dim)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randn(2, spec.in_channels, 8, 8), torch.tensor([1.0, 2.0]), ctx)
    counts = counter.get_flop_counts()
    expected = unit_flops(spec, 2, 5)
    for unit, per in expected.items():
        if unit in ("stem", "head"):
            continue
        measured: dict[str, float] = {}
        for op, n in counts[f"UNet.{unit}"].items():
            measured[op_class(op)] = measured.get(op_class(op), 0) + n
        assert measured == {k: v for k, v in per.items() if v}, unit
    assert recompute_flops(expected["mid"], "save=conv,matmul") == expected["mid"].get("attention", 0)
    assert recompute_flops(expected["mid"], "full") == sum(expected["mid"].values())


def test_stated_rates_price_a_plan_by_its_flops_and_the_bytes_it_no_longer_keeps() -> None:
    """Shapes-only pricing: each uniform plan's extra seconds, computed by hand from the rates (FLOPs,
    and the bytes a unit no longer keeps written and read), are what the repriced profile predicts."""
    spec = _small_spec()
    profile = random_profile(spec, 3)
    per_flop, per_byte = 2e-11, 3e-10
    kept = {u: per[PLAIN].keep for u, per in profile.units.items() if PLAIN in per}
    kept |= {b: sum(kept[n] for n in layers) for b, layers in block_layers(spec).items()}
    priced = replace(profile, units=at_rates(spec, profile.units, per_flop, per_byte))
    for choice, level in PROFILE_RUNS[1:]:
        assignment = uniform(spec, choice, level)
        extra = 0.0
        for unit, c in leaf_units(spec, assignment):
            cost = profile.units[unit][c]
            extra += cost.flops * per_flop + 2 * max(kept[unit] - cost.keep, 0) * per_byte
        assert predict(priced, spec, assignment).time_s == pytest.approx(extra, rel=1e-9)
