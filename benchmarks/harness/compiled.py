"""``benchmarks.compare --compile``: the parent's side of the compiled rows (no torch import here).

The rows are measured by `benchmarks.backends.compiled_bench` (framework ``compiled``) in its own process;
`comparison` puts each beside the eager row of the same plan, by the allocator's peak both have.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import Any

from benchmarks.harness.job import Job
from benchmarks.reports.tables import mib
from shared_configs import SpecError

COMPILED = "compiled"  # the worker's framework name: benchmarks.backends.compiled_bench
BUDGET = "budget@"  # the same prefix as benchmarks.backends.compiled_bench.BUDGET (this module imports no torch)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch: also measure torch.compile(model) under each policy (framework 'compiled', beside "
        "the eager rows; peak by the allocator, compile seconds apart); docs/compile.md",
    )
    p.add_argument(
        "--compile-budget-at",
        default="",
        metavar="POLICIES",
        help="with --compile: for each of these measured policies, a row 'budget@POLICY': no plan, "
        "torch.compile with activation_memory_budget set to land at that plan's compiled saved "
        "bytes",
    )


def compiled_job(compile: bool, budget_at: str, torch_job: Job | None, policies: list[str]) -> Job | None:
    """The compiled rows' job (None without ``compile``); SpecError for what it cannot measure."""
    targets = [p.strip() for p in budget_at.split(",") if p.strip()]
    if not compile:
        if targets:
            raise SpecError("--compile-budget-at: needs --compile")
        return None
    if torch_job is None:
        raise SpecError("--compile: measures torch's step; add torch to --framework")
    if torch_job.world_size > 1:
        raise SpecError("--compile: one process only (FSDP2 under torch.compile is not measured here)")
    if torch_job.source != "spec":
        raise SpecError("--compile: measures this project's U-Net from a spec (--config), not --diffusers")
    for target in targets:
        if target == "none" or target not in policies:
            raise SpecError(f"--compile-budget-at: {target!r} is not a measured policy other than none")
    budgets = tuple(dict.fromkeys(f"{BUDGET}{t}" for t in targets))
    return replace(torch_job, framework=COMPILED, policies=(*torch_job.policies, *budgets), timeline=())


def comparison(rows: list[dict[str, Any]]) -> list[str]:
    """Lines of eager beside compiled: allocator peak MiB and median step seconds, per policy and batch."""
    ok = [r for r in rows if r["status"] == "ok"]
    eager = {(r["policy"], r["batch_size"]): r for r in ok if r["framework"] == "torch"}
    lines = []
    for row in (r for r in ok if r["framework"] == COMPILED):
        plain = eager.get((row["policy"], row["batch_size"]), {})  # none where the eager row failed
        cells = [
            f"{row['policy']} @ {row['batch_size']}:",
            f"peak {mib(plain.get('allocator_peak_bytes'))} eager / {mib(row['allocator_peak_bytes'])} compiled MiB,",
            f"step {_s(plain.get('step_time_s'))} / {_s(row['step_time_s'])} s,",
            f"compile {row['compile_s']:.0f} s",
        ]
        if row["policy"].startswith(BUDGET):
            cells.append(f"(activation_memory_budget {row['activation_memory_budget']:.3f})")
        lines.append(" ".join(cells))
    return ["eager vs torch.compile (allocator peaks):", *lines] if lines else []


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}"
