"""Choosing a plan by measuring candidates: the solver's best plans and the hand policies that fit.

The time model ranks plans only roughly (docs/candidates.md): `propose` lists the candidates, `pipeline.plan`
checks and races them in the workers, `decide` picks the fastest that fits, `table` reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from shared_configs.planning.budget import Profile, predict
from shared_configs.planning.paired import paired, paired_text
from shared_configs.planning.solver import Solution, next_best, solution
from shared_configs.planning.units import assignment_of
from shared_configs.sizes import MIB
from shared_configs.spec import UNetSpec

# The named policies a user would otherwise pick by hand (`none` is the solver's answer when it fits).
HAND_POLICIES: tuple[str, ...] = ("none", "full", "balanced", "layers", "save_convs", "layers/save=conv,matmul")
DEFAULT_ROUNDS = 15  # at most; a race is decided sooner when one candidate is left
MIN_ROUNDS = 5  # the fewest rounds whose sign test can exclude 0 at 90% (all five the same way)
# Hand policies predicted slower than the solver's plan by more than this fraction of the plain step are not
# raced: the model's ranking errs by less on specs it never saw (docs/planning.md#the-time-models-ranking).
RACE_WITHIN = 0.05
CONFIDENCE = 0.9
REFERENCE = "none"  # timed every round: the overheads' base


def default_rounds(count: int) -> int:
    """A race's rounds at most: `plan_for_budget`'s quick race of the plan and the hand policies near it
    (``count`` 1) settles in `MIN_ROUNDS`; with more solver plans, up to `DEFAULT_ROUNDS`."""
    return DEFAULT_ROUNDS if count > 1 else MIN_ROUNDS


def unmeasurable(profiles: list[Profile], world_size: int, distributed: str) -> str | None:
    """Why candidates cannot be measured (None: they can)."""
    if any(p.mode != "measured" for p in profiles):
        return "a profile from shapes has no step to measure"
    return "one process cannot run an FSDP rank's step" if world_size > 1 and distributed == "fsdp" else None


def measured_choice(
    first: Solution,
    profiles: list[Profile],
    spec: UNetSpec,
    budget: int,
    margin: float,
    frameworks: tuple[str, ...],
    count: int,
    check: Callable[[str, list[str]], dict[str, int]],
    race: Callable[[str, list[str], dict[str, Any]], dict[str, Any]],
) -> tuple[Solution, dict[str, Any] | None]:
    """The plan `decide` picks of `propose`'s, each ``check``ed and, where it fits, raced (``race``); and the report
    (None: ``first`` alone fits of them, nothing raced)."""
    entries = propose(profiles, spec, budget, margin, first, count)
    if len(entries) == 1:  # no other candidate near it: nothing to check or race
        return first, None
    policies = [c["policy"] for c in entries]
    for fw in frameworks:
        peaks = check(fw, policies)
        for c in entries:
            c["frameworks"][fw]["checked_peak_bytes"] = peaks[c["policy"]]
    fit = [c["policy"] for c in entries if all(f["checked_peak_bytes"] <= budget for f in c["frameworks"].values())]
    if fit == [first.policy]:
        return first, None
    race_to = {"budget": budget, "reference": REFERENCE, "min_rounds": MIN_ROUNDS}
    reference = {}
    for fw in frameworks:
        rows = race(fw, [REFERENCE, *fit], race_to)
        attach(entries, fw, rows)
        reference[fw] = rows[REFERENCE]["rounds_s"]
    report = decide(entries, budget) | {"reference_rounds_s": reference}
    if report["chosen"] is None:
        return first, report
    chosen = solution(profiles, spec, assignment_of(spec, report["chosen"]))
    return replace(chosen, policy=report["chosen"]), report  # the string as measured (the same plan)


def propose(
    profiles: list[Profile], spec: UNetSpec, budget: int, margin: float, first: Solution, count: int
) -> list[dict[str, Any]]:
    """One entry per plan, predicted per profile: ``first``, up to ``count - 1`` next best, the hand policies
    predicted within `RACE_WITHIN` of ``first``'s overhead (summed over the profiles)."""
    found: dict[frozenset, tuple[str, str]] = {}
    sols = [first, *next_best(profiles, spec, budget, margin, first, count - 1)]
    named = [(s.policy, f"solver {i}") for i, s in enumerate(sols, start=1)] + [(h, "hand") for h in HAND_POLICIES[1:]]
    for policy, source in named:
        found.setdefault(frozenset(assignment_of(spec, policy).items()), (policy, source))
    out = []
    for policy, source in found.values():
        preds = [predict(p, spec, assignment_of(spec, policy)) for p in profiles]
        per_fw = {
            p.framework: {"predicted_peak_bytes": x.peak_bytes, "predicted_overhead": x.overhead(p)}
            for p, x in zip(profiles, preds, strict=True)
        }
        out.append({"policy": policy, "source": source, "frameworks": per_fw})
    cost = [sum(f["predicted_overhead"] for f in c["frameworks"].values()) for c in out]
    return [c for c, x in zip(out, cost, strict=True) if c["source"] != "hand" or x <= cost[0] + RACE_WITHIN]


