"""How the planner times steps, both frameworks: CPU seconds, policies in turn.

On a shared machine wall-clock time measures the neighbours too: the workers run single-threaded
(`shared_configs.planning.workers.worker_env`), so the process's CPU seconds add up to the step's work.
Policies are timed in turn (one step each per round, the median per policy), so that a drift lands
on none in particular, and compared round by round (`paired`): whole medians move more between
processes than policies differ by.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from shared_configs.planning.paired import paired, paired_text
from shared_configs.progress import tracked

__all__ = [
    "clock",
    "contenders",
    "cpu_split",
    "in_turn",
    "measured_rounds",
    "paired",
    "paired_text",
    "race",
    "times",
]

clock = time.process_time


@contextmanager
def cpu_split(into: dict[str, float], phase: str) -> Iterator[None]:
    """Add the block's CPU seconds to ``into[phase]``: a worker's time split (a profile's ``meta.cpu_s``)."""
    start = clock()
    try:
        yield
    finally:
        into[phase] = round(into.get(phase, 0.0) + clock() - start, 2)


def in_turn(steps: dict[str, Callable[[], None]], rounds: int) -> dict[str, list[float]]:
    """CPU seconds per policy of ``rounds`` steps taken in turn (each policy warmed up already)."""
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in tracked(range(rounds), "timing rounds", lambda _: f"{len(steps)} steps each"):
        _round(steps, steps, samples)
    return samples


def _round(steps: dict[str, Callable[[], None]], names: Iterable[str], samples: dict[str, list[float]]) -> None:
    for name in names:
        t0 = clock()
        steps[name]()
        samples[name].append(clock() - t0)


def race(
    steps: dict[str, Callable[[], None]], reference: str, rounds: int, min_rounds: int = 5, confidence: float = 0.9
) -> dict[str, list[float]]:
    """`in_turn`, for at most ``rounds`` rounds, dropping a contender from round ``min_rounds`` on as soon
    as another is faster round by round at ``confidence`` (`paired`), until one is left; ``reference``
    (the plain step) runs every round."""
    samples: dict[str, list[float]] = {name: [] for name in steps}
    alive = [name for name in steps if name != reference]
    left = lambda _: f"{len(alive)} candidate(s) left"  # noqa: E731 (reads alive as the race goes)
    for done in tracked(range(1, rounds + 1), "race rounds", left):
        _round(steps, [n for n in steps if n in alive or n == reference], samples)
        if done >= min_rounds:
            alive = [
                c
                for c in alive
                if not any(paired(samples[d], samples[c], confidence)["verdict"] == "faster" for d in alive if d != c)
            ]
        if len(alive) <= 1:
            break
    return samples


def measured_rounds(
    steps: dict[str, Callable[[], None]], peaks: dict[str, int], rounds: int, race_to: dict[str, Any] | None = None
) -> dict[str, list[float]]:
    """A measuring worker's rounds: every step `in_turn`; with ``race_to`` (``budget`` bytes,
    ``reference``, ``min_rounds``) a `race` of the steps whose ``peaks`` fit the budget (and the
    reference). The others are not timed: they have no rounds."""
    if race_to is None:
        return in_turn(steps, rounds)
    fit = {n: steps[n] for n in contenders(list(steps), peaks, race_to)}
    out = race(fit, race_to["reference"], rounds, race_to["min_rounds"])
    return {n: out.get(n, []) for n in steps}


def contenders(names: list[str], peaks: dict[str, int], race_to: dict[str, Any] | None) -> list[str]:
    """The steps `measured_rounds` times: all, or under ``race_to`` the reference and those that fit."""
    if race_to is None:
        return names
    return [n for n in names if n == race_to["reference"] or peaks[n] <= race_to["budget"]]


def times(samples: list[float]) -> dict[str, Any]:
    """A measured row's timing fields: the median step (None: not timed) and the rounds it is the median of."""
    return {"step_time_s": statistics.median(samples) if samples else None, "rounds_s": samples}
