"""The cheapest checkpoint plan for a model, batch and memory budget, predicted and (--verify) measured.

    python -m benchmarks.plan --config small --sample-size 32 --batch-size 4 --budget-mib 1200
    python -m benchmarks.plan ... --framework both --verify --json plan.json
    python -m benchmarks.plan --config sd15 --sample-size 64 --batch-size 8 --policy layers --shapes
    python -m benchmarks.plan --diffusers path/to/unet --batch-size 4 --budget-mib 8192 --trainable lora:8

Prints the policy string both U-Nets accept beside none's and full's peaks, the plan's saving and
cost per framework and a per-block listing (`benchmarks.reports.plan_text`); ``--policy P``
predicts (--verify measures) a policy given. The method: docs/planning.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import plan_sweep
from benchmarks.harness.job import load_benchmark_spec
from benchmarks.reports import plan_text
from benchmarks.reports.tables import write_json
from shared_configs import SpecError
from shared_configs.cli import (
    OneLineParser,
    cli_errors,
    config_help,
    nonnegative,
    number_list,
    positive_float,
    positive_int,
    positive_mib,
    stopping,
)
from shared_configs.defaults import AUTO, CHUNK_HELP, chunk_arg, defaults, resolve_chunk
from shared_configs.planning import gpu, optimizer_step, whole
from shared_configs.planning.budget import DISTRIBUTED, Prediction, Profile
from shared_configs.planning.candidates import DEFAULT_ROUNDS, MIN_ROUNDS, RACE_WITHIN, default_rounds
from shared_configs.planning.encoders import pipeline_configs
from shared_configs.planning.pipeline import (
    DEFAULT_BYTES_PER_S,
    DEFAULT_FLOPS_PER_S,
    DEVICE,
    RACED,
    Workload,
    frameworks_of,
    get_profile,
    measure,
    plan,
    predict_policy,
)
from shared_configs.planning.stepclock import paired
from shared_configs.planning.units import assignment_of
from shared_configs.regime import Regime, add_regime_arguments
from shared_configs.sizes import MIB

VERIFY_CANDIDATES = 4  # --candidates with --verify: the optimum and the three next best plans


CANDIDATES_HELP = (
    "choose by measuring: the solver's best K plans (its optimum, then the next distinct ones) and the hand "
    f"policies predicted within {100 * RACE_WITHIN:.0f}%% of the optimum whose checked peak fits race round by "
    "round in one process per framework, and the fastest whose measured peak fits is returned: never slower than "
    f"a raced hand policy beyond the stated interval. Each is run (in JAX compiled: minutes). Default "
    f"{VERIFY_CANDIDATES} with --verify, else 1 in torch (0 with --shapes or in JAX: the solver's plan, unmeasured)"
)


_ratios = number_list(float, "ratios in (0, 1]", lambda v: 0 < v <= 1, skip_blank=True)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m benchmarks.plan", description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help=config_help())
    source.add_argument(
        "--diffusers",
        metavar="PATH|REPO_ID",
        help="a diffusers UNet2D(Condition)Model folder, a pipeline folder with unet/, or a repo id in "
        "the local Hugging Face cache: plan for its config (torch_impl.apply_plan applies the plan "
        "to that model)",
    )
    p.add_argument(
        "--controlnet",
        action="store_true",
        help="plan diffusers' ControlNet training step: the U-Net frozen, the ControlNet made from it "
        "trained; plans name the ControlNet's units controlnet.down.0, controlnet.mid, ... and the "
        "U-Net's as they are (shared_configs.pair)",
    )
    p.add_argument("--sample-size", type=positive_int, help="the side of the (latent) image (default: the spec's)")
    p.add_argument("--batch-size", type=positive_int, required=True, help="the training batch")
    p.add_argument("--budget-mib", type=positive_mib, help="the step's memory budget, MiB (required but for --sweep)")
    p.add_argument("--policy", help="predict this policy's peak and cost instead of solving (e.g. layers, full)")
    p.add_argument(
        "--framework",
        choices=("torch", "jax", "both"),
        default="torch",
        help="plan for this framework; both: one plan that fits in each (default torch)",
    )
    p.add_argument(
        "--world-size", type=positive_int, default=1, help="ranks, each training --batch-size samples (default 1)"
    )
    p.add_argument(
        "--distributed",
        choices=DISTRIBUTED,
        default="ddp",
        help="with --world-size: fsdp shards parameters and optimizer state (ddp)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="measure the plan (and none) and print predicted vs measured; with a measured profile it "
        "also turns --candidates on",
    )
    p.add_argument("--candidates", type=nonnegative(int), metavar="K", help=CANDIDATES_HELP)
    p.add_argument(
        "--rounds",
        type=positive_int,
        help=f"--candidates: at most this many rounds; a candidate leaves the race once another is faster "
        f"than it round by round at 90%%, from round {MIN_ROUNDS} (default {DEFAULT_ROUNDS}; {MIN_ROUNDS} with one)",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="write the plan, predictions and measurements here")
    p.add_argument("--sweep", type=Path, metavar="DIR", help="draw the frontier (PNG + JSON) with the hand policies")
    p.add_argument("--budgets", type=positive_int, default=5, help="--sweep: budgets from full's to none's peak (5)")
    p.add_argument("--shapes", action="store_true", help="profile from shapes only: nothing allocated or run")
    p.add_argument(
        "--flops-per-s",
        type=positive_float,
        default=DEFAULT_FLOPS_PER_S,
        help="--shapes: conv/matmul/attention throughput for time (default %(default).0e FLOP/s)",
    )
    p.add_argument(
        "--bytes-per-s",
        type=positive_float,
        default=DEFAULT_BYTES_PER_S,
        help="--shapes: memory bandwidth for elementwise recompute (default %(default).0e B/s)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", *gpu.DEVICES),
        default="cpu",
        help="cuda: plan for a CUDA GPU: the step as the card holds it (torch: autocast's float32 norms, "
        "the optimizer's foreach temporaries, workspaces, the allocator, the context; docs/regimes.md), "
        "--budget-mib being the card's memory as nvidia-smi counts it; cuda-sm90: Hopper's workspaces "
        "(default cpu)",
    )
    p.add_argument(
        "--with-encoders",
        action="store_true",
        help="torch: the whole step of a diffusers script: the family's frozen VAE encoding each batch "
        "and its text encoder(s) beside the U-Net, from their configs on fake tensors (nothing "
        "downloaded); a peak inside one is named",
    )
    p.add_argument("--cached-latents", action="store_true", help="with --with-encoders: no VAE (latents cached)")
    p.add_argument(
        "--train-text-encoder",
        action="store_true",
        help="torch: the text encoder trained too (float32, its gradients and optimizer state)",
    )
    p.add_argument(
        "--unfused-attention",
        action="store_true",
        help="with --device: attention that keeps its probabilities (diffusers' AttnProcessor without "
        "SDPA or xformers: torch before 2.0)",
    )
    p.add_argument(
        "--optimizer-impl",
        choices=sorted({i for _, i in optimizer_step.SOURCES}),
        help="with --device: the optimizer as it runs (default: torch's on CUDA, foreach for AdamW, "
        "torchao for adamw8bit); bitsandbytes: diffusers' --use_8bit_adam, updating in place",
    )
    add_regime_arguments(p)
    d = defaults(DEVICE)
    p.add_argument("--attention-chunk", type=chunk_arg, default=AUTO, metavar="N", help=CHUNK_HELP)
    p.add_argument(
        "--context-length", type=positive_int, default=d.context_length, help="cross-attention tokens (%(default)s)"
    )
    p.add_argument("--steps", type=positive_int, default=d.steps, help="--verify: timed steps per policy (%(default)s)")
    p.add_argument(
        "--torch-compile",
        type=_ratios,
        metavar="R,R",
        default=[],
        help="--sweep --verify: also torch.compile at these activation_memory_budget ratios (minutes each)",
    )
    p.add_argument(
        "--random-plans",
        type=positive_int,
        default=0,
        metavar="N",
        help="--sweep --verify: also measure N random per-unit plans (the peak model's error)",
    )
    p.add_argument(
        "--solve-times",
        action="store_true",
        help="time the solver at 13 budgets from the smallest feasible to none's peak",
    )
    p.add_argument(
        "--efficiency",
        action="store_true",
        help="print MiB freed per recompute-second by level and unit kind (from the profile)",
    )
    return p


@dataclass(frozen=True)
class Question:
    """What to answer for a workload: the plan for ``budget_mib``, or ``policy``'s prediction."""

    framework: str = "torch"
    world_size: int = 1
    distributed: str = "ddp"
    policy: str | None = None
    budget_mib: float | None = None
    candidates: int = 0
    rounds: int = DEFAULT_ROUNDS
    verify: bool = False
    steps: int = defaults(DEVICE).steps


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Workload, Question]:
    """The flags, the workload they describe and the question; SpecError for a combination refused."""
    args = build_parser().parse_args(argv)
    sharded = args.distributed == "fsdp" and args.world_size > 1
    refused = [  # (a combination of flags, why it is refused)
        (
            args.policy is not None
            and (args.budget_mib is not None or args.sweep is not None or args.solve_times or args.candidates),
            "--policy: predicts the policy given; not with --budget-mib, --sweep, --solve-times or --candidates",
        ),
        (
            args.budget_mib is None and args.sweep is None and args.policy is None,
            "--budget-mib: required (a positive number of MiB), unless --sweep or --policy",
        ),
        (
            sharded and (args.verify or args.candidates or args.sweep is not None),
            "--world-size with --distributed fsdp: --verify, --candidates and --sweep measure one process only",
        ),
        (
            args.controlnet and (args.sweep is not None or args.world_size > 1),
            "--controlnet: plans and measures one process's step; not with --sweep or --world-size",
        ),
        (
            args.device != "cpu" and (args.framework == "jax" or args.sweep is not None),
            f"--device {args.device}: the GPU flavour is torch's step (CUDA autocast, its caching allocator), for a "
            "plan or --policy; not with --framework jax or --sweep",
        ),
    ]
    for combination, why in refused:
        if combination:
            raise SpecError(why)
    source = ("diffusers", args.diffusers) if args.diffusers else ("spec", args.config)
    workload = Workload.of(
        load_benchmark_spec(source[1], None, source[0]),
        args.sample_size,
        controlnet=args.controlnet,
        batch_size=args.batch_size,
        context_length=args.context_length,
        attention_chunk=resolve_chunk(args.attention_chunk, DEVICE),
        shapes=args.shapes,
        flops_per_s=args.flops_per_s,
        bytes_per_s=args.bytes_per_s,
        regime=Regime(args.precision, args.trainable, args.optimizer, args.ema, args.keep_grads),
        device=args.device,
        with_encoders=args.with_encoders,
        cached_latents=args.cached_latents,
        train_text_encoder=args.train_text_encoder,
        unfused_attention=args.unfused_attention,
        optimizer_impl=args.optimizer_impl,
        encoder_configs=pipeline_configs(args.diffusers) if args.diffusers else None,
    )
    raced = int(args.framework in RACED and not args.shapes)  # the hand policies near the plan race it
    count = (VERIFY_CANDIDATES if args.verify else raced) if args.candidates is None else args.candidates
    return (
        args,
        workload,
        Question(
            args.framework,
            args.world_size,
            args.distributed,
            args.policy,
            args.budget_mib,
            candidates=count,
            rounds=args.rounds or default_rounds(count),
            verify=args.verify,
            steps=args.steps,
        ),
    )


