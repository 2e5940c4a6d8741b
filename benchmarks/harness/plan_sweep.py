"""The planner's frontier (recompute cost against budget) beside the hand policies, measured.

Per framework: budgets spread from ``full``'s predicted peak to ``none``'s, the planner's plan at
each, then one measuring process runs every hand policy and plan, so each overhead is a ratio to
``none`` measured in the same process. Written as JSON and a PNG (overhead against peak).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt

from benchmarks.reports.plot import DPI
from benchmarks.reports.tables import write_json
from shared_configs.files import write_png
from shared_configs.planning.budget import Profile, predict, random_assignment, safety_margin
from shared_configs.planning.candidates import HAND_POLICIES
from shared_configs.planning.pipeline import Workload, checked_solve, get_profile, measure
from shared_configs.planning.solver import Infeasible, peak_range, solve
from shared_configs.planning.stepclock import paired, paired_text
from shared_configs.planning.units import FULL, PLAIN, SELECTIVE, assignment_of, block_layers, policy_string
from shared_configs.sizes import MIB


def _spread(low: int, high: int, steps: int, with_high: bool = True) -> list[int]:
    """Budgets ``steps`` equal steps apart from ``low`` up to ``high`` (included only ``with_high``)."""
    return [int(low + (high - low) * i / steps) for i in range(steps + with_high)]


def frontier(profile: Profile, workload: Workload, points: int = 24) -> list[dict[str, Any]]:
    """The planner's predicted (peak, overhead) from its smallest feasible budget to ``none``'s peak."""
    return [
        _predicted(profile, solve(profile, workload.spec, b).prediction) | {"budget_bytes": b}
        for b in _spread(*peak_range(profile, workload.spec), points)
    ]


def solve_times(profiles: list[Profile], workload: Workload, points: int = 12) -> dict[str, Any]:
    """Seconds the solver takes at ``points + 1`` budgets from the smallest feasible to ``none``'s peak."""
    seconds, cpu = [], []  # wall and CPU: on a shared machine the wall clock also measures the neighbours
    for budget in _spread(*peak_range(profiles, workload.spec), points):
        start, cpu_start = time.perf_counter(), time.process_time()
        solve(profiles, workload.spec, budget)
        seconds.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    return {
        "budgets": len(seconds),
        "unit_choices": sum(len(per) for per in profiles[0].units.values()),
        "median_s": float(np.median(seconds)),
        "max_s": max(seconds),
        "seconds": seconds,
        "median_cpu_s": float(np.median(cpu)),
        "max_cpu_s": max(cpu),
    }


def _predicted(profile: Profile, prediction: Any) -> dict[str, Any]:
    return {
        "predicted_peak_bytes": prediction.peak_bytes,
        "predicted_overhead": prediction.overhead(profile),
        "recompute_flops": prediction.flops,
    }


def sweep(
    workload: Workload,
    frameworks: tuple[str, ...],
    count: int,
    verify: bool,
    steps: int,
    ratios: list[float] | None = None,
    random_plans: int = 0,
) -> dict[str, Any]:
    """Per framework: the plans at ``count`` budgets and at ``balanced``'s predicted peak, the hand policies;
    measured if ``verify``, with torch.compile at ``ratios`` and ``random_plans`` seeded random plans."""
    spec = workload.spec
    doc: dict[str, Any] = {
        "config": spec.name,
        "sample_size": spec.sample_size,
        "batch_size": workload.batch_size,
        "frameworks": {},
    }
    for fw in frameworks:
        profile = get_profile(fw, workload)
        hand = {p: _of_policy(profile, spec, p) for p in HAND_POLICIES}
        margin = safety_margin(profile, spec)
        full, none, balanced = (hand[p]["predicted_peak_bytes"] for p in ("full", "none", "balanced"))
        budgets = [*_spread(full, none, count, with_high=False), balanced]
        plans = [p for p in (_plan_at(fw, workload, profile, b, margin) for b in budgets) if p is not None]
        plans[-1]["at"] = "balanced's predicted peak"
        rng = np.random.default_rng(0)
        randoms = [policy_string(random_assignment(spec, rng)) for _ in range(random_plans)]
        randoms = [{"plan": r} | _of_policy(profile, spec, r) for r in randoms]
        data: dict[str, Any] = {}
        compiled: dict[str, Any] = {}
        if verify:
            policies = list(dict.fromkeys([*HAND_POLICIES, *(p["plan"] for p in plans), *(r["plan"] for r in randoms)]))
            rows = measure(fw, workload, policies, steps, ratios if fw == "torch" else None)
            _attach(rows["rows"], hand, plans + randoms)
            for p in (p for p in plans if "measured_rounds_s" in p):  # round by round against each hand policy
                p["paired"] = {name: paired(p["measured_rounds_s"], h["measured_rounds_s"]) for name, h in hand.items()}
            compiled = _compiled(rows["rows"])
            plans += _at_measured_balanced(fw, workload, profile, hand["balanced"], margin, steps)
            data["measure_method"] = rows["method"]
        doc["frameworks"][fw] = data | {
            "hand": hand,
            "plans": plans,
            "random": randoms,
            "compiled": compiled,
            "margin": margin,
            "frontier": frontier(profile, workload),
            "method": profile.meta.get("method"),
            "profile_seconds": profile.meta.get("seconds"),
            "step_time_s": profile.step_time_s,
            "efficiency": efficiency(profile, workload),
        }
    return doc


