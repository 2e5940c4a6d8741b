"""The run's charts: peak-memory reduction against step-time overhead, per policy, with Pareto
fronts; and memory over the step (the timelines), per framework, for none and a checkpointed plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt

from benchmarks.reports import tables
from benchmarks.reports.tables import Row
from shared_configs.files import write_png
from shared_configs.memory import CATEGORIES
from shared_configs.sizes import MIB

COLORS = {"torch": "tab:red", "jax": "tab:blue", "diffusers": "tab:green"}
MARKERS = {"torch": "o", "jax": "s", "diffusers": "D"}
DPI = 120


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points (overhead, reduction) no other point beats: lower or equal overhead, higher reduction."""
    front: list[tuple[float, float]] = []
    for x, y in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return front


def _labels(points: list[tuple[str, float, float]], ax: Any) -> None:
    """Each point's policy beside it, pushed up where it would print over an earlier label."""
    placed: list[tuple[float, float]] = []
    x_span = max(abs(ax.get_xlim()[1] - ax.get_xlim()[0]), 1e-9)
    y_span = max(abs(ax.get_ylim()[1] - ax.get_ylim()[0]), 1e-9)
    for text, x, y in sorted(points, key=lambda p: (p[2], p[1])):
        dy = 4
        # a label is about 0.12 of the axes wide and 0.05 high at fontsize 8 in this figure
        while any(abs(x - px) / x_span < 0.12 and abs(y + dy * y_span / 300 - py) / y_span < 0.05 for px, py in placed):
            dy += 10
        placed.append((x, y + dy * y_span / 300))
        ax.annotate(text, (x, y), textcoords="offset points", xytext=(5, dy), fontsize=8)


def _panel(ax: Any, rows: list[Row], batch_size: int, unreliable: float | None) -> None:
    points = []
    for fw in sorted({r["framework"] for r in rows}):
        mine = [r for r in rows if r["framework"] == fw]
        xs = [r["time_overhead"] for r in mine]
        ys = [100 * r["peak_reduction"] for r in mine]
        color = COLORS.get(fw, "gray")
        ax.scatter(
            xs,
            ys,
            facecolors="none" if unreliable is not None else color,  # unreliable timings: hollow, said in the legend
            edgecolors=color,
            marker=MARKERS.get(fw, "^"),
            label=fw,
            zorder=3,
        )
        points += [(r["policy"], x, y) for r, x, y in zip(mine, xs, ys, strict=True)]
        front = pareto_front(list(zip(xs, ys, strict=True)))
        if len(front) > 1:  # a front of one point draws no line: nothing to put in the legend
            ax.step(
                [p[0] for p in front],
                [p[1] for p in front],
                where="post",
                color=color,
                alpha=0.6,
                linestyle="--",
                label=f"{fw} Pareto front",
            )
    ax.axhline(0, color="black", linewidth=0.5)
    ax.axvline(1, color="black", linewidth=0.5)
    _labels(points, ax)
    ax.set(
        xlabel="step-time overhead vs none (x)", ylabel="peak-memory reduction vs none (%)", title=f"batch {batch_size}"
    )
    ax.grid(alpha=0.3)
    if unreliable is not None:
        ax.text(
            0.5,
            0.02,
            f"hollow: timings unreliable (other processes used {unreliable:.0%} of the cores)",
            transform=ax.transAxes,
            ha="center",
            fontsize=7,
            color="tab:red",
        )
    ax.legend(fontsize=8, loc="best")


# Each kind of the peak's parts: (colour, legend label).
KINDS = {
    "params": ("#4c72b0", "parameters"),
    "optimizer": ("#8172b3", "optimizer state"),
    "grads": ("#dd8452", "gradients"),
    "input": ("#937860", "inputs"),
    "activation": ("#55a868", "activations"),
    "temporary": ("#c44e52", "temporaries"),
}


