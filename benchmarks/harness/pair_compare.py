"""``benchmarks.compare --controlnet``: diffusers' ControlNet training step, per framework x policy.

The step is `torch_impl.pair` / `jax_impl.pair`'s (`shared_configs.pair`), measured by the planner's
own workers (`shared_configs.planning.pipeline.measure`), one process per framework. The rows are
``none``, ``--policies`` (each on both networks) and a plan solved for ``--plan-budget-mib``, by
default halfway between the smallest feasible peak and ``none``'s. No torch or jax import here.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.job import DIFFUSERS, Job, job_spec
from benchmarks.reports.tables import markdown_table, write_json
from shared_configs import SpecError
from shared_configs.cli import positive_mib
from shared_configs.defaults import resolve_chunk
from shared_configs.planning.budget import predict
from shared_configs.planning.pipeline import DEVICE, Workload, get_profile, measure, plan
from shared_configs.planning.solver import Infeasible, peak_range
from shared_configs.planning.units import assignment_of
from shared_configs.sizes import MIB

PLANNED = "planned"  # the planned row's label (its policy string is printed beside the table)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--controlnet",
        action="store_true",
        help="diffusers' ControlNet training step (the U-Net frozen, the ControlNet made from it trained): "
        "none, --policies and a planned policy per framework (benchmarks.harness.pair_compare)",
    )
    p.add_argument(
        "--plan-budget-mib",
        type=positive_mib,
        metavar="MIB",
        help="--controlnet: the budget the planned row is solved for (default: halfway between the "
        "smallest feasible peak and none's)",
    )


def main(jobs: list[Job], budget_mib: float | None, out: Path, console: Any) -> int:
    """Measure ``jobs`` (one per framework), print the table on ``console``, write the JSON."""
    doc = run(jobs, budget_mib)
    console.print(table(doc), highlight=False)
    path = out / f"compare-{doc['config']}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json(path, doc)
    console.print(f"wrote {path}")
    return 0


def check(frameworks: tuple[str, ...], world_size: int, device: str, other: bool, batches: list[int] | None) -> None:
    """Refuse, in one line, what the ControlNet step's benchmark does not measure."""
    if DIFFUSERS in frameworks or world_size > 1 or device == "gpu" or other:
        raise SpecError(
            "--controlnet: measures the torch and jax steps in one CPU process each; not with "
            "--framework diffusers, --world-size, --device gpu, --compile or --xla-default"
        )
    if batches is not None and len(batches) > 1:
        raise SpecError("--controlnet: one --batch-size at a time")


def default_budget(work: Workload, frameworks: tuple[str, ...]) -> int:
    """Halfway between the smallest feasible predicted peak and ``none``'s, the highest over ``frameworks``."""
    floor, top = peak_range([get_profile(fw, work) for fw in frameworks], work.spec)
    return (floor + top) // 2


def run(jobs: list[Job], budget_mib: float | None) -> dict[str, Any]:
    """Plan (for ``budget_mib``, or `default_budget`), then measure every row in each framework: the JSON document."""
    job, frameworks = jobs[0], tuple(job.framework for job in jobs)  # every job describes the same workload
    work = Workload.of(
        job_spec(job),
        controlnet=True,
        batch_size=job.batch_sizes[0],
        context_length=job.context_length,
        attention_chunk=resolve_chunk(job.attention_chunk, DEVICE),
        regime=job.regime,
    )
    budget = int(budget_mib * MIB) if budget_mib is not None else default_budget(work, frameworks)
    for attempt in range(3):
        try:
            planned = plan(work, budget, "both" if len(frameworks) == 2 else frameworks[0])
            break
        except Infeasible as err:  # the default lies below the model's margin: the smallest budget it plans for
            if budget_mib is not None or attempt == 2:
                raise
            budget = err.smallest
    policies = list(dict.fromkeys([*jobs[0].policies, planned.policy]))  # none first, then --policies
    measured = {fw: measure(fw, work, policies, jobs[0].steps)["rows"] for fw in frameworks}
    return {
        "config": work.spec.name,
        "batch_size": work.batch_size,
        "regime": work.regime.as_dict(),
        "settings": work.used(frameworks),
        "budget_bytes": budget,
        "planned": planned.policy,
        "policies": policies,
        "predicted_peak_bytes": {
            p.framework: {pol: predict(p, work.spec, assignment_of(work.spec, pol)).peak_bytes for pol in policies}
            for p in planned.profiles
        },
        "rows": measured,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def table(doc: dict[str, Any]) -> str:
    """Markdown: per policy and framework, the measured peak (vs none) and the step's median seconds (vs none)."""
    fws = list(doc["rows"])
    rows = [["policy", *(head for fw in fws for head in (f"{fw} peak MiB", f"{fw} step"))]]
    for policy in doc["policies"]:
        rows.append([PLANNED if policy == doc["planned"] and policy != "none" else f"`{policy}`"])
        for fw in fws:
            row, none = doc["rows"][fw][policy], doc["rows"][fw]["none"]
            change = f" ({100 * (row['peak_bytes'] / none['peak_bytes'] - 1):+.0f}%)" if policy != "none" else ""
            ratio = statistics.median(row["rounds_s"]) / statistics.median(none["rounds_s"])
            rows[-1] += [f"{row['peak_bytes'] / MIB:.1f}{change}", f"{row['step_time_s']:.2f} s ({ratio:.2f}x)"]
    planned = f"{PLANNED}: `{doc['planned']}` (budget {doc['budget_bytes'] / MIB:.1f} MiB); {doc['settings']}"
    return f"{markdown_table(rows)}\n\n{planned}"
