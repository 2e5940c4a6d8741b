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
from shared_configs.planning.budget import PROFILE_RUNS, predict, safety_margin
from shared_configs.planning.candidates import HAND_POLICIES, RACE_WITHIN
from shared_configs.planning.paired import paired
from shared_configs.planning.pipeline import Workload, get_profile, measure
from shared_configs.planning.solver import next_best, solve
from shared_configs.planning.units import assignment_of, block_layers, policy_string, uniform
from shared_configs.spec import UNetSpec
from tests.helpers.specs import variant

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


@pytest.mark.slow  # a torch profile of tiny, in this process: seconds
def test_a_choice_costs_its_units_forward_seconds_at_its_runs_rate() -> None:
    """The torch profile's pricing: per choice, the layers' prices add up to what the per-layer run measured
    above the plain step (the rate is fitted to it), and a block costs what its layers and sampler do."""
    from torch_impl.profile import profile

    spec = variant("tiny", sample_size=16, dropout=0.0)
    fields = profile(spec, 2, 5, repeats=1)
    units, runs, step = fields["units"], fields["meta"]["runs"], fields["step_time_s"]
    layers = block_layers(spec)
    for choice, level in PROFILE_RUNS[1:]:
        assignment = uniform(spec, choice, level)
        if level == "layers":
            extra = max(runs[policy_string(assignment)]["step_time_s"] - step, 0.0)
            assert sum(units[u][choice].time_s for u in assignment) == pytest.approx(extra, rel=1e-9)
        for block in (b for b, names in layers.items() if all(choice in units[n] for n in names)):  # no sampler
            assert units[block][choice].time_s == pytest.approx(sum(units[n][choice].time_s for n in layers[block]))
    assert fields["meta"]["time_rates"].keys() == {"full", "save=conv,matmul"}
