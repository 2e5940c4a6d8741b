"""Benchmark one full training step per framework x checkpoint policy x batch size.

    python -m benchmarks.compare --framework both --config small --policies none,full,balanced,layers
    python -m benchmarks.compare --framework torch,diffusers --policies full,layers   # vs diffusers' own
    python -m benchmarks.compare --diffusers path/to/unet_folder                      # a local diffusers model

Each framework runs in its own subprocess (`benchmarks.worker`); this process imports neither.
Prints a table, and writes ``<out>/<run>.json``, ``.csv`` and ``.png`` (memory reduction against
time overhead, with the Pareto front). See `benchmarks.torch_bench` and `benchmarks.jax_bench`
for how each figure is measured.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from benchmarks import plot, report
from benchmarks.common import (
    DIFFUSERS,
    DIFFUSERS_POLICIES,
    FRAMEWORKS,
    Job,
    cpu_snapshot,
    git_sha,
    job_spec,
    load_benchmark_spec,
    other_cpu_share,
    policy_arg,
)
from benchmarks.runner import Event, cli_errors, run_job
from shared_configs import NAMED_POLICIES, SpecError, UNetSpec, resolve_plan, to_diffusers_config

DEFAULT_POLICIES = "none,full,balanced,layers,save_convs"
DEFAULT_CONFIG = "small"
DEFAULT_SAMPLE_SIZE = 16  # small's 32 x 32 takes minutes per policy on a 2-core CPU
DEFAULT_BATCH_SIZES = (4,)
DEFAULT_STEPS = 3


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, no usage block
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _frameworks(text: str) -> tuple[str, ...]:
    """'both' (torch and jax) or a comma-separated list of torch, jax, diffusers."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    allowed = (*FRAMEWORKS, DIFFUSERS)
    if names == ["both"]:
        return FRAMEWORKS
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown framework {bad[0] if bad else text!r} (allowed: both, or a comma list of {', '.join(allowed)})"
        )
    return tuple(dict.fromkeys(names))


EPILOG = """\
one training step = forward, MSE loss, backward, AdamW (torch) / optax.adamw (jax).
memory: GPU - the allocator's peak (torch.cuda.max_memory_allocated; jax memory_stats()).
  CPU - torch: peak of live tensor bytes (dispatch-mode tracker; the allocator's own peak beside
  it in the files); jax: the compiled step's memory_analysis() with XLA_FLAGS=
  --xla_disable_hlo_passes=cse_barrier_expander, since XLA:CPU otherwise strips the barriers
  remat relies on (--xla-default adds the un-flagged figure as the 'XLA:CPU default' column).
static = params + grads + optimizer state; dynamic = peak - static - inputs.
time: median [min-max] of --steps steps after a warm-up step; compile time apart; overhead and
  reductions against policy none, same framework and run. Each framework in its own process.
diffusers: diffusers' own UNet2D(Condition)Model (the spec's diffusers config, or the --diffusers
  folder's), same weights, measured like torch; its rows are none and enable_gradient_checkpointing.
"""


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m benchmarks.compare",
        description=__doc__.split("\n\n")[0],
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--framework",
        type=_frameworks,
        default=FRAMEWORKS,
        help="both (default: torch and jax), or a comma list of torch, jax, diffusers (diffusers' own U-Net "
        "and its enable_gradient_checkpointing(), on the same weights)",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--config", default=DEFAULT_CONFIG, help="preset name or spec YAML path (default: %(default)s)")
    source.add_argument(
        "--diffusers",
        type=Path,
        metavar="PATH",
        help="a local diffusers UNet2D(Condition)Model folder (or a pipeline folder with unet/): its config "
        "and weights, in every framework",
    )
    p.add_argument(
        "--sample-size",
        type=_positive,
        default=None,
        help=f"override spec.sample_size (default: {DEFAULT_SAMPLE_SIZE} for the default config, else the spec's)",
    )
    p.add_argument(
        "--policies",
        default=DEFAULT_POLICIES,
        help=f"comma-separated policies: {', '.join(NAMED_POLICIES)}, or block names joined with '+' "
        "(e.g. down.1+mid), op-level forms with '+' between ops (full/save=conv+matmul, "
        "offload_convs); 'none' is always measured, as the baseline (default: %(default)s)",
    )
    p.add_argument(
        "--batch-size",
        type=_positive,
        nargs="+",
        default=None,
        metavar="N",
        help=f"one or more batch sizes (default: {DEFAULT_BATCH_SIZES[0]} for the default config, else 1)",
    )
    p.add_argument("--steps", type=_positive, default=DEFAULT_STEPS, help="timed steps after warm-up (%(default)s)")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="parameter and input dtype (default: float32)",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "gpu"],
        default="auto",
        help="auto (default): each framework's GPU if it has one, else CPU",
    )
    p.add_argument("--context-length", type=_positive, default=77, help="cross-attention tokens (%(default)s)")
    p.add_argument("--out", type=Path, default=Path("results"), help="folder for JSON/CSV/PNG (%(default)s)")
    p.add_argument(
        "--xla-default",
        action="store_true",
        help="jax on CPU: also compile each step with XLA's default passes, which strip remat's barriers "
        "(the 'XLA:CPU default' column; off by default to keep the default run under 3 minutes)",
    )
    p.add_argument(
        "--jax-attention-chunk",
        type=_positive,
        default=None,
        metavar="N",
        help="jax: compute attention N queries at a time, each chunk rematerialised (UNet(attention_chunk=N)); "
        "XLA:CPU's attention is unfused, torch's CPU SDPA is not (default: off)",
    )
    p.add_argument("--verbose", action="store_true", help="show the workers' stderr")
    return p


