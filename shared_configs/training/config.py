"""A training run's configuration: the shared CLI of ``python -m {torch_impl,jax_impl}.train``.

`TrainConfig` holds every flag (the regime's four as one `Regime`, a framework's own as its options object);
`run_record` is what a checkpoint remembers, `resume_differences` what a ``--resume`` changes; `cli_main` turns
errors into one line (exit 2 bad input, 1 failed run, 128 + signal). No torch or jax import. docs/training.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Protocol, TypeVar

from shared_configs.cli import OneLineParser, nonnegative, positive, positive_mib
from shared_configs.defaults import FIELDS, defaults
from shared_configs.regime import DEFAULT, Regime, add_regime_arguments
from shared_configs.sizes import MIB
from shared_configs.spec import SpecError, UNetSpec
from shared_configs.training.data import DATASETS
from shared_configs.training.ddpm import SCHEDULES, make_schedule
from shared_configs.training.manifest import CheckpointWriteError
from shared_configs.training.preemption import Stopped, resume_command


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on (the CLI flags; the regime's four as one value)."""

    config: str = "tiny"
    policy: str | None = None  # None: the spec's own `checkpoint:` field ("none" if it has none)
    budget_mib: float | None = None  # instead of a policy: the plan the planner finds for this run
    batch_size: int = 16
    steps: int = 200
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0
    regime: Regime = DEFAULT  # --precision, --trainable, --optimizer, --ema (`shared_configs.regime`)
    out: str = "runs/train"
    resume: bool = False
    overwrite: bool = False
    data: str = "digits"
    schedule: str = "linear"
    timesteps: int = 1000
    sample_steps: int = 20
    num_samples: int = 20
    checkpoint_every: int = 100
    log_every: int = 10  # off a terminal: a line with the running loss every this many steps
    distributed: str | None = None  # None: one process; else a key of DISTRIBUTED[framework]
    controlnet: bool = False  # train a ControlNet on the spec's U-Net, frozen (`shared_configs.pair`)
    options: Options | None = None  # the framework's own flags (`FrameworkCLI.options`); None: their defaults

    @property
    def budget_bytes(self) -> int | None:
        """``--budget-mib`` in bytes: the one place the MiB a user gives become bytes."""
        return None if self.budget_mib is None else int(self.budget_mib * MIB)


class Options(Protocol):
    """The flags only one framework has (its ``train.py``'s): a frozen dataclass, one field per flag."""

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        """Register the flags (named as the fields, their defaults the dataclass's)."""

    def check(self, cfg: TrainConfig) -> None:
        """Raise ValueError, one line, for a mix of flags the framework refuses."""


@dataclass(frozen=True)
class FrameworkCLI:
    """What one framework's ``train.py`` brings to the shared CLI: its name and its own flags."""

    name: str  # "torch" or "jax", as the planner spells them
    options: type[Options]
    rank: Callable[[], int] = field(default=lambda: int(os.environ.get("RANK", "0")))  # torchrun's; JAX's process

    @property
    def module(self) -> str:
        return f"{self.name}_impl.train"

    @property
    def prog(self) -> str:
        return f"python -m {self.module}"


Opts = TypeVar("Opts", bound=Options)


def options_of(cfg: TrainConfig, kind: type[Opts]) -> Opts:
    """``cfg``'s framework options, of ``kind`` (a config built in code, without them: the defaults)."""
    if cfg.options is None:
        return kind()
    if not isinstance(cfg.options, kind):
        raise TypeError(f"options: expected {kind.__name__}, got {type(cfg.options).__name__}")
    return cfg.options


# --distributed modes per framework (what each means: DISTRIBUTED_HELP).
DISTRIBUTED: dict[str, tuple[str, ...]] = {"torch": ("ddp", "fsdp"), "jax": ("ddp", "fsdp")}

