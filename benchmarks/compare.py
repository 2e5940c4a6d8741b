"""Benchmark the training loops' own step per framework x checkpoint policy x batch size.

    python -m benchmarks.compare --framework both                                      # the default run
    python -m benchmarks.compare --framework torch,diffusers --policies full,layers   # vs diffusers' own
    python -m benchmarks.compare --world-size 2 --batch-size 4                         # per rank, under FSDP

Each framework runs in its own worker (`benchmarks.harness.runner`); this process imports neither.
Prints a table that fits 100 columns (``--wide``: every column; `benchmarks.report` reprints a run) and
writes ``<out>/<run>.json``, ``.csv`` and the plots. The method: docs/benchmark.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from benchmarks.harness import compiled, pair_compare
from benchmarks.harness.job import (
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
from benchmarks.harness.runner import Event, run_job
from benchmarks.report import WIDE_HELP, console_for, show
from benchmarks.reports import plot, tables
from shared_configs import NAMED_POLICIES, SpecError, UNetSpec, resolve_plan, to_diffusers_config
from shared_configs.cli import (
    Interrupted,
    OneLineParser,
    cache_dir,
    check_out_dir,
    cli_errors,
    config_help,
    number_list,
    positive_int,
)
from shared_configs.defaults import AUTO, CHUNK_HELP, chunk_arg, defaults
from shared_configs.pair import controlnet_pair, split_pair_plan
from shared_configs.regime import JAX_KEEPS_NO_GRADS, Regime, add_regime_arguments

DEFAULT_CONFIG = "sd_narrow"  # activation-dominated, as diffusion training is (docs/benchmark.md)
DEFAULT_POLICIES = "none,full,layers"
DEFAULT_BATCH_SIZES = (8,)
# Per preset, a batch where activations outweigh the weights and optimizer state, so that
# checkpointing visibly saves (docs/benchmark.md); other presets and spec files: 1.
PRESET_BATCH = {DEFAULT_CONFIG: DEFAULT_BATCH_SIZES[0], "small": 4}


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
one training step = each loop's own step: torch_impl.train.train_step (zero_grad(), forward, MSE,
  backward, AdamW) and the jitted jax_impl.train.train_step (TrainState donated, optax.adamw), the
  same optimizer hyperparameters, the same inputs.
memory: the peak of the whole step, split into parts that add up to it, at the peak's moment:
  params + opt state + grads + inputs + activations (made in the forward or recomputed) + temps.
  CPU - torch: live tensor storages (TorchDispatchMode tracker), checked against PyTorch's own
  MemTracker on the same step; jax: the compiled step's memory_analysis(), parts from XLA's buffer
  assignment and live ranges, with XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander (XLA:CPU
  otherwise strips the barriers remat relies on: --xla-default adds the un-flagged figure).
  GPU - the allocator's peak (torch.cuda.max_memory_allocated; jax memory_stats()).
attention: each framework's best on the device: torch's SDPA (fused on CPU and GPU); jax on CPU
  query-chunked (--jax-attention-chunk auto = 64 queries on CPU, XLA's own on GPU; 0 = unchunked).
time: median [min-max] of --steps steps after a warm-up step; compile time apart; overhead and
  reductions against policy none, same framework and run. Each framework in its own process.
timeline: <run>-timeline.png, memory over the step for none and --timeline's plan, per framework,
  block starts marked (torch: the tracker's allocations and frees, by module; jax: XLA's schedule).
jax compilation cache (--jax-cache): a repeated run loads its compiled steps.
defaults: attention, dtype, context length, steps and the cache are shared_configs.defaults' (those of
  benchmarks.plan and the training CLIs too); the line under the table says what this run used.
diffusers: diffusers' own UNet2D(Condition)Model (the spec's diffusers config, or the --diffusers
  folder's), same weights, measured like torch; its rows are none, enable_gradient_checkpointing (its
  own) and every --policies plan, applied to diffusers' model by torch_impl.apply_plan.
compile (--compile): torch.compile(model) per policy (framework 'compiled'), peak by the allocator
  (the eager rows' allocator_peak_bytes beside it), compile seconds apart: docs/compile.md.
"""