def _of_policy(profile: Profile, spec: Any, policy: str) -> dict[str, Any]:
    """`_predicted` of a policy string."""
    return _predicted(profile, predict(profile, spec, assignment_of(spec, policy)))


def _plan_at(fw: str, workload: Workload, profile: Profile, budget: int, margin: float) -> dict[str, Any] | None:
    """The planner's plan at ``budget``, predicted; None where no plan fits."""
    try:
        sol = checked_solve([profile], workload, budget, margin, (fw,))
    except Infeasible:
        return None
    return {"budget_bytes": budget, "plan": sol.policy, **_predicted(profile, sol.prediction)}


def _at_measured_balanced(
    fw: str, workload: Workload, profile: Profile, balanced: dict[str, Any], margin: float, steps: int
) -> list[dict[str, Any]]:
    """The plan at ``balanced``'s measured peak, measured beside ``none`` and ``balanced`` in a process of its own."""
    entry = _plan_at(fw, workload, profile, balanced["measured_peak_bytes"], margin)
    if entry is None:
        return []
    entry["at"] = "balanced's measured peak"
    rows = measure(fw, workload, ["none", "balanced", entry["plan"]], steps)["rows"]
    _attach(rows, {}, [entry])
    return [
        entry
        | {
            "balanced_measured_overhead_here": rows["balanced"]["step_time_s"] / rows["none"]["step_time_s"] - 1,
            "paired": {h: paired(rows[entry["plan"]]["rounds_s"], rows[h]["rounds_s"]) for h in ("none", "balanced")},
        }
    ]


def _compiled(rows: dict[str, Any]) -> dict[str, Any]:
    """torch.compile rows, overheads against the eager ``none`` of the same process."""
    base = rows["none"]["step_time_s"]
    return {
        name: {
            "measured_allocator_peak_bytes": r["allocator_peak_bytes"],
            "measured_overhead": r["step_time_s"] / base - 1,
            "compile_s": r["compile_s"],
        }
        for name, r in rows.items()
        if name.startswith("torch.compile:")
    }


def _attach(rows: dict[str, Any], hand: dict[str, Any], plans: list[dict[str, Any]]) -> None:
    """Measured peaks and overheads (against ``none`` of the same process) into the predictions."""
    base = rows["none"]["step_time_s"]
    for policy, entry in [*hand.items(), *((p["plan"], p) for p in plans)]:
        row = rows[policy]
        entry |= {
            "measured_peak_bytes": row["peak_bytes"],
            "measured_overhead": row["step_time_s"] / base - 1,
            "measured_rounds_s": row["rounds_s"],
            **({"measured_allocator_peak_bytes": row["allocator_peak_bytes"]} if "allocator_peak_bytes" in row else {}),
            "peak_error": entry["predicted_peak_bytes"] / row["peak_bytes"] - 1,
        }


