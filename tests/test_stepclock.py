"""`benchmarks.stepclock.paired` (plan against hand policy, round by round) and the sweep's claim
lines built on it: checked against the sign test's confidence interval written out from the
binomial distribution, and against constructed rounds whose answer is known."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import binom

from benchmarks.plan_sweep import against_hand
from benchmarks.stepclock import paired
from shared_configs.units import MIB


def sign_test_interval(ratios: np.ndarray, confidence: float) -> tuple[float, float]:
    """The textbook distribution-free interval for a median: order statistics x_(k), x_(n+1-k), with
    the largest k whose coverage 1 - 2 P(Binomial(n, 1/2) <= k - 1) is still >= ``confidence``."""
    x, n = np.sort(ratios), len(ratios)
    k = max(k for k in range(1, n // 2 + 1) if 1 - 2 * binom.cdf(k - 1, n, 0.5) >= confidence)
    return float(x[k - 1]), float(x[n - k])


@pytest.mark.parametrize("seed", range(4))
def test_paired_interval_is_the_sign_tests(seed: int) -> None:
    rng = np.random.default_rng(seed)
    hand = rng.uniform(3.0, 4.0, 15)
    plan = hand * (1 + rng.normal(0.02, 0.05, 15))
    c = paired(list(plan), list(hand))
    ratios = plan / hand - 1
    assert (c["low"], c["high"]) == pytest.approx(sign_test_interval(ratios, 0.9))
    assert c["median"] == pytest.approx(float(np.median(ratios)))
    assert c["wins"] == int(np.sum(plan < hand)) and c["rounds"] == 15


def test_paired_verdicts() -> None:
    hand = [3.0, 5.0, 4.0, 6.0, 3.5, 4.5, 5.5]  # rounds differ a lot; the pairing removes that
    assert paired([0.9 * h for h in hand], hand)["verdict"] == "faster"
    assert paired([1.1 * h for h in hand], hand)["verdict"] == "slower"
    mixed = [h * (1 + d) for h, d in zip(hand, [-0.1, 0.1, -0.05, 0.05, 0.0, 0.02, -0.02], strict=True)]
    assert paired(mixed, hand)["verdict"] == "within noise"
    assert paired(hand[:4], hand[:4])["verdict"] == "too few rounds"  # no 90% interval from 4 signs
    with pytest.raises(ValueError, match="same number"):
        paired(hand, hand[:3])


def test_the_claim_counts_only_hand_policies_that_fit() -> None:
    hand_rounds = [3.0, 5.0, 4.0, 6.0, 3.5, 4.5, 5.5]
    plan_rounds = [1.05 * h for h in hand_rounds]  # 5% slower than "cheap" every round
    hand = {"none": 400 * MIB, "cheap": 300 * MIB, "full": 100 * MIB}
    doc = {"frameworks": {"torch": {
        "hand": {n: {"measured_peak_bytes": b} for n, b in hand.items()},
        "plans": [
            {"budget_bytes": 200 * MIB, "plan": "p", "paired": {n: paired(plan_rounds, hand_rounds) for n in hand}},
            {"budget_bytes": 350 * MIB, "plan": "q", "paired": {n: paired(plan_rounds, hand_rounds) for n in hand}},
        ],
    }}}  # fmt: skip
    lines = against_hand(doc).splitlines()
    assert lines[0] == "torch 200.0 MiB (p): claim slower than full" and "vs cheap" not in lines[1]
    assert lines[2] == "torch 350.0 MiB (q): claim slower than cheap, full"
    assert lines[3].startswith("    vs cheap: +5.0% [+5.0, +5.0], faster in 0/7 rounds: slower")