def build_parser() -> argparse.ArgumentParser:
    d = defaults("cpu")  # the device-independent fields; the attention chunk is resolved per device
    p = OneLineParser(
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
        "with its enable_gradient_checkpointing() and the same plans, on the same weights)",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--config", default=DEFAULT_CONFIG, help=config_help(DEFAULT_CONFIG))
    source.add_argument(
        "--diffusers",
        type=Path,
        metavar="PATH",
        help="a local diffusers UNet2D(Condition)Model folder (or a pipeline folder with unet/): its "
        "config and weights, in every framework",
    )
    p.add_argument("--sample-size", type=positive_int, default=None, help="override spec.sample_size")
    p.add_argument(
        "--policies",
        type=number_list(str.strip, "one or more policies", ok=bool, skip_blank=True),
        default=DEFAULT_POLICIES,
        help=f"comma-separated policies: {', '.join(NAMED_POLICIES)}, or block names joined with '+' "
        "(e.g. down.1+mid), op-level forms with '+' between ops (full/save=conv+matmul, "
        "offload_convs); 'none' is always measured, as the baseline (default: %(default)s)",
    )
    p.add_argument(
        "--timeline",
        default=None,
        metavar="POLICY",
        help="the checkpointed policy drawn beside none in the timeline picture (default: full if "
        "measured, else the first policy after none); 'off' for no picture",
    )
    p.add_argument(
        "--batch-size",
        type=positive_int,
        nargs="+",
        default=None,
        metavar="N",
        help=f"one or more batch sizes, per rank with --world-size (global batch = N x it) "
        f"(default: {', '.join(f'{b} for {c}' for c, b in PRESET_BATCH.items())}, else 1)",
    )
    p.add_argument(
        "--world-size",
        type=positive_int,
        default=1,
        metavar="N",
        help="measure each rank of an FSDP run over N ranks: torch FSDP2 in N processes (torchrun, gloo), "
        "jax's FSDP-sharded step over N forced host devices; CPU only. --batch-size is then per rank: "
        "each rank keeps its own activations while its static memory (params, grads, optimizer state) "
        "shrinks by N. Reports rank 0's peak and parts, and the largest peak over the ranks (default: 1, "
        "no sharding)",
    )
    p.add_argument("--steps", type=positive_int, default=d.steps, help="timed steps after warm-up (%(default)s)")
    add_regime_arguments(p)  # the training loops' regime: precision, what is trained, optimizer, EMA
    p.add_argument(
        "--device",
        choices=["auto", "cpu", "gpu"],
        default="auto",
        help="auto (default): each framework's GPU if it has one, else CPU",
    )
    p.add_argument(
        "--context-length", type=positive_int, default=d.context_length, help="cross-attention tokens (%(default)s)"
    )
    p.add_argument("--out", type=Path, default=Path("results"), help="folder for JSON/CSV/PNG (%(default)s)")
    p.add_argument("--jax-attention-chunk", type=chunk_arg, default=AUTO, metavar="N", help=CHUNK_HELP)
    p.add_argument(
        "--jax-cache",
        type=cache_dir,
        default=d.jax_cache or "none",
        metavar="DIR",
        help="jax: JAX's persistent compilation cache folder, so a repeated run loads its compiled steps "
        "(default: %(default)s; 'none' to compile afresh)",
    )
    p.add_argument(
        "--xla-default",
        action="store_true",
        help="jax on CPU: also compile each step with XLA's default passes, which strip remat's barriers "
        "(the 'XLA:CPU default' column)",
    )
    compiled.add_arguments(p)
    pair_compare.add_arguments(p)
    p.add_argument("--wide", action="store_true", help=WIDE_HELP)
    p.add_argument("--verbose", action="store_true", help="show the workers' stderr")
    return p


def parse_args(
    argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> tuple[argparse.Namespace, list[Job]]:
    """The flags and the worker jobs they make, one per framework (and --compile's; under --controlnet,
    the pair's: `benchmarks.harness.pair_compare`); SpecError on bad input, before anything runs."""
    args = (parser or build_parser()).parse_args(argv)
    source, config = ("diffusers", str(args.diffusers)) if args.diffusers else ("spec", args.config)
    if args.controlnet:  # what its benchmark does not measure, first
        pair_compare.check(
            args.framework, args.world_size, args.device, args.compile or args.xla_default, args.batch_size
        )
        preset_batch = DEFAULT_BATCH_SIZES[0]  # the pair's step: the default config's batch, whatever the preset
    elif args.plan_budget_mib is not None:
        raise SpecError("--plan-budget-mib: only with --controlnet (the budget its planned row is solved for)")
    else:
        preset_batch = PRESET_BATCH.get(config, 1) if source == "spec" else 1
    spec = load_benchmark_spec(config, args.sample_size, source)
    for policy in args.policies:  # a bad one is refused before anything runs
        if args.controlnet:
            split_pair_plan(controlnet_pair(spec), policy_arg(policy))
        else:
            resolve_plan(spec, policy_arg(policy))
    policies = list(dict.fromkeys(["none", *(policy_arg(p) if args.controlnet else p for p in args.policies)]))
    device = _device(args.framework, args.world_size, args.device, spec, source)
    regime = Regime(args.precision, args.trainable, args.optimizer, args.ema, args.keep_grads)
    if regime.keep_grads and "jax" in args.framework:
        raise SpecError(f"--keep-grads: {JAX_KEEPS_NO_GRADS}")
    common = {
        "config": config,
        "source": source,
        "sample_size": spec.sample_size,
        "batch_sizes": tuple(dict.fromkeys(args.batch_size or (preset_batch,))),
        "steps": args.steps,
        **regime.as_dict(),
        "device": device,
        "context_length": args.context_length,
        "world_size": args.world_size,
    }
    timeline = timeline_policies(args.timeline, policies)
    # the pair's one workload carries the attention chunk (`pair_compare.run`)
    theirs = tuple(dict.fromkeys([*DIFFUSERS_POLICIES, *policies]))
    jobs = [
        Job(
            framework=fw,
            policies=theirs if fw == DIFFUSERS else tuple(policies),
            timeline=() if fw == DIFFUSERS else timeline,
            xla_default=args.xla_default,
            attention_chunk=args.jax_attention_chunk if fw == "jax" or args.controlnet else None,
            jax_cache=args.jax_cache if fw == "jax" else None,
            **common,
        )
        for fw in args.framework
    ]
    torch_job = next((j for j in jobs if j.framework == "torch"), None)
    extra = compiled.compiled_job(args.compile, args.compile_budget_at, torch_job, policies)
    return args, jobs if extra is None else [*jobs, extra]


def timeline_policies(requested: str | None, policies: list[str]) -> tuple[str, ...]:
    """none and the plan drawn beside it (SpecError if that plan is not measured)."""
    if requested == "off":
        return ()
    plans = [p for p in policies if p != "none"]
    if requested is None:
        requested = "full" if "full" in plans else (plans[0] if plans else None)
    elif requested not in plans:
        raise SpecError(f"timeline: {requested!r} is not among the measured policies ({', '.join(plans) or 'none'})")
    return ("none",) if requested is None else ("none", requested)


def _device(frameworks: tuple[str, ...], world_size: int, device: str, spec: UNetSpec, source: str) -> str:
    """The device the jobs run on; SpecError, in one line, for what a chosen framework or --world-size cannot run."""
    if DIFFUSERS in frameworks:
        if world_size > 1:
            raise SpecError("--world-size: diffusers' U-Net is measured in one process only (use torch or jax)")
        if importlib.util.find_spec("diffusers") is None:
            raise SpecError("--framework diffusers: the diffusers package is not installed (pip install diffusers)")
        if source == "spec":
            to_diffusers_config(spec)  # names the field diffusers cannot build
    if world_size > 1 and device == "gpu":
        raise SpecError("--world-size: ranks are CPU processes (gloo) and forced host devices; use --device cpu")
    return "cpu" if world_size > 1 else device  # auto with ranks: they are on the CPU


def run_all(jobs: list[Job], console: Console, verbose: bool, events: list[Event]) -> None:
    """Run the jobs one after another (they would share the cores), their events appended to ``events`` as they
    come."""
    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn()]
    with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        tasks = [progress.add_task(job.framework, total=len(job.rows())) for job in jobs]
        for job, task in zip(jobs, tasks, strict=True):

            def on_event(event: Event, task: Any = task, job: Job = job) -> None:
                events.append(event)
                if event["event"] == "start":
                    row = f"{event['policy']} @ batch {event['batch_size']}"
                    progress.update(task, description=f"{job.framework}: {row}")
                    if not console.is_terminal:  # a log file or a pipe: rich draws its bar only when all is done
                        print(f"compare: {job.framework}: {row} ...", file=sys.stderr, flush=True)
                elif event["event"] == "row":
                    progress.update(task, advance=1, description=f"{job.framework}: last {event['status']}")

            start = time.perf_counter()
            run_job(job, on_event, verbose)
            events.append({"event": "wall", "framework": job.framework, "seconds": time.perf_counter() - start})
            progress.update(task, description=job.framework)


def build_document(jobs: list[Job], events: list[Event], clock: tuple[float, float | None, float], device: str) -> dict:
    """The JSON document: top-level config, device (``device``: the one asked for), versions, rows and timelines."""
    row_events = [e for e in events if e["event"] == "row"]
    rows = tables.complete(row_events)
    envs = {e["framework"]: e for e in events if e["event"] == "env"}
    spec, jax = job_spec(jobs[0]), next((j for j in jobs if j.framework == "jax"), None)
    return {
        "config": {"name": spec.name, "source": jobs[0].config, "spec": spec.model_dump(mode="json")},
        "device": {"requested": device, **{fw: env["device"] for fw, env in envs.items()}},
        "versions": {
            "python": platform.python_version(),
            **{k: v for e in envs.values() for k, v in e["versions"].items()},
        },
        "git_sha": git_sha(),
        "dtype": jobs[0].regime.compute_dtype or "float32",
        "regime": jobs[0].regime.as_dict(),
        "settings": {k: v for k, v in asdict(jobs[0]).items() if k not in ("framework", "done", "policies")}
        | {
            "policies": {job.framework: list(job.policies) for job in jobs},
            "attention_chunk": jax.attention_chunk if jax else None,
            "jax_cache": jax.jax_cache if jax else None,
        },
        "xla_flags": envs["jax"]["xla_flags"] if "jax" in envs else None,
        "methods": tables.methods(rows),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": {
            "total": round(time.perf_counter() - clock[0], 1),
            **{e["framework"]: round(e["seconds"], 1) for e in events if e["event"] == "wall"},
        },
        # Other work on a shared machine skews times: the share of the cores it took during the run.
        "other_cpu_share": other_cpu_share(clock, cpu_snapshot()),
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
        "rows": rows,
        "timelines": [
            {"framework": e["framework"], "policy": e["policy"], "batch_size": e["batch_size"], **e["timeline"]}
            for e in row_events
            if e.get("timeline")
        ],
    }


