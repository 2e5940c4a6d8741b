"""`shared_configs.planning.stepclock.paired` (plan against hand policy, round by round) and the sweep's claim
lines built on it: checked against the sign test's confidence interval written out from the
binomial distribution, and against constructed rounds whose answer is known."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from scipy.stats import binom

from benchmarks.harness.plan_sweep import against_hand
from shared_configs.planning import stepclock
from shared_configs.planning.stepclock import paired
from shared_configs.sizes import MIB


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
    doc = {
        "frameworks": {
            "torch": {
                "hand": {n: {"measured_peak_bytes": b} for n, b in hand.items()},
                "plans": [
                    {
                        "budget_bytes": 200 * MIB,
                        "plan": "p",
                        "paired": {n: paired(plan_rounds, hand_rounds) for n in hand},
                    },
                    {
                        "budget_bytes": 350 * MIB,
                        "plan": "q",
                        "paired": {n: paired(plan_rounds, hand_rounds) for n in hand},
                    },
                ],
            }
        }
    }
    lines = against_hand(doc).splitlines()
    assert lines[0] == "torch 200.0 MiB (p): claim slower than full" and "vs cheap" not in lines[1]
    assert lines[2] == "torch 350.0 MiB (q): claim slower than cheap, full"
    assert lines[3].startswith("    vs cheap: +5.0% [+5.0, +5.0], faster in 0/7 rounds: slower")


class _Clock:
    """A stand-in for the CPU clock: each step advances it by its own seconds times the round's load."""

    def __init__(self, seconds: dict[str, list[float]]) -> None:
        self.now, self.seconds, self.ran = 0.0, seconds, {name: 0 for name in seconds}

    def __call__(self) -> float:
        return self.now

    def step(self, name: str) -> Callable[[], None]:
        def run() -> None:
            self.now += self.seconds[name][self.ran[name]]
            self.ran[name] += 1

        return run


def test_race_drops_a_contender_once_another_is_faster_and_stops_when_one_is_left(monkeypatch) -> None:
    load = np.random.default_rng(0).uniform(1.0, 1.6, 20)  # shared by a round: the pairing removes it
    noise = np.tile([1.04, 0.97], 10)
    clock = _Clock(
        {"none": list(2.0 * load), "a": list(2.2 * load), "b": list(2.9 * load), "c": list(2.2 * load * noise)}
    )
    monkeypatch.setattr(stepclock, "clock", clock)
    rounds = stepclock.race({n: clock.step(n) for n in ("none", "a", "b", "c")}, "none", 12)
    # b: slower than a in every round, out after the first five; a and c: within noise, to the end
    assert {n: len(r) for n, r in rounds.items()} == {"none": 12, "a": 12, "b": 5, "c": 12}
    assert rounds["b"] == pytest.approx(list(2.9 * load[:5]))
    clock = _Clock({"none": list(2.0 * load), "a": list(2.2 * load), "b": list(2.9 * load)})
    monkeypatch.setattr(stepclock, "clock", clock)
    rounds = stepclock.race({n: clock.step(n) for n in ("none", "a", "b")}, "none", 12)
    assert {n: len(r) for n, r in rounds.items()} == {"none": 5, "a": 5, "b": 5}  # decided: a