def _timeline_panel(ax: Any, record: dict[str, Any], top: float) -> None:
    """One step: live MiB by kind (stacked) over the step's positions, block starts marked."""
    n = max(record["positions"] - 1, 1)
    xs = [100 * x / n for x in record["x"]]
    ys = [[v / MIB for v in record["series"][kind]] for kind in CATEGORIES]
    ax.stackplot(xs, ys, colors=[KINDS[k][0] for k in CATEGORIES], labels=[KINDS[k][1] for k in CATEGORIES])
    phases = record["phases"]
    if "backward" in phases:
        end = 100 * phases.get("optimizer", n) / n
        ax.axvspan(100 * phases["backward"] / n, end, color="gray", alpha=0.12, lw=0)
        ax.text(100 * phases["backward"] / n, top * 1.02, " backward", fontsize=7, va="bottom", color="dimgray")
        ax.text(0, top * 1.02, "forward", fontsize=7, va="bottom", color="dimgray")
        if "optimizer" in phases:
            ax.text(end, top * 1.02, " optimizer", fontsize=7, va="bottom", color="dimgray")
    labelled = -100.0
    for position, block in record["marks"]:
        x = 100 * position / n
        ax.axvline(x, color="black", lw=0.4, alpha=0.5)
        if x - labelled >= 2.5:  # a label per line where they would not overprint each other
            ax.text(x, top * 0.98, f" {block}", rotation=90, fontsize=6, va="top", ha="left")
            labelled = x
    peak = max(sum(col) for col in zip(*ys, strict=True))
    ax.axhline(peak, color="black", ls="--", lw=0.7)
    ax.text(100, peak, f"peak {peak:,.0f} MiB", fontsize=7, ha="right", va="bottom")
    ax.set(
        xlim=(0, 100),
        ylim=(0, top * 1.12),
        xlabel="position in the step (% of ops in execution order)",
        ylabel="live MiB",
    )
    ax.set_title(f"{record['framework']} {record['policy']} @ batch {record['batch_size']}", fontsize=9)


def plot_timelines(records: list[dict[str, Any]], path: Path, title: str) -> bool:
    """The timeline PNG: a row per framework, a panel per policy; False when there is nothing to draw."""
    if not records:
        return False
    frameworks = list(dict.fromkeys(r["framework"] for r in records))
    policies = list(dict.fromkeys(r["policy"] for r in records))
    fig, axes = plt.subplots(
        len(frameworks), len(policies), figsize=(6.5 * len(policies), 3.8 * len(frameworks)), squeeze=False
    )
    for i, fw in enumerate(frameworks):
        mine = [r for r in records if r["framework"] == fw]
        top = max(sum(col) for r in mine for col in zip(*r["series"].values(), strict=True)) / MIB
        for j, policy in enumerate(policies):
            record = next((r for r in mine if r["policy"] == policy), None)
            if record is None:
                axes[i][j].axis("off")
            else:
                _timeline_panel(axes[i][j], record, top)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7, bbox_to_anchor=(0.5, 0.02))
    methods = "; ".join(f"{fw}: {next(r['method'] for r in records if r['framework'] == fw)}" for fw in frameworks)
    fig.suptitle(f"{title}\nmemory over one training step", fontsize=10)
    fig.text(0.5, 0.005, methods, ha="center", va="bottom", fontsize=6, wrap=True)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    write_png(fig, path, dpi=DPI)
    return True


def plot(rows: list[Row], path: Path, title: str, unreliable: float | None = None) -> bool:
    """The Pareto PNG; False when no row has both figures. ``unreliable``: other processes' share."""
    rows = [r for r in rows if r["status"] == "ok" and None not in (r["time_overhead"], r["peak_reduction"])]
    if not rows:
        return False
    batches = sorted({r["batch_size"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, b in zip(axes[0], batches, strict=True):
        _panel(ax, [r for r in rows if r["batch_size"] == b], b, unreliable)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    write_png(fig, path, dpi=DPI)
    return True


def write_plots(document: dict[str, Any], out: Path, stem: str) -> list[Path]:
    """A run's pictures, ``<out>/<stem>.png`` (the Pareto plot) and ``-timeline.png``: those drawn."""
    device = next((d["name"] for fw, d in document["device"].items() if fw != "requested"), "?")
    title, share = tables.title(document), tables.unreliable_share(document)
    drawn = {
        out / f"{stem}.png": plot(document["rows"], out / f"{stem}.png", f"{title}\n{device}", share),
        out / f"{stem}-timeline.png": plot_timelines(
            document.get("timelines", []), out / f"{stem}-timeline.png", title
        ),
    }
    return [path for path, ok in drawn.items() if ok]