# The fields that shape the loss curve: a resumed run must keep them (with the spec). The rest
# (steps, policy, sampling, checkpoint interval, sharding, attention chunking) may change.
CURVE_FIELDS = (
    "batch_size",
    "lr",
    "weight_decay",
    "seed",
    "precision",
    "trainable",
    "optimizer",
    "ema",
    "data",
    "schedule",
    "timesteps",
    "controlnet",
)
# Curve fields that runs recorded before the flag existed lack: their value then.
ADDED_FIELDS = {"controlnet": False}
# The regime's flags (`shared_configs.regime.add_regime_arguments`), one `TrainConfig.regime` once parsed.
REGIME_FIELDS = tuple(f.name for f in fields(Regime))


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite: the run stops at that step, its last good checkpoint kept."""


class Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's help ends with its default, where it has one (not False or None) the help does not say."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default" in (action.help or "") or action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def parse_args(argv: list[str] | None, framework: FrameworkCLI) -> TrainConfig:
    """Parse the CLI of ``python -m {torch_impl,jax_impl}.train``: the shared flags and ``framework``'s own."""
    d = TrainConfig()
    p = OneLineParser(prog=framework.prog, description="DDPM noise-prediction training.", formatter_class=Defaults)
    p.add_argument("--config", default=d.config, help="preset name or YAML path")
    plan = p.add_mutually_exclusive_group()
    plan.add_argument(
        "--policy",
        default=d.policy,
        help="checkpoint policy: none, full, balanced, layers, every:N "
        "(default: the spec's checkpoint field, else none)",
    )
    plan.add_argument(
        "--budget-mib",
        type=positive_mib,
        default=d.budget_mib,
        help="instead of --policy: the cheapest "
        "plan whose step is predicted to fit this many MiB (per rank), for this run's spec, batch and "
        "ranks (profiled once, cached); prints the predicted and measured peak",
    )
    p.add_argument("--batch-size", type=positive(int), default=d.batch_size, help="the global batch")
    p.add_argument("--steps", type=positive(int), default=d.steps, help="total steps (a resumed run stops here too)")
    p.add_argument("--lr", type=positive(float), default=d.lr, help="learning rate")
    p.add_argument("--weight-decay", type=nonnegative(float), default=d.weight_decay, help="AdamW decoupled decay")
    p.add_argument("--seed", type=nonnegative(int), default=d.seed, help="weights, batches, noise and dropout")
    add_regime_arguments(p)
    p.add_argument(
        "--out",
        default=f"runs/{framework.name}_impl",
        help="run folder (checkpoint, losses.json, plots); owned by one run at a time",
    )
    start = p.add_mutually_exclusive_group()
    start.add_argument("--resume", action="store_true", help="continue the run in OUT (same curve flags, more steps)")
    start.add_argument(
        "--overwrite",
        action="store_true",
        help="start afresh in an OUT that holds a checkpoint (replaced at the new run's first checkpoint)",
    )
    p.add_argument("--data", choices=DATASETS, default=d.data, help="the training images")
    p.add_argument("--schedule", choices=SCHEDULES, default=d.schedule, help="the noise schedule")
    p.add_argument("--timesteps", type=positive(int), default=d.timesteps, help="diffusion steps T (linear: >= 21)")
    p.add_argument("--sample-steps", type=nonnegative(int), default=d.sample_steps, help="sampler steps; 0: none")
    p.add_argument("--num-samples", type=positive(int), default=d.num_samples, help="images in the samples' grid")
    p.add_argument("--checkpoint-every", type=positive(int), default=d.checkpoint_every, help="steps between saves")
    p.add_argument(
        "--log-every",
        type=positive(int),
        default=d.log_every,
        metavar="N",
        help="when stderr is not a terminal (a log, a pipe): the running loss every N steps",
    )
    p.add_argument(
        "--distributed",
        nargs="?",
        const="ddp",
        default=d.distributed,
        choices=DISTRIBUTED[framework.name],
        help=DISTRIBUTED_HELP[framework.name],
    )
    p.add_argument("--controlnet", action="store_true", help=CONTROLNET_HELP)
    framework.options.add_flags(p)
    args = p.parse_args(argv)
    own = [f.name for f in fields(framework.options)]  # type: ignore[arg-type]
    options = framework.options(**{name: getattr(args, name) for name in own})
    shared = {k: v for k, v in vars(args).items() if k not in (*REGIME_FIELDS, *own)}
    regime = Regime(**{k: getattr(args, k) for k in REGIME_FIELDS})  # validated here, once
    cfg = TrainConfig(**shared, regime=regime, options=options)
    try:
        make_schedule(cfg.schedule, cfg.timesteps)
        check_controlnet(cfg)
        options.check(cfg)
    except ValueError as err:
        p.error(str(err))
    return cfg


CONTROLNET_HELP = (
    "train a ControlNet (made from the U-Net as diffusers' ControlNetModel.from_unet) against the U-Net, frozen "
    "at its seeded init, on each sample's edge map; --policy and --budget-mib plan both networks (controlnet.down.0, "
    "up.1, ...)"
)