def attach(candidates: list[dict[str, Any]], framework: str, rows: dict[str, Any]) -> None:
    """A framework's measured rows into the candidates: peak, rounds, overhead against `REFERENCE` by round."""
    base = rows[REFERENCE]["rounds_s"]
    for c in candidates:
        entry, row = c["frameworks"][framework], rows.get(c["policy"])
        if row is None:  # not measured: its checked peak was over the budget
            continue
        entry["measured_peak_bytes"] = row["peak_bytes"]
        entry["rounds_s"] = row["rounds_s"]
        if row["rounds_s"]:
            entry["measured_overhead"] = paired(row["rounds_s"], base[: len(row["rounds_s"])])


def decide(candidates: list[dict[str, Any]], budget: int) -> dict[str, Any]:
    """Of the candidates that fit ``budget`` measured and raced to the end (else all timed that fit), the one whose
    worst head-to-head median ratio is best (head to head keeps the plain step's noise out); None when none fit."""
    longest = {
        fw: max((len(c["frameworks"][fw].get("rounds_s") or []) for c in candidates), default=0)
        for fw in candidates[0]["frameworks"]
    }
    for c in candidates:
        c["fits"] = all(f.get("measured_peak_bytes", budget + 1) <= budget for f in c["frameworks"].values())
        c["timed"] = all(f.get("rounds_s") for f in c["frameworks"].values())
        c["in_race_to_the_end"] = c["timed"] and all(
            len(f["rounds_s"]) == longest[fw] for fw, f in c["frameworks"].items()
        )
    pool = [c for c in candidates if c["fits"] and c["timed"]]
    finalists = [c for c in pool if c["in_race_to_the_end"]] or pool
    worst = {id(c): max((_versus(c, d)["median"] for d in finalists if d is not c), default=0.0) for c in finalists}
    chosen = min(finalists, key=lambda c: worst[id(c)], default=None)
    for c in candidates:
        c["chosen"] = c is chosen
        if chosen is not None and c["timed"] and c is not chosen:
            for fw, f in c["frameworks"].items():
                f["chosen_vs_this"] = _versus(chosen, c, fw)
    return {
        "chosen": chosen["policy"] if chosen else None,
        "budget_bytes": budget,
        "min_rounds": MIN_ROUNDS,
        "confidence": CONFIDENCE,
        "candidates": candidates,
    }


def _versus(a: dict[str, Any], b: dict[str, Any], framework: str | None = None) -> dict[str, Any]:
    """``a`` against ``b`` over the rounds both ran (`paired`) in ``framework``; None: medians summed over all."""
    out = []
    for fw in [framework] if framework else list(a["frameworks"]):
        mine, theirs = a["frameworks"][fw]["rounds_s"], b["frameworks"][fw]["rounds_s"]
        n = min(len(mine), len(theirs))
        out.append(paired(mine[:n], theirs[:n], CONFIDENCE))
    return out[0] if framework else {"median": sum(c["median"] for c in out)}


def table(report: dict[str, Any]) -> str:
    """The candidates per framework: peaks and overheads predicted -> measured, and the chosen plan against each."""
    lines = [
        f"candidates (measured round by round, at most {report['rounds']} rounds; a candidate leaves the "
        f"race once another is faster at {100 * report['confidence']:.0f}%, from round {report['min_rounds']}); "
        f"chosen: {report['chosen'] or 'none fit when measured: the solver plan'}"
    ]
    for c in report["candidates"]:
        lines.append(f" {'*' if c['chosen'] else ' '} {c['policy']} ({c['source']})")
        for fw, f in c["frameworks"].items():
            peaks = " -> ".join(
                f"{f[k] / MIB:.1f}" if k in f else "-"
                for k in ("predicted_peak_bytes", "checked_peak_bytes", "measured_peak_bytes")
            )
            over = f"{100 * f['predicted_overhead']:+.1f}% -> "
            over += paired_text(f["measured_overhead"]) if "measured_overhead" in f else "not timed (over the budget)"
            line = f"     {fw}: peak MiB {peaks}; overhead {over}"
            if "chosen_vs_this" in f:
                line += f"; chosen vs this: {paired_text(f['chosen_vs_this'])}"
            lines.append(line)
    return "\n".join(lines)
