"""benchmarks.candidates_sweep's verdict: a plan holds when it fits and no hand policy whose
measured peak fits is faster than it round by round at 90% (the measurements stubbed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import candidates_sweep as cs
from shared_configs.planning.candidates import HAND_POLICIES

PLAN = "down.1,up.1"


def _rows(peaks: dict[str, int], seconds: dict[str, float]) -> dict:
    # Twelve rounds each; a round-to-round drift every policy shares (pairing cancels it).
    drift = [1.0 + 0.05 * (i % 3) for i in range(12)]
    return {"rows": {p: {"peak_bytes": peaks[p], "rounds_s": [seconds[p] * d for d in drift]} for p in peaks}}


@pytest.mark.parametrize(
    ("plan_s", "plan_peak", "holds"),
    [(1.0, 90, True), (1.3, 90, False), (1.0, 110, False)],
    ids=["fastest-fitting", "a-fitting-hand-policy-is-faster", "over-budget"],
)
def test_a_plan_holds_when_it_fits_and_no_fitting_hand_policy_beats_it(monkeypatch, plan_s, plan_peak, holds) -> None:
    peaks = {PLAN: plan_peak, **dict.fromkeys(HAND_POLICIES, 200)} | {"full": 80, "layers": 70}
    seconds = {PLAN: plan_s, **dict.fromkeys(HAND_POLICIES, 1.0)} | {"full": 1.2, "layers": 1.25}
    prediction = SimpleNamespace(peak_bytes=88, overhead=lambda profile: 0.1)
    solution = SimpleNamespace(policy=PLAN, prediction=prediction)
    found = SimpleNamespace(solution=solution, candidates={"chosen": PLAN}, profiles=[None])
    monkeypatch.setattr(cs, "plan", lambda *a, **k: found)
    monkeypatch.setattr(cs, "measure", lambda fw, w, policies, rounds: _rows(peaks, seconds))
    got = cs.check_budget(None, "torch", 100, candidates=4, rounds=15, check_rounds=12)
    assert set(got["versus"]) == {"full", "layers"}  # the hand policies whose measured peak fits
    assert got["best_hand"] == "full" and cs.table([got]).index("full") < cs.table([got]).index("layers")
    assert got["fits"] == (plan_peak <= 100) and got["holds"] is holds
    assert ("| yes |" if holds else "| NO |") in cs.table([got])
    assert got["measured_overhead"]["median"] == pytest.approx(plan_s - 1)  # against none, round by round