def plan_document(q: Question, workload: Workload) -> dict[str, Any]:
    """The --json document: the plan (``--policy``'s: no budget, margin or solver time), per framework the
    predictions (and measurements), the measured candidates."""
    report = None
    if q.policy is not None:
        sol, profiles = predict_policy(workload, q.policy, q.framework, q.world_size, q.distributed)
        budget, margin, solve_s = None, None, None
    else:
        budget = int(q.budget_mib * MIB)
        found = plan(workload, budget, q.framework, q.world_size, q.distributed, q.candidates, q.rounds)
        sol, profiles, margin, solve_s, report = (
            found.solution,
            found.profiles,
            found.margin,
            found.solve_seconds,
            found.candidates,
        )
    frameworks = frameworks_of(q.framework)
    per_fw = {
        fw: _framework_entry(q, workload, fw, profile, pred, sol.policy, report)
        for fw, profile, pred in zip(frameworks, profiles, sol.predictions, strict=True)
    }
    doc = {
        "plan": sol.policy,
        "budget_bytes": budget,
        "frameworks": per_fw,
        "settings": workload.used(frameworks),
        "regime": workload.regime.as_dict(),
    }
    if report is not None:
        doc["candidates"] = report
    return doc | {"margin": margin, "solve_seconds": solve_s, "world_size": q.world_size, "distributed": q.distributed}