def table(doc: dict[str, Any]) -> str:
    """Budget -> plan -> predicted vs measured, and the best measured hand policy that fits."""
    lines = []
    for fw, data in doc["frameworks"].items():
        lines.append(
            f"{fw}: budget MiB | predicted -> measured peak MiB | overhead predicted -> measured | "
            "best hand policy that fits (measured) | plan"
        )
        for p in data["plans"]:
            best = _best_fit(data["hand"], p["budget_bytes"])
            if data.get("compiled") and "measured_allocator_peak_bytes" in p:
                # allocator level on both sides: torch.compile runs eagerly under the tensor tracker
                limit = p["measured_allocator_peak_bytes"]
                best += " | torch.compile at the plan's allocator peak: " + _best_fit(data["compiled"], limit, True)
            measured, nan = p.get("measured_peak_bytes"), float("nan")
            lines.append(
                f"  {p['budget_bytes'] / MIB:8.1f} | {p['predicted_peak_bytes'] / MIB:8.1f} -> "
                f"{measured / MIB if measured else nan:8.1f} | {100 * p['predicted_overhead']:+6.1f}% -> "
                f"{100 * p.get('measured_overhead', nan):+6.1f}% | {best} | {p['plan']}"
            )
    return "\n".join(lines)


def against_balanced(doc: dict[str, Any]) -> str:
    """What the planner picks at ``balanced``'s predicted peak, beside ``balanced`` (both measured)."""
    return "\n".join(
        f"{fw}: at {p['at']} ({p['budget_bytes'] / MIB:.1f} MiB) the planner picks {p['plan']}: "
        f"{p['measured_peak_bytes'] / MIB:.1f} MiB, {100 * p['measured_overhead']:+.1f}%; balanced: "
        f"{data['hand']['balanced']['measured_peak_bytes'] / MIB:.1f} MiB, "
        f"{100 * p.get('balanced_measured_overhead_here', data['hand']['balanced']['measured_overhead']):+.1f}%"
        for fw, data in doc["frameworks"].items()
        for p in data["plans"]
        if p.get("at") and "measured_peak_bytes" in p
    )


def against_hand(doc: dict[str, Any]) -> str:
    """Each measured plan against every hand policy that fits its budget, round by round: the claim at 90%."""
    lines = []
    for fw, data in doc["frameworks"].items():
        hand = data["hand"]  # measured wherever a plan is paired with it
        for p in (p for p in data["plans"] if "paired" in p):
            fits = {
                n: c
                for n, c in p["paired"].items()
                if n != "none" and hand[n]["measured_peak_bytes"] <= p["budget_bytes"]
            }
            slower = [n for n, c in fits.items() if c["verdict"] == "slower"]
            claim = "no fitting hand policy" if not fits else f"slower than {', '.join(slower)}" if slower else "holds"
            lines.append(f"{fw} {p['budget_bytes'] / MIB:.1f} MiB ({p['plan']}): claim {claim}")
            lines += [f"    vs {n}: {paired_text(c)}" for n, c in fits.items()]
    return "\n".join(lines)


def errors(doc: dict[str, Any]) -> str:
    """The peak model's error over every measured plan (hand policies, planner plans, random mixes)."""
    lines = []
    for fw, data in doc["frameworks"].items():
        entries = [*data["hand"].values(), *data["plans"], *data.get("random", [])]
        errs = np.array([e["peak_error"] for e in entries if "peak_error" in e])
        if errs.size:
            lines.append(
                f"{fw}: peak prediction error over {errs.size} measured plans: median "
                f"{100 * np.median(errs):+.2f}%, |error| max {100 * np.abs(errs).max():.2f}%, within 5%: "
                f"{100 * np.mean(np.abs(errs) <= 0.05):.0f}%"
            )
    return "\n".join(lines)


def _best_fit(entries: dict[str, Any], budget: int, allocator: bool = False) -> str:
    """The measured entry of least overhead whose measured (allocator-level) peak fits ``budget``."""
    key = "measured_allocator_peak_bytes" if allocator else "measured_peak_bytes"
    fits = [(e["measured_overhead"], name) for name, e in entries.items() if e.get(key, budget + 1) <= budget]
    return f"{min(fits)[1]} {100 * min(fits)[0]:+.1f}%" if fits else "none fits"


