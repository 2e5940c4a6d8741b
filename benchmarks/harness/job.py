"""Framework-free pieces shared by the parent CLI and the framework workers.

Nothing here imports torch or jax: the parent process stays free of both runtimes, and each
worker imports exactly one of them.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass, field

from pydantic import TypeAdapter

from shared_configs import SpecError, UNetSpec, from_diffusers_config, load_spec, spec_from_dict
from shared_configs.diffusers.folders import find_folder
from shared_configs.planning.workers import REPO_ROOT, XLA_CPU_FLAG
from shared_configs.regime import Regime
from shared_configs.training.config import TrainConfig

FRAMEWORKS: tuple[str, ...] = ("torch", "jax")  # what --framework both runs
# diffusers' own U-Net (torch), with its enable_gradient_checkpointing() (the baseline ours replace)
# and, beside these rows, the plans of --policies applied to it (torch_impl.apply_plan)
DIFFUSERS = "diffusers"
DIFFUSERS_OWN = "enable_gradient_checkpointing"
DIFFUSERS_POLICIES: tuple[str, ...] = ("none", DIFFUSERS_OWN)
OOM_SIM_ENV = "BENCHMARKS_SIMULATE_OOM"  # "torch:full:2,jax:none:1": raise the framework's OOM there
KILL_SIM_ENV = "BENCHMARKS_SIMULATE_KILL"  # same syntax: SIGKILL the worker there (a host OOM kill)


@dataclass(frozen=True)
class Job:
    """What a worker measures: every (policy, batch size) pair of one framework."""

    framework: str
    config: str  # a preset name or spec YAML path; with source "diffusers", a diffusers model folder
    sample_size: int | None
    policies: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    steps: int
    precision: str  # the training regime (`shared_configs.regime.Regime`): its precision ...
    device: str
    context_length: int
    source: str = "spec"  # "spec" or "diffusers"
    xla_cpu_flag: bool = True  # jax on CPU: disable cse_barrier_expander (see docs/benchmark.md)
    xla_default: bool = True  # jax on CPU: also compile with XLA's default passes, for comparison
    attention_chunk: int | str | None = None  # jax: UNet(attention_chunk=...); "auto": on CPU only
    peak_only: bool = False  # benchmarks.max_batch: the peak alone (no FLOPs, no timing; jax on CPU: no run)
    timeline: tuple[str, ...] = ()  # the policies whose memory-over-the-step record is kept
    jax_cache: str | None = None  # jax: the persistent compilation cache folder (None: off)
    world_size: int = 1  # ranks: torch FSDP2 processes / jax devices, each with a batch of batch_size
    done: tuple[tuple[str, int], ...] = field(default=())  # rows already reported, skipped
    trainable: str = "all"  # ... what it trains, its optimizer, an EMA copy, gradients kept between steps
    optimizer: str = "adamw"
    ema: bool = False
    keep_grads: bool = False

    @property
    def regime(self) -> Regime:
        return Regime(self.precision, self.trainable, self.optimizer, self.ema, self.keep_grads)

    def rows(self) -> list[tuple[str, int]]:
        return [(p, b) for b in self.batch_sizes for p in self.policies if (p, b) not in self.done]


# A job as a worker request carries it (`dataclasses.asdict`) and back: its lists made the tuples a Job holds.
JOBS = TypeAdapter(Job)


def load_benchmark_spec(config: str, sample_size: int | None, source: str = "spec") -> UNetSpec:
    """The preset/file spec (or a local diffusers model or pipeline folder's), ``sample_size`` overridden when given."""
    try:
        found = None if source == "spec" else find_folder(config)
    except FileNotFoundError as err:
        raise SpecError(f"--diffusers: {err}") from None
    spec = load_spec(config) if found is None else from_diffusers_config(found.config, name=found.root.name)
    if sample_size is None or sample_size == spec.sample_size:
        return spec
    return spec_from_dict({**spec.model_dump(), "sample_size": sample_size})


def job_spec(job: Job) -> UNetSpec:
    return load_benchmark_spec(job.config, job.sample_size, job.source)


# The optimiser's hyperparameters: the training loops' defaults, handed to each framework's own
# make_optimizer (AdamW with the same betas and eps in both).
OPTIMIZER = TrainConfig()


def policy_arg(policy: str) -> str:
    """CLI policies are comma-separated, so a block list inside one is joined with '+'."""
    return policy.replace("+", ",")


def parse_sim(env_value: str | None) -> set[tuple[str, str, int]]:
    """Parse a simulation spec ``framework:policy:batch,...`` (testing hooks)."""
    items = [item.strip().rsplit(":", 2) for item in (env_value or "").split(",") if item.strip()]
    return {(fw, policy, int(batch)) for fw, policy, batch in items}


def timing_stats(samples: list[float]) -> dict[str, float]:
    """Median and spread (min, max) of per-step wall times, in seconds."""
    return {"step_time_s": statistics.median(samples), "step_time_min_s": min(samples), "step_time_max_s": max(samples)}


def is_oom_message(message: str) -> bool:
    oom = ("out of memory", "resource_exhausted", "can't allocate memory", "cannot allocate memory")
    return any(s in message.lower() for s in oom)


def one_line(err: BaseException, limit: int = 10_000) -> str:
    """An exception in one line: its message's lines joined, cut at ``limit`` characters."""
    text = "; ".join(line.strip() for line in str(err).splitlines() if line.strip()).replace(":;", ":")
    line = f"{type(err).__name__}: {text}".strip()
    return line if len(line) <= limit else line[: limit - 5] + " ..."


def git_sha() -> str | None:
    run = {"cwd": REPO_ROOT, "capture_output": True, "text": True, "timeout": 10}
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], check=True, **run)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **run)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def cpu_snapshot() -> tuple[float, float | None, float]:
    """(wall clock, the machine's busy CPU seconds, this process's and its children's): see `other_cpu_share`."""
    own = sum(os.times()[:4])  # user and system seconds, of this process and of its children
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        busy: float | None = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait
    except (OSError, ValueError, IndexError):
        busy = None
    return time.perf_counter(), busy, own


def other_cpu_share(start: tuple[float, float | None, float], end: tuple[float, float | None, float]) -> float | None:
    """Fraction of all cores' time used by processes other than this run between two snapshots."""
    if start[1] is None or end[1] is None or end[0] <= start[0]:
        return None
    others = (end[1] - start[1]) - (end[2] - start[2])
    return max(0.0, others / ((end[0] - start[0]) * (os.cpu_count() or 1)))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def worker_env(job: Job) -> dict[str, str]:
    """Environment for a worker process: set before the framework is imported."""
    # Rank variables from an outer launcher would silence a worker (only rank 0 reports); torchrun
    # sets its own for --world-size.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env["PYTHONUNBUFFERED"] = "1"
    if job.framework == "jax":
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # allocator peak = what the step needs
        flags = [f for f in env.get("XLA_FLAGS", "").split() if f != XLA_CPU_FLAG]
        if job.xla_cpu_flag and job.device != "gpu":
            flags.append(XLA_CPU_FLAG)
        if job.world_size > 1:  # the ranks: forced host devices (CPU only, refused with --device gpu)
            flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count=")]
            flags.append(f"--xla_force_host_platform_device_count={job.world_size}")
        env["XLA_FLAGS"] = " ".join(flags)
        if job.device in ("cpu", "gpu"):
            env["JAX_PLATFORMS"] = {"cpu": "cpu", "gpu": "cuda"}[job.device]
    return env