def _framework_entry(
    q: Question,
    workload: Workload,
    fw: str,
    profile: Profile,
    pred: Prediction,
    policy: str,
    report: dict[str, Any] | None,
) -> dict[str, Any]:
    """One framework's predictions of ``policy``, with --verify measured beside none (or the race's)."""
    timed = "measured"
    if profile.mode != "measured":
        rates = f"{profile.flops_per_s:.3g} FLOP/s + elementwise bytes at {workload.bytes_per_s:.3g} B/s"
        timed = f"estimated: FLOPs at {rates}"
    entry: dict[str, Any] = {
        "predicted_peak_bytes": pred.peak_bytes,
        "predicted_overhead": pred.overhead(profile),
        "recompute_flops": pred.flops,
        "peak_at": pred.peak_unit,
        "reference_peak_bytes": plan_text.references(profile, workload),  # none's and full's, to read it against
        "time_method": timed,
    }
    if profile.meta.get("modelled"):  # a part not measured (adamw8bit's state): said beside the figure
        entry["modelled"] = profile.meta["modelled"]
    if workload.device != "cpu" and fw == "torch":  # the profile is the card's: its readings from the U-Net's own
        assignment = assignment_of(workload.spec, policy)
        alone = get_profile(fw, whole.raw(workload))
        flavour = gpu.estimate(
            alone, workload.spec, workload.regime, assignment, whole.card(workload), extend=whole.extender(workload)
        )
        entry["gpu"] = {"device": workload.device} | asdict(flavour)
    if profile.phases:
        entry["phases"] = profile.phases
    if report and report["chosen"]:  # measured already, in the race: the chosen candidate's figures
        chosen = next(c for c in report["candidates"] if c["chosen"])["frameworks"][fw]
        none = report["reference_rounds_s"][fw][: len(chosen["rounds_s"])]
        entry |= {
            "measured_peak_bytes": chosen["measured_peak_bytes"],
            "measured_overhead": statistics.median(chosen["rounds_s"]) / statistics.median(none) - 1,
            "measured_overhead_paired": chosen["measured_overhead"],
        }
    elif q.verify:
        rows = measure(fw, workload, list(dict.fromkeys(["none", policy])), q.steps)["rows"]
        entry["measured_peak_bytes"] = rows[policy]["peak_bytes"]
        entry["measured_overhead"] = rows[policy]["step_time_s"] / rows["none"]["step_time_s"] - 1
        # round by round against none: the overhead's spread on this machine (--steps 5 and up bound it)
        entry["measured_overhead_paired"] = paired(rows[policy]["rounds_s"], rows["none"]["rounds_s"])
    return entry


