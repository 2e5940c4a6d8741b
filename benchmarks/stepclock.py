"""How the planner times steps, both frameworks: CPU seconds, policies in turn.

This machine is shared: wall-clock time measures the neighbours as much as the step. The planner's
workers run single-threaded (torch ``set_num_threads(1)``; XLA's Eigen single-threaded, see
`shared_configs.planning.planner.worker_env`), so the process's CPU seconds add up to the step's work. Policies
are timed in turn (one step each, ``steps`` rounds, the median per policy), so that a drift over
the run (caches, the allocator's pages) does not land on whichever policy ran first, and two
policies are compared round by round (`paired`), since on a shared CPU whole medians move more
between processes than the policies differ by.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from scipy.stats import quantile_test

clock = time.process_time


def in_turn(steps: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """CPU seconds per policy of ``rounds`` steps taken in turn (each policy warmed up already)."""
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t0 = clock()
            step()
            samples[name].append(clock() - t0)
    return samples


def round_robin(steps: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median CPU seconds per policy of ``rounds`` steps taken in turn (each policy warmed up already)."""
    return {name: statistics.median(values) for name, values in in_turn(steps, rounds).items()}


def times(samples: list[float]) -> dict[str, Any]:
    """A measured row's timing fields: the median step and the rounds it is the median of."""
    return {"step_time_s": statistics.median(samples), "rounds_s": samples}


def paired(a: list[float], b: list[float], confidence: float = 0.9) -> dict[str, Any]:
    """``a`` against ``b``, round by round (both from one `in_turn`): the median of ``a_i / b_i - 1``,
    its distribution-free confidence interval (the sign test's, `scipy.stats.quantile_test`), and
    the rounds ``a`` was faster in. Pairing by round cancels what a round shares (the neighbours, a
    drift), which moves whole medians by 15-20 points between processes on this machine."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired: {len(a)} and {len(b)} rounds; need the same number, at least one")
    ratios = np.asarray(a) / np.asarray(b) - 1
    ci = quantile_test(ratios, q=0, p=0.5).confidence_interval(confidence)
    low, high = (float(v) if np.isfinite(v) else None for v in (ci.low, ci.high))  # nan: too few rounds
    verdict = ("too few rounds" if low is None or high is None
               else "faster" if high < 0 else "slower" if low > 0 else "within noise")  # fmt: skip
    return {"median": float(np.median(ratios)), "low": low, "high": high, "confidence": confidence,
            "wins": int(np.sum(ratios < 0)), "rounds": len(a), "verdict": verdict}  # fmt: skip


def paired_text(c: dict[str, Any]) -> str:
    """One `paired` comparison as text: median [interval], rounds won, verdict."""
    interval = "[?]" if c["low"] is None else f"[{100 * c['low']:+.1f}, {100 * c['high']:+.1f}]"
    return f"{100 * c['median']:+.1f}% {interval}, faster in {c['wins']}/{c['rounds']} rounds: {c['verdict']}"
