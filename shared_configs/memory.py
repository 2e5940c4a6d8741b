"""Memory over a training step, framework-free: the kinds a peak is split into (`CATEGORIES`), the block a
name is in, and `timeline`, the record behind the timeline picture: per position in the step (a torch op,
an XLA schedule slot) the live bytes of each kind, thinned to ``points`` positions that keep the peak, with
the block and phase marks. The planner's per-buffer timeline is another thing: `shared_configs.planning.timeline`.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

# The kinds of memory a peak is split into, in stacking order; together they add up to the peak.
# Row columns are f"{kind}_bytes".
CATEGORIES: tuple[str, ...] = ("params", "optimizer", "grads", "input", "activation", "temporary")
OUTSIDE = "(top)"  # conv_in, time embedding, conv_out, the loss, the optimizer: in no U-Net block
_BLOCK = re.compile(r"(?:^|[/.])(?:(down|up)[._](\d+)|(mid))(?=$|[/.])")


def block_of(path: str) -> str:
    """The U-Net block (``down.1``, ``mid``, ...) a torch module path or an XLA name stack is in, else `OUTSIDE`."""
    match = _BLOCK.search(path)
    if match is None:
        return OUTSIDE
    return "mid" if match[3] else f"{match[1]}.{match[2]}"


POINTS = 1500  # positions kept per timeline: enough for a figure, small in the JSON


def timeline(
    series: Mapping[str, np.ndarray],
    blocks: Sequence[str],
    phases: Mapping[str, int],
    method: str,
    points: int = POINTS,
) -> dict[str, Any]:
    """The record for one step, from each position's live bytes per kind (``series``), block and phase starts."""
    stacked = np.stack([np.asarray(series[c], dtype=np.int64) for c in CATEGORIES])
    keep = _peaks_per_stretch(stacked.sum(axis=0), points)
    return {
        "positions": stacked.shape[1],
        "x": keep.tolist(),
        "series": {c: stacked[i, keep].tolist() for i, c in enumerate(CATEGORIES)},
        "marks": block_marks(blocks, phases.values()),
        "phases": {name: int(pos) for name, pos in phases.items()},
        "method": method,
    }


def _peaks_per_stretch(total: np.ndarray, points: int) -> np.ndarray:
    """Indices: the highest position of each of ``points`` equal stretches (and the last one)."""
    n = len(total)
    if n <= points:
        return np.arange(n)
    edges = np.linspace(0, n, points + 1).astype(int)
    keep = [lo + int(np.argmax(total[lo:hi])) for lo, hi in itertools.pairwise(edges) if hi > lo]
    return np.unique(np.array([*keep, n - 1]))


def block_marks(blocks: Sequence[str], phase_starts: Iterable[int] = (), share: float = 0.004) -> list[tuple[int, str]]:
    """(position, block) where each stretch of a block begins: `OUTSIDE` positions do not break one, a phase start
    does; stretches under ``share`` of the step (small ops XLA hoists among other blocks') are left out."""
    starts, shortest = sorted(set(phase_starts)), max(1, int(share * len(blocks)))
    inside = ((i, block) for i, block in enumerate(blocks) if block != OUTSIDE)
    marks: list[tuple[int, str]] = []
    current = None  # (phase, block) of the last mark
    # a stretch: positions in a row (`OUTSIDE` ones left out) of one block in one phase
    for key, stretch in itertools.groupby(inside, lambda pos: (bisect.bisect_right(starts, pos[0]), pos[1])):
        positions = [i for i, _ in stretch]
        if len(positions) >= shortest and key != current:
            marks.append((positions[0], key[1]))
            current = key
    return marks
