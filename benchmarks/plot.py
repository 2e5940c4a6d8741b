"""The run's chart: peak-memory reduction against step-time overhead, per policy, with Pareto fronts."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt

from benchmarks.report import Row, atomic_write

COLORS = {"torch": "tab:red", "jax": "tab:blue", "diffusers": "tab:green"}
MARKERS = {"torch": "o", "jax": "s", "diffusers": "D"}


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points (overhead, reduction) no other point beats: lower or equal overhead, higher reduction."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


def _plottable(rows: list[Row]) -> list[Row]:
    return [
        r for r in rows if r["status"] == "ok" and r["time_overhead"] is not None and r["peak_reduction"] is not None
    ]


def _panel(ax: Any, rows: list[Row], batch_size: int) -> None:
    for fw in sorted({r["framework"] for r in rows}):
        mine = [r for r in rows if r["framework"] == fw]
        xs = [r["time_overhead"] for r in mine]
        ys = [100 * r["peak_reduction"] for r in mine]
        ax.scatter(xs, ys, c=COLORS.get(fw, "gray"), marker=MARKERS.get(fw, "^"), label=fw, zorder=3)
        for r, x, y in zip(mine, xs, ys, strict=True):
            ax.annotate(r["policy"], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        front = pareto_front(list(zip(xs, ys, strict=True)))
        ax.step(
            [p[0] for p in front],
            [p[1] for p in front],
            where="post",
            color=COLORS.get(fw, "gray"),
            alpha=0.6,
            linestyle="--",
            label=f"{fw} Pareto front",
        )
    ax.axhline(0, color="black", linewidth=0.5)
    ax.axvline(1, color="black", linewidth=0.5)
    ax.set_xlabel("step-time overhead vs none (x)")
    ax.set_ylabel("peak-memory reduction vs none (%)")
    ax.set_title(f"batch {batch_size}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")


def plot(rows: list[Row], path: Path, title: str) -> bool:
    """Write the PNG (atomically); False when no row has both figures to plot."""
    rows = _plottable(rows)
    if not rows:
        return False
    batches = sorted({r["batch_size"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        _panel(ax, [r for r in rows if r["batch_size"] == b], b)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write(path, lambda f: f.write(buf.getvalue()), binary=True)
    return True
