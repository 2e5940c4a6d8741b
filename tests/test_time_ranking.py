"""The torch profile's time model ranks plans as the machine runs them, on specs no other test uses:
random block widths, depths and attention placements, generated here. At a budget 40% of the way
from `full`'s predicted peak to `none`'s, the solver's three best plans and every hand policy are
predicted from the profile and measured in one worker, round by round against `none`
(`shared_configs.planning.pipeline.measure`). The predicted overheads must order them as the measured
ones do, and no candidate the race leaves out (predicted more than `RACE_WITHIN` slower than the
solver's plan) may measure faster than it. Figures on larger specs: docs/candidates.md."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import kendalltau

from shared_configs.loader import spec_from_dict
from shared_configs.planning.budget import predict, safety_margin
from shared_configs.planning.candidates import HAND_POLICIES, RACE_WITHIN
from shared_configs.planning.paired import paired
from shared_configs.planning.pipeline import Workload, get_profile, measure
from shared_configs.planning.solver import next_best, solve
from shared_configs.planning.timeline import profile_assignments
from shared_configs.planning.units import assignment_of, block_layers, leaf_units, policy_string
from shared_configs.spec import UNetSpec
from tests.helpers.specs import random_profile, variant

ROUNDS = 6


def random_spec(seed: int) -> UNetSpec:
    """A U-Net of 2-3 levels, widths 16-64, 1-2 layers per block, attention where the dice say."""
    rng = np.random.default_rng(seed)
    levels = int(rng.integers(2, 4))
    widths = sorted(16 * int(m) for m in rng.choice([1, 2, 3, 4], levels))
    return spec_from_dict(
        {
            "name": f"random{seed}",
            "in_channels": 4,
            "out_channels": 4,
            "sample_size": 16,
            "block_out_channels": widths,
            "layers_per_block": int(rng.integers(1, 3)),
            "down_attention": [str(rng.choice(["transformer", "none"])) for _ in range(levels)],
            "mid_attention": str(rng.choice(["transformer", "none"])),
            "num_attention_heads": 2,
            "cross_attention_dim": 32,
            "norm_num_groups": 8,
        }
    )


@pytest.mark.heavy  # a profile and ~9 policies measured for 6 rounds, per spec: minutes on 2 cores
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_predicted_overheads_rank_as_measured(seed: int) -> None:
    spec = random_spec(seed)
    workload = Workload(spec=spec, batch_size=4)
    profile = get_profile("torch", workload)
    low, high = (predict(profile, spec, assignment_of(spec, p)).peak_bytes for p in ("full", "none"))
    budget, margin = round(low + 0.4 * (high - low)), safety_margin(profile, spec)
    first = solve([profile], spec, budget, margin)
    plans = [first.policy, *(s.policy for s in next_best([profile], spec, budget, margin, first, 2))]
    policies = list(dict.fromkeys([*plans, *HAND_POLICIES[1:]]))
    predicted = {p: predict(profile, spec, assignment_of(spec, p)).overhead(profile) for p in policies}
    rows = measure("torch", workload, ["none", *policies], ROUNDS)["rows"]
    measured = {p: paired(rows[p]["rounds_s"], rows["none"]["rounds_s"])["median"] for p in policies}
    tau = kendalltau([predicted[p] for p in policies], [measured[p] for p in policies]).statistic
    left_out = [p for p in policies if predicted[p] > predicted[first.policy] + RACE_WITHIN]
    print(
        f"{spec.name} {spec.block_out_channels}: Kendall's tau {tau:.2f} over {len(policies)} policies; plan "
        f"{measured[first.policy]:+.1%}, the {len(left_out)} left out {min(measured[p] for p in left_out):+.1%} at best"
    )
    assert tau >= 0.5, (tau, predicted, measured)
    assert all(measured[p] > measured[first.policy] for p in left_out), (predicted, measured)


@pytest.mark.parametrize("stalled", ["one layer", "every layer"])
def test_a_choice_costs_its_units_forward_at_its_rate(stalled: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's pricing (`torch_impl.profile.priced`) on stand-in timings: every layer's recompute costs
    its forward seconds times its choice's true factor, and the plain step stalls (a page-reclaim burst
    on a shared machine). One layer stalled: the rates are the factors all the same; every layer: no
    rate shows above the noise, and each choice costs its forward again (1). A unit costs its forward
    (as measured) at its choice's rate, a block its layers' and sampler's."""
    from torch_impl import profile as torch_profile

    spec = variant("tiny", sample_size=16)
    names, rng = [u for u, _ in leaf_units(spec, {})], np.random.default_rng(0)
    forward = {u: float(rng.uniform(0.01, 0.05)) for u in names}
    factor = {"full": 1.1, "save=conv,matmul": 0.6}
    seen = {u: forward[u] + (1.0 if stalled == "every layer" or u == names[3] else 0.0) for u in names}

    def timing_runs(s: dict, assignments: list[dict[str, str]], repeats: int) -> list:
        # a unit's forward, its backward twice that, its recompute in the backward; the plain run stalls
        per = [
            {u: [forward[u], 2 * forward[u] + factor.get(a.get(u), 0.0) * forward[u]] for u in names}
            for a in assignments
        ]
        per[0] = {u: [seen[u], t[1]] for u, t in per[0].items()}
        return [(p, sum(map(sum, p.values()))) for p in per]

    monkeypatch.setattr(torch_profile, "timing_runs", timing_runs)
    units = random_profile(spec, 0).units
    runs = {policy_string(a): {} for a in profile_assignments(spec)}
    priced, _, rates = torch_profile.priced({"spec": spec}, units, profile_assignments(spec), 1, runs)
    assert rates == pytest.approx(factor if stalled == "one layer" else dict.fromkeys(factor, 1.0))
    seen |= {b: sum(seen[n] for n in layers) for b, layers in block_layers(spec).items()}
    for unit, per in units.items():
        for choice in per:
            assert priced[unit][choice].time_s == pytest.approx(rates.get(choice, 0.0) * seen[unit]), (unit, choice)
