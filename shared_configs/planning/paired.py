"""Two policies' step times compared round by round: the median ratio and its sign-test interval.

Both lists come from one `shared_configs.planning.stepclock.in_turn` (or `race`): round i of each ran back to
back, so pairing by round cancels what a round shares. Framework-free (SciPy only): the planner
decides among measured candidates with it (`shared_configs.planning.candidates`).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def paired(a: list[float], b: list[float], confidence: float = 0.9) -> dict[str, Any]:
    """``a`` against ``b``, round by round (both from one `in_turn`): the median of ``a_i / b_i - 1``,
    its distribution-free confidence interval (the sign test's, `scipy.stats.quantile_test`), and
    the rounds ``a`` was faster in. Pairing by round cancels what a round shares (the neighbours, a
    drift), which moves whole medians between processes more than policies differ (docs/planning.md#checks)."""
    from scipy.stats import quantile_test  # here: scipy.stats takes seconds to import, and a profile never pairs

    if len(a) != len(b) or not a:
        raise ValueError(f"paired: {len(a)} and {len(b)} rounds; need the same number, at least one")
    ratios = np.asarray(a) / np.asarray(b) - 1
    ci = quantile_test(ratios, q=0, p=0.5).confidence_interval(confidence)
    low, high = (float(v) if np.isfinite(v) else None for v in (ci.low, ci.high))  # nan: too few rounds
    verdict = (
        "too few rounds"
        if low is None or high is None
        else "faster"
        if high < 0
        else "slower"
        if low > 0
        else "within noise"
    )
    return {
        "median": float(np.median(ratios)),
        "low": low,
        "high": high,
        "confidence": confidence,
        "wins": int(np.sum(ratios < 0)),
        "rounds": len(a),
        "verdict": verdict,
    }


def paired_text(c: dict[str, Any]) -> str:
    """One `paired` comparison as text: median [interval], rounds won, verdict."""
    interval = "[?]" if c["low"] is None else f"[{100 * c['low']:+.1f}, {100 * c['high']:+.1f}]"
    return f"{100 * c['median']:+.1f}% {interval}, faster in {c['wins']}/{c['rounds']} rounds: {c['verdict']}"
