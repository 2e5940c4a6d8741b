"""The planner's frontier (recompute cost against budget) beside the hand policies, measured.

For each framework: the profile's predictions of the hand policies set the budgets (spread from
``full``'s predicted peak to ``none``'s); the planner solves each; then one measuring process per
framework runs every hand policy and every plan with the benchmark's instruments, so each
overhead is a ratio to ``none`` measured in the same process. The result is a JSON document and a
PNG (step-time overhead against peak memory: the predicted frontier, the plans measured, the hand
policies measured).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt

from benchmarks.planner import Workload, get_profile, measure
from benchmarks.report import atomic_write, write_json
from shared_configs.budget import Profile, assignment_of, predict
from shared_configs.solver import Infeasible, smallest_peak, solve

HAND_POLICIES = ("none", "full", "balanced", "layers", "save_convs", "layers/save=conv,matmul")
MIB = 2**20


def budgets(profile: Profile, workload: Workload, count: int) -> list[int]:
    """``count`` budgets from ``full``'s predicted peak up to, not including, ``none``'s."""
    spec = workload.spec
    low = predict(profile, spec, assignment_of(spec, "full")).peak_bytes
    high = predict(profile, spec, {}).peak_bytes
    return [int(low + (high - low) * i / count) for i in range(count)]


def frontier(profile: Profile, workload: Workload, points: int = 24) -> list[dict[str, Any]]:
    """The planner's predicted (peak, overhead) from its smallest feasible budget to ``none``'s peak."""
    spec = workload.spec
    low = smallest_peak(profile, spec).prediction.peak_bytes
    high = predict(profile, spec, {}).peak_bytes
    out = []
    for i in range(points + 1):
        sol = solve(profile, spec, int(low + (high - low) * i / points))
        out.append(_predicted(profile, sol.prediction) | {"budget_bytes": int(low + (high - low) * i / points)})
    return out


def _predicted(profile: Profile, prediction: Any) -> dict[str, Any]:
    return {
        "predicted_peak_bytes": prediction.peak_bytes,
        "predicted_overhead": prediction.overhead(profile),
        "recompute_flops": prediction.flops,
    }


def sweep(workload: Workload, frameworks: tuple[str, ...], count: int, verify: bool, steps: int) -> dict[str, Any]:
    """Per framework: budgets, the planner's plan at each, the hand policies; measured if ``verify``."""
    doc: dict[str, Any] = {"config": workload.spec.name, "sample_size": workload.spec.sample_size,
                           "batch_size": workload.batch_size, "frameworks": {}}  # fmt: skip
    for fw in frameworks:
        profile = get_profile(fw, workload)
        spec = workload.spec
        hand = {p: _predicted(profile, predict(profile, spec, assignment_of(spec, p))) for p in HAND_POLICIES}
        plans = []
        for budget in budgets(profile, workload, count):
            try:
                sol = solve(profile, spec, budget)
            except Infeasible:
                continue
            plans.append({"budget_bytes": budget, "plan": sol.policy, **_predicted(profile, sol.prediction)})
        if verify:
            rows = measure(fw, workload, list(dict.fromkeys([*HAND_POLICIES, *(p["plan"] for p in plans)])), steps)
            _attach(rows["rows"], hand, plans)
            doc["frameworks"].setdefault(fw, {})["measure_method"] = rows["method"]
        doc["frameworks"].setdefault(fw, {}).update(
            hand=hand, plans=plans, frontier=frontier(profile, workload), method=profile.meta.get("method"),
            profile_seconds=profile.meta.get("seconds"), step_time_s=profile.step_time_s,
        )  # fmt: skip
    return doc


def _attach(rows: dict[str, Any], hand: dict[str, Any], plans: list[dict[str, Any]]) -> None:
    """Measured peaks and overheads (against ``none`` of the same process) into the predictions."""
    base = rows["none"]["step_time_s"]
    for policy, entry in [*hand.items(), *((p["plan"], p) for p in plans)]:
        row = rows[policy]
        entry["measured_peak_bytes"] = row["peak_bytes"]
        entry["measured_overhead"] = row["step_time_s"] / base - 1
        entry["peak_error"] = entry["predicted_peak_bytes"] / row["peak_bytes"] - 1


def table(doc: dict[str, Any]) -> str:
    """Budget -> plan -> predicted vs measured, and the best measured hand policy that fits."""
    lines = []
    for fw, data in doc["frameworks"].items():
        lines.append(f"{fw}: budget MiB | predicted -> measured peak MiB | overhead predicted -> measured | "
                     "best hand policy that fits (measured) | plan")  # fmt: skip
        for p in data["plans"]:
            fits = [(h["measured_overhead"], name) for name, h in data["hand"].items()
                    if h.get("measured_peak_bytes", 1 << 62) <= p["budget_bytes"]]  # fmt: skip
            best = f"{min(fits)[1]} {100 * min(fits)[0]:+.1f}%" if fits else "none fits"
            measured = p.get("measured_peak_bytes")
            lines.append(
                f"  {p['budget_bytes'] / MIB:8.1f} | {p['predicted_peak_bytes'] / MIB:8.1f} -> "
                f"{measured / MIB if measured else float('nan'):8.1f} | {100 * p['predicted_overhead']:+6.1f}% -> "
                f"{100 * p.get('measured_overhead', float('nan')):+6.1f}% | {best} | {p['plan']}"
            )
    return "\n".join(lines)


def plot(doc: dict[str, Any], path: Path) -> None:
    """Overhead against peak per framework: predicted frontier, measured plans, hand policies."""
    fws = list(doc["frameworks"])
    fig, axes = plt.subplots(1, len(fws), figsize=(6.5 * len(fws), 4.8), squeeze=False)
    for ax, fw in zip(axes[0], fws, strict=True):
        data = doc["frameworks"][fw]
        front = data["frontier"]
        ax.step([f["predicted_peak_bytes"] / MIB for f in front], [100 * f["predicted_overhead"] for f in front],
                where="post", color="tab:gray", label="planner, predicted")  # fmt: skip
        measured = [p for p in data["plans"] if "measured_peak_bytes" in p]
        ax.scatter([p["measured_peak_bytes"] / MIB for p in measured], [100 * p["measured_overhead"] for p in measured],
                   marker="*", s=120, color="tab:red", label="planner, measured", zorder=3)  # fmt: skip
        for name, h in data["hand"].items():
            x, y = h.get("measured_peak_bytes", h["predicted_peak_bytes"]), h.get("measured_overhead")
            y = h["predicted_overhead"] if y is None else y
            ax.scatter([x / MIB], [100 * y], color="tab:blue", zorder=3)
            ax.annotate(name, (x / MIB, 100 * y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel("peak memory of the step (MiB)")
        ax.set_ylabel("step-time overhead vs none (%)")
        ax.set_title(f"{fw}: {doc['config']} {doc['sample_size']}x{doc['sample_size']}, batch {doc['batch_size']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    atomic_write(path, lambda f: f.write(buf.getvalue()), binary=True)


def write(doc: dict[str, Any], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "plan_sweep.json", folder / "plan_sweep.png"]
    write_json(paths[0], doc)
    plot(doc, paths[1])
    return paths