def main(argv: list[str] | None = None) -> int:
    with (
        cli_errors("benchmarks.plan"),
        stopping("every worker stopped; nothing written (profiles measured stay cached)"),
    ):
        args, workload, question = parse_args(argv)
        frameworks = frameworks_of(args.framework)
        if args.sweep is not None or args.solve_times:  # (a plan's header says it)
            print(f"settings {workload.used(frameworks)}")
        if args.sweep is not None:
            doc = plan_sweep.sweep(
                workload, frameworks, args.budgets, args.verify, args.steps, args.torch_compile, args.random_plans
            )
            for part in (plan_sweep.table, plan_sweep.errors, plan_sweep.against_balanced, plan_sweep.against_hand):
                print(part(doc))
            for fw, data in doc["frameworks"].items():
                print(f"{fw}: MiB freed per recompute-second\n" + plan_sweep.efficiency_table(data["efficiency"]))
            print("wrote", ", ".join(map(str, plan_sweep.write(doc, args.sweep))))
            return 0
        if args.solve_times:
            times = plan_sweep.solve_times([get_profile(fw, workload) for fw in frameworks], workload)
            print(
                f"solver on {workload.spec.name} ({'+'.join(frameworks)}, {times['unit_choices']} unit choices): "
                f"{times['budgets']} budgets, wall median {times['median_s']:.2f} s, max {times['max_s']:.2f} s; "
                f"CPU median {times['median_cpu_s']:.2f} s, max {times['max_cpu_s']:.2f} s"
            )
            return 0
        if args.efficiency:
            for fw in frameworks:
                rows = plan_sweep.efficiency(get_profile(fw, workload), workload)
                print(f"{fw}:\n" + plan_sweep.efficiency_table(rows))
        doc = plan_document(question, workload)
        print(plan_text.render(doc, workload))
        if args.json is not None:
            write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
