"""Does the planner's measured choice hold against the hand policies? ``python -m benchmarks.candidates_sweep``.

At budgets a fraction of the way from `full`'s measured peak to `none`'s: plan as `plan_for_budget` does
(or race more candidates), time the plan against every hand policy whose measured peak fits, round by
round in a process of its own, and say whether the claim holds (the plan fits, no fitting hand policy
is faster at 90%).

    python -m benchmarks.candidates_sweep --config docs/data/candidates/narrow_deep.yaml --batch-size 8 \\
        --framework torch --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from shared_configs.cli import cli_errors, config_help, nonnegative, number_list, positive, stopping
from shared_configs.files import atomic_write
from shared_configs.planning.candidates import HAND_POLICIES, default_rounds
from shared_configs.planning.paired import paired, paired_text
from shared_configs.planning.pipeline import Workload, measure, plan, progress
from shared_configs.sizes import MIB

CHECK_ROUNDS = 12


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.candidates_sweep", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help=config_help())
    p.add_argument("--batch-size", type=positive(int), default=8)
    p.add_argument("--sample-size", type=positive(int), help="latent size (default: the spec's)")
    p.add_argument("--framework", choices=("torch", "jax"), default="torch")
    p.add_argument(
        "--fractions",
        type=number_list(float, "fractions in (0, 1)", lambda v: 0 < v < 1),
        default=[0.25, 0.5, 0.75],
        help="the budgets, each this fraction of the way from full's peak to none's (0.25,0.5,0.75)",
    )
    p.add_argument(
        "--candidates",
        type=nonnegative(int),
        default=1,
        help="the solver's best plans raced with the hand policies near them (1: plan_for_budget's race; 0: none)",
    )
    p.add_argument("--rounds", type=positive(int), help="the race's rounds at most (5 with one candidate, else 15)")
    p.add_argument(
        "--check-rounds",
        type=positive(int),
        default=CHECK_ROUNDS,
        help=f"rounds of the plan against the fitting hand policies ({CHECK_ROUNDS})",
    )
    p.add_argument("--json", help="write the results here")
    return p


def check_budget(
    workload: Workload, framework: str, budget: int, candidates: int, rounds: int, check_rounds: int
) -> dict[str, Any]:
    """The plan at ``budget`` (a race of ``candidates``), then against every hand policy that fits."""
    found = plan(workload, budget, framework, candidates=candidates, rounds=rounds)
    chosen = found.solution.policy
    rows = measure(framework, workload, list(dict.fromkeys([chosen, *HAND_POLICIES])), check_rounds)["rows"]
    fits = {p: r["peak_bytes"] <= budget for p, r in rows.items()}
    versus = {
        h: paired(rows[chosen]["rounds_s"], rows[h]["rounds_s"]) for h in HAND_POLICIES if h != chosen and fits[h]
    }
    best = max(versus, key=lambda h: versus[h]["median"], default=None)  # the fastest fitting hand policy, paired
    return {
        "budget_bytes": budget,
        "plan": chosen,
        "predicted_peak_bytes": found.solution.prediction.peak_bytes,
        "measured_peak_bytes": rows[chosen]["peak_bytes"],
        "predicted_overhead": found.solution.prediction.overhead(found.profiles[0]),
        "measured_overhead": paired(rows[chosen]["rounds_s"], rows["none"]["rounds_s"]),
        "fits": fits[chosen],
        "hand_peaks_bytes": {h: rows[h]["peak_bytes"] for h in HAND_POLICIES},
        "versus": versus,
        "best_hand": best,
        "holds": fits[chosen] and not any(v["verdict"] == "slower" for v in versus.values()),
        "race": found.candidates,
    }


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| budget MiB | plan | peak measured MiB | fits | vs each fitting hand policy (plan/hand - 1), the fastest "
        "first | holds |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        order = sorted(r["versus"], key=lambda h: h != r["best_hand"])
        vs = "; ".join(f"{h} {paired_text(r['versus'][h])}" for h in order) or "none fits"
        lines.append(
            f"| {r['budget_bytes'] / MIB:.1f} | `{r['plan']}` | {r['measured_peak_bytes'] / MIB:.1f} | "
            f"{'yes' if r['fits'] else 'NO'} | {vs} | {'yes' if r['holds'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Check a budget at each of ``--fractions`` between ``full``'s and ``none``'s measured peaks; 0 when the plan holds
    at each."""
    args = build_parser().parse_args(argv)
    with cli_errors("benchmarks.candidates_sweep"), stopping("every worker stopped; nothing written"):
        workload, fw = Workload.of(args.config, args.sample_size, batch_size=args.batch_size), args.framework
        settings = workload.used((fw,))
        print(f"settings {settings}")
        ends = measure(fw, workload, ["none", "full"], 1)["rows"]
        low, high = ends["full"]["peak_bytes"], ends["none"]["peak_bytes"]
        budgets = [round(low + (high - low) * f) for f in args.fractions]
        results = []
        for i, budget in enumerate(budgets, 1):
            progress(
                f"budget {i} of {len(budgets)}: {budget / MIB:.1f} MiB (full {low / MIB:.1f}, none {high / MIB:.1f})"
            )
            results.append(
                check_budget(
                    workload,
                    fw,
                    budget,
                    args.candidates,
                    args.rounds or default_rounds(args.candidates),
                    args.check_rounds,
                )
            )
        doc = {
            "config": workload.spec.name,
            "sample_size": workload.spec.sample_size,
            "batch_size": args.batch_size,
            "framework": fw,
            "none_peak_bytes": high,
            "full_peak_bytes": low,
            "settings": settings,
            "results": results,
        }
        if args.json:
            atomic_write(args.json, json.dumps(doc, indent=1).encode())
        print(table(results))
    return 0 if all(r["holds"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