def plot(doc: dict[str, Any], path: Path) -> None:
    """Overhead against peak per framework: predicted frontier, measured plans, hand policies."""
    fws = list(doc["frameworks"])
    fig, axes = plt.subplots(1, len(fws), figsize=(6.5 * len(fws), 4.8), squeeze=False)
    for ax, fw in zip(axes[0], fws, strict=True):
        data = doc["frameworks"][fw]
        front = data["frontier"]
        ax.step(
            [f["predicted_peak_bytes"] / MIB for f in front],
            [100 * f["predicted_overhead"] for f in front],
            where="post",
            color="tab:gray",
            label="planner, predicted",
        )
        measured = [p for p in data["plans"] if "measured_peak_bytes" in p]
        ax.scatter(
            [p["measured_peak_bytes"] / MIB for p in measured],
            [100 * p["measured_overhead"] for p in measured],
            marker="*",
            s=120,
            color="tab:red",
            label="planner, measured",
            zorder=3,
        )
        for name, h in data["hand"].items():
            x, y = (
                h.get("measured_peak_bytes", h["predicted_peak_bytes"]),
                h.get("measured_overhead", h["predicted_overhead"]),
            )
            ax.scatter([x / MIB], [100 * y], color="tab:blue", zorder=3)
            ax.annotate(name, (x / MIB, 100 * y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set(
            xlabel="peak memory of the step (MiB)",
            ylabel="step-time overhead vs none (%)",
            title=f"{fw}: {doc['config']} {doc['sample_size']}x{doc['sample_size']}, batch {doc['batch_size']}",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    write_png(fig, path, dpi=DPI)


def write(doc: dict[str, Any], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "plan_sweep.json", folder / "plan_sweep.png"]
    write_json(paths[0], doc)
    plot(doc, paths[1])
    return paths


def _level(unit: str, levels: int) -> int:
    """Resolution level of a unit (0 = full resolution): down.i -> i, up.i -> levels - 1 - i, mid deepest."""
    kind, _, rest = unit.partition(".")
    if kind == "mid":
        return levels - 1
    i = int(rest.split(".")[0])
    return i if kind == "down" else levels - 1 - i


def efficiency(profile: Profile, workload: Workload) -> list[dict[str, Any]]:
    """Bytes a recompute frees per second it costs, per layer and block (freed: its plain ``keep`` minus
    its ``keep`` under the choice); "sampler" rows are each block minus its layers."""
    units, rows, levels = profile.units, [], workload.spec.num_levels
    for block, layers in block_layers(workload.spec).items():
        for choice in (FULL, SELECTIVE):
            per_layer = [
                (
                    "resnet" if ".resnets." in n else "attention",
                    n,
                    units[n][PLAIN].keep - units[n][choice].keep,
                    units[n][choice].time_s,
                )
                for n in layers
                if n in units and choice in units[n]
            ]
            whole = units[block][choice]
            freed, seconds = sum(units[n][PLAIN].keep for n in layers) - whole.keep, whole.time_s
            sampler = freed - sum(r[2] for r in per_layer), seconds - sum(r[3] for r in per_layer)
            rows += [
                {
                    "level": _level(name, levels),
                    "kind": kind,
                    "unit": name,
                    "choice": choice,
                    "freed_bytes": f,
                    "seconds": t,
                    "mib_per_s": f / MIB / t if t > 0 else None,
                }
                for kind, name, f, t in [*per_layer, ("block", block, freed, seconds), ("sampler", block, *sampler)]
            ]
    return rows


def efficiency_table(rows: list[dict[str, Any]]) -> str:
    """MiB freed per recompute-second, summed by (level, kind, choice)."""
    lines = ["level | kind | choice | freed MiB | recompute s | MiB per recompute-second"]
    for level, kind, choice in sorted({(r["level"], r["kind"], r["choice"]) for r in rows}):
        mine = [r for r in rows if (r["level"], r["kind"], r["choice"]) == (level, kind, choice)]
        freed, seconds = sum(r["freed_bytes"] / MIB for r in mine), sum(r["seconds"] for r in mine)
        rate = f"{freed / seconds:10.0f}" if seconds > 0 else "         -"
        lines.append(f"{level:5d} | {kind:9s} | {choice:16s} | {freed:9.1f} | {seconds:11.3f} | {rate}")
    return "\n".join(lines)
