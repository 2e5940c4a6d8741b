"""The largest training batch that fits a memory budget, per framework and checkpoint policy.

    python -m benchmarks.max_batch --budget-mib 2048 --config small --policies full

A step's peak is nearly affine in the batch: a line through the probe batches' peaks (``--batch-size``,
default 2 4) predicts the answer, and the search measures on until a batch that fits sits next to one
that does not: the answer is measured. Peaks are `benchmarks.compare`'s, whose options it takes;
exits 1 when some answer is not bracketed.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.compare import build_document, build_parser, keep_measured, parse_args, run_all
from benchmarks.harness.job import Job, cpu_snapshot
from benchmarks.harness.runner import static_floor
from benchmarks.reports import tables
from shared_configs import SpecError
from shared_configs.cli import check_out_dir, cli_errors, positive_mib
from shared_configs.sizes import MIB

DEFAULT_PROBES = (2, 4)
ROUNDS = 6  # line predictions, then bisection steps


def parser() -> argparse.ArgumentParser:
    p = build_parser()
    p.prog, p.description = "python -m benchmarks.max_batch", __doc__.split("\n\n")[0]
    p.add_argument(
        "--budget-mib",
        type=positive_mib,
        required=True,
        help="the memory budget, MiB (required; above the floor: the parameters and AdamW state)",
    )
    p.set_defaults(batch_size=list(DEFAULT_PROBES))
    return p


def measure(jobs: list[Job], console: Console, verbose: bool, events: list[dict]) -> list[dict[str, Any]]:
    """Run ``jobs`` (their events appended to ``events``); all rows so far, completed."""
    run_all(jobs, console, verbose, events)
    return tables.complete(e for e in events if e["event"] == "row")


def fit(rows: list[dict[str, Any]]) -> tuple[float, float] | None:
    """(fixed bytes, bytes per sample): the line through the two largest batches measured (not least
    squares over all: small batches can cost more per sample, kernel workspaces)."""
    points = sorted({(r["batch_size"], r["peak_bytes"]) for r in rows if r["status"] == "ok"})[-2:]
    if len(points) < 2:
        return None
    (b0, p0), (b1, p1) = points
    slope = (p1 - p0) / (b1 - b0)
    return (p1 - slope * b1, slope) if slope > 0 else None


def bracket(rows: list[dict[str, Any]], budget: float) -> tuple[int | None, int | None]:
    """(largest measured batch that fits below the smallest that does not, that smallest)."""
    over = [r["batch_size"] for r in rows if r["status"] == "oom" or (r["status"] == "ok" and r["peak_bytes"] > budget)]
    hi = min(over, default=None)
    fits = [r["batch_size"] for r in rows if r["status"] == "ok" and r["peak_bytes"] <= budget]
    return max((b for b in fits if hi is None or b < hi), default=None), hi


def next_batches(rows: list[dict[str, Any]], budget: float) -> tuple[int, ...]:
    """What to measure next for one (framework, policy): bisect a bracket, else follow the line."""
    lo, hi = bracket(rows, budget)
    measured = {r["batch_size"] for r in rows}
    if lo is not None and hi is not None:
        if hi - lo <= 1:
            return ()
        # Interpolate between the bracket's ends (XLA's peaks jump a little: a global fit can miss).
        peaks = {r["batch_size"]: r["peak_bytes"] for r in rows if r["status"] == "ok"}
        slope = (peaks[hi] - peaks[lo]) / (hi - lo) if hi in peaks else None
        guess = lo + int((budget - peaks[lo]) // slope) if slope and slope > 0 else (lo + hi) // 2
        guess = min(max(guess, lo + 1), hi - 1)
        return tuple(b for b in (guess, guess + 1) if b < hi and b not in measured)
    line = fit(rows)
    if line is None:
        return ()
    best = max(1, int((budget - line[0]) // line[1]))
    return tuple(b for b in (best, best + 1) if b not in measured)


def verification_jobs(probe_jobs: list[Job], rows: list[dict[str, Any]], budget: float) -> list[Job]:
    """One job per (framework, policy) not yet answered, with the batches to measure next."""
    todo = {
        (job, policy): next_batches(
            [r for r in rows if (r["framework"], r["policy"]) == (job.framework, policy)], budget
        )
        for job in probe_jobs
        for policy in job.policies
    }
    return [replace(job, policies=(policy,), batch_sizes=batches) for (job, policy), batches in todo.items() if batches]


def answer(rows: list[dict[str, Any]], budget: float) -> list[dict[str, Any]]:
    """Per (framework, policy): the line, and the largest measured batch within the budget."""
    out = []
    for key in dict.fromkeys((r["framework"], r["policy"]) for r in rows):
        mine = [r for r in rows if (r["framework"], r["policy"]) == key]
        best, hi = bracket(mine, budget)
        line = fit(mine)
        out.append(
            {
                "framework": key[0],
                "policy": key[1],
                "largest_batch": best,
                # measured: the batch above the answer was measured too, and did not fit
                "bracketed": best is not None and hi == best + 1,
                "peak_bytes": next((r["peak_bytes"] for r in mine if r["batch_size"] == best), None),
                "fixed_bytes": line and line[0],
                "bytes_per_sample": line and line[1],
            }
        )
    return out


def table(results: list[dict[str, Any]], budget: float) -> Table:
    t = Table(title=f"largest batch within {budget / MIB:,.0f} MiB", title_justify="left", header_style="bold")
    for name in ("framework", "policy", "largest batch", "vs none", "its peak MiB", "MiB/sample", "fixed MiB"):
        t.add_column(name, justify="left" if name in ("framework", "policy") else "right")
    nones = {r["framework"]: r["largest_batch"] for r in results if r["policy"] == "none"}
    for r in results:
        best, base = r["largest_batch"], nones.get(r["framework"])
        t.add_row(
            r["framework"],
            r["policy"],
            "-" if best is None else f"{best}{'' if r['bracketed'] else ' (not bracketed)'}",
            f"{best / base:.2f}x" if best and base else "-",
            *(tables.mib(r[k]) for k in ("peak_bytes", "bytes_per_sample", "fixed_bytes")),
        )
    return t


def main(argv: list[str] | None = None) -> int:
    console = Console() if sys.stdout.isatty() else Console(width=160)
    with cli_errors("benchmarks.max_batch"):
        args, made = parse_args(argv, parser())
        budget = args.budget_mib * MIB
        jobs = [replace(j, peak_only=True, steps=1, timeline=()) for j in made]
        check_out_dir(args.out)
        floor = static_floor(jobs[0])
        if budget <= floor["floor_bytes"]:  # no batch can fit
            raise SpecError(
                f"--budget-mib: {budget / MIB:,.1f} MiB is not above the floor of "
                f"{floor['floor_bytes'] / MIB:,.1f} MiB that every step holds ({floor['param_count']:,} "
                "float32 parameters and their AdamW state); a budget must exceed it"
            )
        clock, events = cpu_snapshot(), []
        try:
            rows = measure(jobs, console, args.verbose, events)
            for _ in range(ROUNDS):  # each round: every unanswered pair's next batches
                todo = verification_jobs(jobs, rows, budget)
                if not todo:
                    break
                rows = measure(todo, console, args.verbose, events)
        except KeyboardInterrupt as stop:
            raise keep_measured("max_batch", args.out, args.device, jobs, events, clock, stop) from None
        results = answer(rows, budget)
        console.print(table(results, budget))
        document = build_document(jobs, events, clock, args.device) | {"budget_bytes": budget, "largest_batch": results}
        path = args.out / f"max_batch-{document['config']['name']}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        tables.write_json(path, document)
        console.print(f"wrote {path}")
    return 0 if all(r["bracketed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