def make_jobs(args: argparse.Namespace) -> list[Job]:
    """Validate the arguments (SpecError on bad input) and turn them into worker jobs."""
    source, config = ("diffusers", str(args.diffusers)) if args.diffusers else ("spec", args.config)
    default_config = source == "spec" and config == DEFAULT_CONFIG
    sample_size = args.sample_size or (DEFAULT_SAMPLE_SIZE if default_config else None)
    batch_sizes = tuple(dict.fromkeys(args.batch_size or (DEFAULT_BATCH_SIZES if default_config else (1,))))
    spec = load_benchmark_spec(config, sample_size, source)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise SpecError("policies: none given")
    for policy in policies:
        resolve_plan(spec, policy_arg(policy))
    policies = list(dict.fromkeys(["none", *policies]))
    _check_frameworks(args.framework, spec, source)
    common = {
        "config": config,
        "source": source,
        "sample_size": spec.sample_size,
        "batch_sizes": batch_sizes,
        "steps": args.steps,
        "dtype": args.dtype,
        "device": args.device,
        "context_length": args.context_length,
    }
    return [
        Job(
            framework=fw,
            policies=DIFFUSERS_POLICIES if fw == DIFFUSERS else tuple(policies),
            xla_default=args.xla_default,
            attention_chunk=args.jax_attention_chunk if fw == "jax" else None,
            **common,
        )
        for fw in args.framework
    ]


def _check_frameworks(frameworks: tuple[str, ...], spec: UNetSpec, source: str) -> None:
    """Refuse in one line (SpecError) what a chosen framework cannot run."""
    if DIFFUSERS in frameworks:
        if importlib.util.find_spec("diffusers") is None:
            raise SpecError("--framework diffusers: the diffusers package is not installed (pip install diffusers)")
        if source == "spec":
            to_diffusers_config(spec)  # names the field diffusers cannot build
    if "jax" in frameworks and spec.norm_kind == "batch":
        raise SpecError("norm_kind: 'batch' is not benchmarked in jax yet (the step does not carry batch_stats); "
                        "use --framework torch")  # fmt: skip


