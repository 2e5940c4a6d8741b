"""How the planner times steps, both frameworks: CPU seconds, policies in turn.

This machine is shared: wall-clock time measures the neighbours as much as the step. The planner's
workers run single-threaded (torch ``set_num_threads(1)``; XLA's Eigen single-threaded, see
`benchmarks.planner.worker_env`), so the process's CPU seconds add up to the step's work. Policies
are timed in turn (one step each, ``steps`` rounds, the median per policy), so that a drift over
the run (caches, the allocator's pages) does not land on whichever policy ran first.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

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
