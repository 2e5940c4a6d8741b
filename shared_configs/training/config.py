"""A training run's configuration: the shared CLI of ``python -m {torch_impl,jax_impl}.train``.

`TrainConfig` holds every flag; `parse_args` validates them all before any work (numbers finite
and in range, the schedule's betas in (0, 1)); `run_record` is what a checkpoint remembers of the
run, and `resume_differences` what a ``--resume`` command line changes of it. `cli_main` turns
the loops' errors into one line: exit 2 for bad input (flags, spec, run folder, checkpoint), 1
for a run that fails (a non-finite loss, an OS error, a checkpoint that could not be written),
128 + the signal's number for a run stopped by a signal (`shared_configs.training.preemption`).

The DDPM pieces live in `shared_configs.training.ddpm` (schedule, sampler), `shared_configs.training.data` (batches)
and `shared_configs.training.outputs` (progress, plots); the run folder in `shared_configs.training.run_folder`.
No torch or jax import.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from shared_configs.cli import OneLineParser, cache_dir, nonnegative, positive, positive_mib
from shared_configs.defaults import AUTO, CHUNK_HELP, chunk_arg, defaults, jax_cache_dir, resolve_chunk
from shared_configs.regime import Regime, add_regime_arguments
from shared_configs.spec import SpecError, UNetSpec
from shared_configs.training.data import DATASETS
from shared_configs.training.ddpm import SCHEDULES, make_schedule
from shared_configs.training.manifest import CheckpointWriteError
from shared_configs.training.preemption import Stopped, exit_status, resume_command


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on (the CLI flags, one for one)."""

    config: str = "tiny"
    policy: str | None = None  # None: the spec's own `checkpoint:` field ("none" if it has none)
    budget_mib: float | None = None  # instead of a policy: the plan the planner finds for this run
    batch_size: int = 16
    steps: int = 200
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0
    precision: str = "fp32"  # the regime (shared_configs.regime): precision, what is trained,
    trainable: str = "all"  # the optimizer, an EMA copy
    optimizer: str = "adamw"
    ema: bool = False
    out: str = "runs/train"
    resume: bool = False
    overwrite: bool = False
    data: str = "digits"
    schedule: str = "linear"
    timesteps: int = 1000
    sample_steps: int = 20
    num_samples: int = 20
    checkpoint_every: int = 100
    distributed: str | None = None  # None: one process; else a key of DISTRIBUTED[framework]
    compile: bool = False  # torch_impl only: the step's model is torch.compile(model) (jax always jits)
    # jax_impl only: UNet(attention_chunk=...); "auto": the device's (`shared_configs.defaults`)
    attention_chunk: int | str | None = AUTO
    jax_cache: str | None = field(default_factory=jax_cache_dir)  # jax_impl only: persistent compilation cache

    @property
    def regime(self) -> Regime:
        return Regime(self.precision, self.trainable, self.optimizer, self.ema)


# The fields only jax_impl.train has flags for (torch's SDPA attention has no chunking; no XLA cache).
JAX_ONLY: tuple[str, ...] = ("attention_chunk", "jax_cache")
# The fields only torch_impl.train has flags for (the JAX step is always compiled: jax.jit).
TORCH_ONLY: tuple[str, ...] = ("compile",)

# --distributed modes per framework. ddp: the batch split over processes (torch DDP) or devices
# (JAX), parameters replicated; fsdp: parameters, gradients and optimizer state sharded too
# (torch FSDP2; JAX sharding annotations over the same mesh axis as the batch).
DISTRIBUTED: dict[str, tuple[str, ...]] = {"torch_impl": ("ddp", "fsdp"), "jax_impl": ("ddp", "fsdp")}