def run_all(jobs: list[Job], console: Console, verbose: bool) -> list[list[Event]]:
    """Run the jobs one after another (never side by side: they would share the cores)."""
    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
    results: list[list[Event]] = []
    with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        tasks = [progress.add_task(job.framework, total=len(job.rows())) for job in jobs]
        for job, task in zip(jobs, tasks, strict=True):

            def on_event(event: Event, task: Any = task, job: Job = job) -> None:
                if event["event"] == "start":
                    progress.update(
                        task, description=f"{job.framework}: {event['policy']} @ batch {event['batch_size']}"
                    )
                elif event["event"] == "row":
                    progress.update(task, advance=1, description=f"{job.framework}: last {event['status']}")

            start = time.perf_counter()
            events = run_job(job, on_event, verbose)
            events.append({"event": "wall", "framework": job.framework, "seconds": time.perf_counter() - start})
            results.append(events)
            progress.update(task, description=job.framework)
    return results


def build_document(
    args: argparse.Namespace, jobs: list[Job], results: list[list[Event]], clock: tuple[float, float | None, float]
) -> dict:
    """The JSON document: top-level config, device, versions and rows."""
    events = [e for evs in results for e in evs]
    rows = report.complete(e for e in events if e["event"] == "row")
    envs = {e["framework"]: e for e in events if e["event"] == "env"}
    spec = job_spec(jobs[0])
    return {
        "config": {"name": spec.name, "source": jobs[0].config, "spec": spec.model_dump(mode="json")},
        "device": {"requested": args.device, **{fw: env["device"] for fw, env in envs.items()}},
        "versions": {
            "python": platform.python_version(),
            **{k: v for e in envs.values() for k, v in e["versions"].items()},
        },
        "git_sha": git_sha(),
        "dtype": args.dtype,
        "settings": {k: v for k, v in asdict(jobs[0]).items() if k not in ("framework", "done", "policies")}
        | {
            "policies": {job.framework: list(job.policies) for job in jobs},
            "attention_chunk": args.jax_attention_chunk,
        },
        "xla_flags": envs["jax"]["xla_flags"] if "jax" in envs else None,
        "methods": report.methods(rows),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": {
            "total": round(time.perf_counter() - clock[0], 1),
            **{e["framework"]: round(e["seconds"], 1) for e in events if e["event"] == "wall"},
        },
        # Other work on a shared machine skews times: the share of the cores it took during the run.
        "other_cpu_share": other_cpu_share(clock, cpu_snapshot()),
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "rows": rows,
    }


def write_outputs(document: dict[str, Any], out: Path) -> list[Path]:
    stem = f"compare-{document['config']['name']}-{time.strftime('%Y%m%d-%H%M%S')}"
    paths = [out / f"{stem}.json", out / f"{stem}.csv"]
    report.write_json(paths[0], document)
    report.write_csv(paths[1], document["rows"])
    device = next((d["name"] for fw, d in document["device"].items() if fw != "requested"), "?")
    title = f"{report.title(document)}\n{device}"
    if plot.plot(document["rows"], out / f"{stem}.png", title):
        paths.append(out / f"{stem}.png")
    return paths


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # A table this wide wraps unreadably at 80 columns: when not on a terminal, print it wide.
    console = Console() if sys.stdout.isatty() else Console(width=180)
    with cli_errors("compare"):
        jobs = make_jobs(args)
        clock = cpu_snapshot()
        results = run_all(jobs, console, args.verbose)
    document = build_document(args, jobs, results, clock)
    console.print(report.table(document["rows"], report.title(document)))
    for line in report.notes(document):
        console.print(line, highlight=False)
    for path in write_outputs(document, args.out):
        console.print(f"wrote {path}")
    errors = [r for r in document["rows"] if r["status"] == "error"]
    if errors:
        print(f"compare: error: {len(errors)} row(s) failed, first: {errors[0]['error']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