def check_controlnet(cfg: TrainConfig) -> None:
    """Refuse, in one line, what a ``--controlnet`` run does not combine with (its regime: `pair.step_spec`)."""
    if cfg.controlnet and cfg.distributed:
        raise ValueError("--distributed: --controlnet trains in one process; drop one of them")


DISTRIBUTED_HELP = {
    "torch": "ddp (what --distributed alone means): DDP over gloo; fsdp: FSDP2, one shard unit per U-Net "
    "block, checkpoints sharded (torch.distributed.checkpoint). Launch with torchrun",
    "jax": "ddp (what --distributed alone means): the batch split over all devices, state replicated; fsdp: "
    "parameters, gradients and optimizer state sharded over the same devices (jax.sharding)",
}


def used(cfg: TrainConfig, device: str, **settings: Any) -> str:
    """What the run uses on ``device`` as every tool says it: the dtype and ``settings`` (`Defaults` fields)."""
    run = replace(defaults(device), dtype=cfg.regime.compute_dtype or "float32", **settings)
    return run.describe(tuple(f for f in FIELDS if f == "dtype" or f in settings))


def flags_of(cfg: TrainConfig) -> dict[str, Any]:
    """``cfg`` flag by flag (field names): the regime's four and the framework's own flattened in."""
    flat = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in ("regime", "options")}
    return flat | cfg.regime.as_dict() | ({} if cfg.options is None else asdict(cfg.options))


def run_record(cfg: TrainConfig, spec: UNetSpec) -> dict[str, Any]:
    """What a checkpoint remembers of its run: every flag but resume/overwrite, and the spec."""
    config = {k: v for k, v in flags_of(cfg).items() if k not in ("resume", "overwrite")}
    return {"config": config, "spec": spec.model_dump(mode="json")}


def resume_differences(saved: dict[str, Any], cfg: TrainConfig, spec: UNetSpec) -> list[str]:
    """``--flag now (run: then)`` for each curve field and spec field that a resume would change."""
    now = run_record(cfg, spec)
    then = {**ADDED_FIELDS, **saved["config"]}
    diffs = [
        f"--{name.replace('_', '-')} {now['config'][name]} (run: {then.get(name)})"
        for name in CURVE_FIELDS
        if then.get(name) != now["config"][name]
    ]
    old, new = saved["spec"], now["spec"]
    return diffs + [
        f"spec {k} {new.get(k)} (run: {old.get(k)})" for k in sorted({*old, *new}) if old.get(k) != new.get(k)
    ]


def check_finite(loss: float, step: int, total: int, last_saved: str) -> None:
    """Raise `NonFiniteLoss` (one line naming the 1-based step) if ``loss`` is NaN or infinite."""
    if loss != loss or loss in (float("inf"), float("-inf")):
        raise NonFiniteLoss(f"step {step + 1} of {total}: the loss is {loss}; stopped there. {last_saved}")


def cli_main(train: Callable[[TrainConfig], list[float]], argv: list[str] | None, framework: FrameworkCLI) -> int:
    """Run ``train`` from the command line; an error is one line (status 2: bad input, 1: a failed run, 128 +
    signal: stopped). The ranks agree on all but OS errors, so rank 0 alone prints the others."""
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_args(argv, framework)
    prog = framework.prog
    try:
        train(cfg)
    except (SpecError, ValueError, FileNotFoundError, NotImplementedError) as err:
        return _report(prog, err, 2, framework.rank() == 0)
    except (NonFiniteLoss, CheckpointWriteError) as err:
        return _report(prog, err, 1, framework.rank() == 0)
    except OSError as err:
        rank = framework.rank()
        return _report(prog, err, 1, True, f"rank {rank}: " if rank else "")
    except Stopped as stop:
        if framework.rank() == 0:
            resume = resume_command(framework.module, argv)
            print(
                f"{prog}: {stop}; {stop.checkpoint} and losses.json saved in {stop.out}; resume with: {resume}",
                file=sys.stderr,
            )
        return 128 + stop.signum
    except KeyboardInterrupt:  # outside the steps (loading, sampling): the checkpoints are as they were
        if framework.rank() == 0:
            print(f"{prog}: interrupted outside the steps; the checkpoints in {cfg.out} are kept", file=sys.stderr)
        return 128 + signal.SIGINT
    return 0


def _report(prog: str, err: Exception, code: int, show: bool, prefix: str = "") -> int:
    if show:  # the parser's own format (`OneLineParser`): one line, ``<prog>: error: ...``
        print(f"{prog}: error: {prefix}{err}", file=sys.stderr)
    return code