# The fields that shape the loss curve: a resumed run must keep them (with the spec). The rest
# (steps, policy, sampling, checkpoint interval, sharding, attention chunking) may change.
CURVE_FIELDS = (
    "batch_size", "lr", "weight_decay", "seed", "precision", "trainable", "optimizer", "ema", "data", "schedule",
    "timesteps",
)  # fmt: skip


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite: the run stops at that step, its last good checkpoint kept."""


def parse_args(argv: list[str] | None, framework: str) -> TrainConfig:
    """Parse the shared CLI of ``python -m {torch_impl,jax_impl}.train``."""
    d = TrainConfig()
    p = OneLineParser(prog=_prog(framework), description="DDPM noise-prediction training.")
    p.add_argument("--config", default=d.config, help="preset name or YAML path (default: tiny)")
    plan = p.add_mutually_exclusive_group()
    plan.add_argument(
        "--policy",
        default=d.policy,
        help="checkpoint policy: none, full, balanced, layers, every:N (default: the spec's checkpoint "
        "field, else none)",
    )
    plan.add_argument(
        "--budget-mib",
        type=positive_mib,
        default=d.budget_mib,
        help="instead of --policy: the cheapest plan whose step is predicted to fit this many MiB (per rank), "
        "for this run's spec, batch and ranks (profiled once, cached); prints the predicted and measured peak",
    )
    p.add_argument("--batch-size", type=positive(int), default=d.batch_size)
    p.add_argument("--steps", type=positive(int), default=d.steps, help="total steps (a resumed run stops here too)")
    p.add_argument("--lr", type=positive(float), default=d.lr)
    p.add_argument("--weight-decay", type=nonnegative(float), default=d.weight_decay, help="AdamW decoupled decay")
    p.add_argument("--seed", type=nonnegative(int), default=d.seed)
    add_regime_arguments(p)
    p.add_argument(
        "--out",
        default=f"runs/{framework}",
        help="run folder (checkpoint, losses.json, plots); owned by one run at a time",
    )
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true", help="continue the run in OUT (same curve flags, more steps)")
    start.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in an OUT that holds a checkpoint (replaced at the new run's first checkpoint)",
    )
    p.add_argument("--data", choices=DATASETS, default=d.data)
    p.add_argument("--schedule", choices=SCHEDULES, default=d.schedule)
    p.add_argument("--timesteps", type=positive(int), default=d.timesteps, help="diffusion steps T (linear: >= 21)")
    p.add_argument("--sample-steps", type=nonnegative(int), default=d.sample_steps, help="sampler steps; 0: none")
    p.add_argument("--num-samples", type=positive(int), default=d.num_samples)
    p.add_argument("--checkpoint-every", type=positive(int), default=d.checkpoint_every)
    modes = DISTRIBUTED[framework]
    p.add_argument(
        "--distributed", nargs="?", const="ddp", default=d.distributed, choices=modes, help=DISTRIBUTED_HELP[framework]
    )
    if framework == "torch_impl":
        p.add_argument("--compile", action="store_true", help=COMPILE_HELP)
    if framework == "jax_impl":  # torch's CPU attention kernel is fused already: no twin
        p.add_argument("--attention-chunk", type=chunk_arg, default=d.attention_chunk, metavar="N", help=CHUNK_HELP)
        p.add_argument("--jax-cache", type=cache_dir, default=d.jax_cache or "none", metavar="DIR",
                       help="JAX's persistent compilation cache folder (%(default)s; 'none': off)")  # fmt: skip
    args = p.parse_args(argv)
    try:
        make_schedule(args.schedule, args.timesteps)
    except ValueError as err:
        p.error(f"--{err}")
    if getattr(args, "compile", False) and (args.distributed or args.budget_mib is not None):
        other = "--distributed (DDP/FSDP2 under torch.compile is not tested here)" if args.distributed else (
            "--budget-mib (the planner profiles and checks eager steps)")  # fmt: skip
        p.error(f"--compile: not with {other}; drop one of them")
    return TrainConfig(**vars(args))


COMPILE_HELP = (
    "train torch.compile(model) (the plan's checkpoints traced into the graph; docs/compile.md); "
    "the first step's seconds, compile included, are printed apart"
)

DISTRIBUTED_HELP = {
    "torch_impl": "ddp (what --distributed alone means): DDP over gloo; fsdp: FSDP2, one shard unit per U-Net "
    "block, checkpoints sharded (torch.distributed.checkpoint). Launch with torchrun",
    "jax_impl": "ddp (what --distributed alone means): the batch split over all devices, state replicated; fsdp: "
    "parameters, gradients and optimizer state sharded over the same devices (jax.sharding)",
}


def used(cfg: TrainConfig, framework: str, device: str) -> str:
    """What the run uses on ``device``, as every tool says it (`shared_configs.defaults.Defaults.describe`)."""
    dtype = cfg.regime.compute_dtype or "float32"  # the forward's (the regime's precision says the rest)
    if framework == "torch_impl":  # torch's SDPA attention: nothing to choose
        return replace(defaults(device), dtype=dtype).describe(("dtype",)) + ", torch attention SDPA"
    chunk = resolve_chunk(cfg.attention_chunk, device)
    run = replace(defaults(device), dtype=dtype, attention_chunk=chunk, jax_cache=cfg.jax_cache)
    return run.describe(("attention_chunk", "dtype", "jax_cache"))


def run_record(cfg: TrainConfig, spec: UNetSpec) -> dict[str, Any]:
    """What a checkpoint remembers of its run: every flag but resume/overwrite, and the spec."""
    config = {k: v for k, v in asdict(cfg).items() if k not in ("resume", "overwrite")}
    return {"config": config, "spec": spec.model_dump(mode="json")}


def resume_differences(saved: dict[str, Any], cfg: TrainConfig, spec: UNetSpec) -> list[str]:
    """``--flag now (run: then)`` for each curve field and spec field that a resume would change."""
    now = run_record(cfg, spec)
    diffs = [
        f"--{name.replace('_', '-')} {now['config'][name]} (run: {saved['config'].get(name)})"
        for name in CURVE_FIELDS
        if saved["config"].get(name) != now["config"][name]
    ]
    spec_then, spec_now = saved["spec"], now["spec"]
    keys = sorted(set(spec_then) | set(spec_now))
    diffs += [
        f"spec {k} {spec_now.get(k)} (run: {spec_then.get(k)})" for k in keys if spec_then.get(k) != spec_now.get(k)
    ]
    return diffs


def check_finite(loss: float, step: int, total: int, last_saved: str) -> None:
    """Raise `NonFiniteLoss` (one line naming the 1-based step) if ``loss`` is NaN or infinite."""
    if loss != loss or loss in (float("inf"), float("-inf")):
        raise NonFiniteLoss(f"step {step + 1} of {total}: the loss is {loss}; stopped there. {last_saved}")


def cli_main(train: Callable[[TrainConfig], list[float]], argv: list[str] | None, framework: str) -> int:
    """Run ``train`` from the command line; an error is one line: status 2 for bad input, 1 for a
    failed run, 128 + signal number for a run a signal stopped (its line says how to resume).

    Under torchrun every rank meets the same bad input (the checks read the same flags and files),
    the same non-finite global loss, the same stop step and the same failed checkpoint write (the
    ranks agree on each), so only rank 0 prints those; any rank prints its other OS errors.
    """
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_args(argv, framework)
    rank, prog = int(os.environ.get("RANK", "0")), _prog(framework)
    try:
        train(cfg)
    except (SpecError, ValueError, FileNotFoundError, NotImplementedError) as err:
        return _report(prog, err, 2, rank == 0)
    except (NonFiniteLoss, CheckpointWriteError) as err:
        return _report(prog, err, 1, rank == 0)
    except OSError as err:
        return _report(prog, err, 1, True, f"rank {rank}: " if rank else "")
    except Stopped as stop:
        if rank == 0:
            print(f"{prog}: {stop.line(resume_command(f'{framework}.train', argv))}", file=sys.stderr)
        return exit_status(stop.signum)
    except KeyboardInterrupt:  # outside the steps (loading, sampling): the checkpoints are as they were
        if rank == 0:
            print(f"{prog}: interrupted outside the steps; the checkpoints in {cfg.out} are kept", file=sys.stderr)
        return exit_status(signal.SIGINT)
    return 0


def _prog(framework: str) -> str:
    return f"python -m {framework}.train"


def _report(prog: str, err: Exception, code: int, show: bool, prefix: str = "") -> int:
    if show:  # the parser's own format (`OneLineParser`): one line, ``<prog>: error: ...``
        print(f"{prog}: error: {prefix}{err}", file=sys.stderr)
    return code