def keep_measured(
    prog: str,
    out: Path,
    device: str,
    jobs: list[Job],
    events: list[Event],
    clock: tuple,
    stop: KeyboardInterrupt,
) -> Interrupted:
    """An interrupted run: the rows so far in ``<out>/<prog>-*.json``, marked incomplete; the interrupt to raise."""
    signum = stop.signum if isinstance(stop, Interrupted) else signal.SIGINT
    rows = [e for e in events if e["event"] == "row"]
    if not rows:
        return Interrupted(signum, "every worker stopped; nothing was measured, nothing written")
    document = build_document(jobs, events, clock, device)
    total = sum(len(job.rows()) for job in jobs)  # max_batch: its probes (it adds rows as it goes)
    of_total = f" of {total}" if total >= len(rows) else ""
    document["incomplete"] = f"interrupted by {signal.Signals(signum).name} after {len(rows)}{of_total} rows"
    path = out / f"{prog}-{document['config']['name']}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    tables.write_json(path, document)
    return Interrupted(signum, f"every worker stopped; the {len(rows)} row(s) measured are in {path} (incomplete)")


def main(argv: list[str] | None = None) -> int:
    with cli_errors("benchmarks.compare"):
        args, jobs = parse_args(argv)
        console = console_for(args.wide)
        check_out_dir(args.out)
        if args.controlnet:
            return pair_compare.main(jobs, args.plan_budget_mib, args.out, console)
        clock, events = cpu_snapshot(), []
        try:
            run_all(jobs, console, args.verbose, events)
        except KeyboardInterrupt as stop:
            raise keep_measured("compare", args.out, args.device, jobs, events, clock, stop) from None
        document = build_document(jobs, events, clock, args.device)
        show(console, document, args.wide)
        stem = f"compare-{document['config']['name']}-{time.strftime('%Y%m%d-%H%M%S')}"
        paths = [args.out / f"{stem}.json", args.out / f"{stem}.csv"]
        tables.write_json(paths[0], document)
        tables.write_csv(paths[1], document["rows"])
        for path in paths + plot.write_plots(document, args.out, stem):
            console.print(f"wrote {path}")
    errors = [r["error"] for r in document["rows"] if r["status"] == "error"]
    if errors:
        print(f"python -m benchmarks.compare: error: {len(errors)} row(s) failed, first: {errors[0]}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
