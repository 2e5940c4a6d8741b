"""`benchmarks.plan`'s answer as a person reads it: the policy string with a link to its grammar,
per framework the plan's peak beside none's and full's and what it saves for what it costs, and a
listing per block of what is recomputed, which op classes' outputs are saved, and what is kept."""

from __future__ import annotations

import json
from typing import Any

from shared_configs import SpecError
from shared_configs.pair import ControlNetPairSpec
from shared_configs.planning import candidates
from shared_configs.planning.budget import Profile, predict
from shared_configs.planning.pipeline import Workload
from shared_configs.planning.stepclock import paired_text
from shared_configs.planning.units import FULL, PLAIN, assignment_of, is_pseudo, segments
from shared_configs.sizes import MIB

GRAMMAR = "docs/spec_and_plans.md#checkpoint-plans"


def references(profile: Profile, workload: Workload) -> dict[str, int]:
    """The hand policies' predicted peaks a plan is read against: none (nothing recomputed) and full."""
    out = {}
    for policy in ("none", FULL):
        try:
            out[policy] = predict(profile, workload.spec, assignment_of(workload.spec, policy)).peak_bytes
        except SpecError:  # a step with no such policy (the ControlNet pair names its units apart)
            continue
    return out


def _ops(choice: str) -> str:
    return choice.removeprefix("save=").replace(",", ", ")


def block_line(block: str, layers: tuple[str, ...], assignment: dict[str, str]) -> str:
    """``down.1: recomputed attentions.1 | saving conv, matmul: resnets.1 | kept resnets.0, downsample``."""
    if block in assignment:
        choice = assignment[block]
        return f"{block}: recomputed whole" + ("" if choice == FULL else f", saving {_ops(choice)} outputs")
    groups: dict[str, list[str]] = {}
    for layer in layers:
        groups.setdefault(assignment.get(layer, PLAIN), []).append(layer.removeprefix(block + ".") or block)
    if list(groups) == [PLAIN]:
        return f"{block}: kept"
    parts = [f"recomputed {', '.join(groups[FULL])}"] if FULL in groups else []
    parts += [f"saving {_ops(c)}: {', '.join(names)}" for c, names in groups.items() if c not in (FULL, PLAIN)]
    parts += [f"kept {', '.join(groups[PLAIN])}"] if PLAIN in groups else []
    return f"{block}: " + " | ".join(parts)


def blocks(workload: Workload, policy: str) -> list[str]:
    """One `block_line` per block of the step, in forward order."""
    assignment = assignment_of(workload.spec, policy)
    return [block_line(b, layers, assignment) for b, layers in segments(workload.spec) if not is_pseudo(b)]


def versus(d: dict[str, Any]) -> str:
    """``saves 31% of none's peak (none 1,800.0 MiB, full 900.0 MiB) for +12.0% step time``."""
    refs = d.get("reference_peak_bytes", {})
    none = refs.get("none")
    saved = f"saves {1 - d['predicted_peak_bytes'] / none:.0%} of none's peak" if none else "its peak"
    shown = ", ".join(f"{p} {v / MIB:,.1f} MiB" for p, v in refs.items())
    return f"{saved} ({shown}) for {100 * d['predicted_overhead']:+.1f}% step time"


def render(doc: dict[str, Any], workload: Workload) -> str:
    """The plan, what each framework predicts of it against none and full, and the per-block listing."""
    spec, n = workload.spec, doc.get("world_size", 1)
    ranks = f" per rank of {n} ({doc['distributed']})" if n > 1 else ""
    what = (
        f"{spec.name} at {spec.sample_size}x{spec.sample_size}, batch {workload.batch_size}{ranks}, "
        f"{workload.regime.describe()}"
    )
    if doc["budget_bytes"] is None:
        head = f"the policy given, for {what} (predicted from the profile, not solved):"
    else:
        head = (
            f"plan for {what}, budget {doc['budget_bytes'] / MIB:,.1f} MiB, planned {100 * doc['margin']:.1f}% "
            f"below it (the model's error on its profile steps and 0.5%, more where its checked peak was over "
            f"it; solved in {doc['solve_seconds']:.2f} s):"
        )
    lines = [f"{head} (the policy's grammar: {GRAMMAR})", f"  settings: {doc['settings']}", f"  policy: {doc['plan']}"]
    if not isinstance(spec, ControlNetPairSpec):  # a pair plan goes to both networks (torch_impl.pair), not a spec
        lines.append(f"  yaml:   checkpoint: {json.dumps(doc['plan'])}")
    for fw, d in doc["frameworks"].items():
        on = f" on {workload.device}, allocated" if workload.device != "cpu" and fw == "torch" else ""
        lines.append(f"  {fw}: predicted peak{on} {d['predicted_peak_bytes'] / MIB:,.1f} MiB: {versus(d)}")
        modelled = f" [{d['modelled']}]" if "modelled" in d else ""
        lines.append(
            f"    peak at {d['peak_at']}; time {d['time_method']}; recompute "
            f"{d['recompute_flops'] / 1e9:.1f} GFLOP{modelled}"
        )
        if "measured_peak_bytes" in d:
            err = d["predicted_peak_bytes"] / d["measured_peak_bytes"] - 1
            lines.append(
                f"    measured peak {d['measured_peak_bytes'] / MIB:,.1f} MiB (prediction {100 * err:+.1f}%), "
                f"overhead {100 * d['measured_overhead']:+.1f}% (round by round: "
                f"{paired_text(d['measured_overhead_paired'])})"
            )
        if "gpu" in d:
            lines.append(gpu_line(d["gpu"]))
    lines.append("  per block: recomputed in the backward pass | recomputed, saving those op classes' outputs | kept")
    lines += [f"    {line}" for line in blocks(workload, doc["plan"])]
    if doc.get("candidates"):
        lines.append(candidates.table(doc["candidates"]))
    return "\n".join(lines)


def gpu_line(g: dict[str, Any]) -> str:
    """The GPU flavour's figures and its terms, MiB (docs/regimes.md: each term's source)."""
    terms = ", ".join(f"{name} {v / MIB:.1f}" for name, v in g["terms"].items())
    return (
        f"    {g['device']}: max_memory_allocated {g['allocated_bytes'] / MIB:.1f} MiB (at {g['peak_at']}), "
        f"max_memory_reserved {g['reserved_bytes'] / MIB:.1f} MiB, nvidia-smi {g['device_bytes'] / MIB:.1f} MiB "
        f"[CPU estimate {g['cpu_peak_bytes'] / MIB:.1f} MiB; terms, MiB: {terms}]"
    )
