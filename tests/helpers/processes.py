"""Tests that start processes: `benchmarks.compare`, torchrun, JAX on two forced CPU devices, and training
runs started, signalled and finished from outside (each in a process group of its own)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from shared_configs.training.config import TrainConfig
from shared_configs.training.run_folder import checkpoints
from tests.helpers.specs import fast_xla_flags
from tests.helpers.training import CFG, train_argv

ROOT = Path(__file__).parents[2]
FSDP_RUN = replace(CFG, steps=1000, checkpoint_every=1, distributed="fsdp")  # JAX's runs over two processes


def run_compare(args: list[str], out: Path, **env: str) -> tuple[subprocess.CompletedProcess, dict[str, Any] | None]:
    """``python -m benchmarks.compare ARGS --out OUT`` (XLA's fast compile, `FAST_COMPILE`: buffer
    assignment comes before code generation, so memory figures do not change; torch on one thread,
    as tests/conftest.py sets in-process; no JAX compilation cache); the process and the JSON document it wrote."""
    environ = {**os.environ, "XLA_FLAGS": fast_xla_flags(), "OMP_NUM_THREADS": "1", **env}
    cmd = [sys.executable, "-m", "benchmarks.compare", *args, "--out", str(out), "--jax-cache", "none"]
    proc = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=600)
    files = sorted(out.glob("*.json"))
    return proc, json.loads(files[-1].read_text()) if files else None


def rows_of(doc: dict[str, Any], framework: str) -> dict[str, dict[str, Any]]:
    """A compare document's rows of one framework, by policy."""
    return {r["policy"]: r for r in doc["rows"] if r["framework"] == framework}


def torchrun_train(cfg: TrainConfig, nproc: int = 2, timeout: float = 300) -> list[float]:
    """``torchrun -m torch_impl.train`` on ``nproc`` CPU processes, one thread each; the losses it wrote.

    The launcher leads its own process group (`start_new_session`), killed whole on timeout: no rank outlives the test.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        "torch_impl.train",
        *train_argv(cfg),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as proc:
        try:
            _, err = proc.communicate(timeout=timeout)
        except BaseException:  # the timeout, or the test run interrupted
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0, err[-2000:]
    return json.loads((Path(cfg.out) / "losses.json").read_text())


def two_devices_env() -> dict[str, str]:
    """This environment with 2 forced CPU devices and XLA's fast compile (`FAST_COMPILE`)."""
    return {**os.environ, "XLA_FLAGS": fast_xla_flags("--xla_force_host_platform_device_count=2")}


def jax_on_two_devices(script: str, *args: str) -> dict:
    """``python -c script *args`` on 2 forced CPU devices, compiled with backend optimisation off
    (`FAST_COMPILE`: values unchanged, ~4x faster); its last stdout line, parsed as JSON."""
    cmd = [sys.executable, "-c", script, *args]
    out = subprocess.run(cmd, env=two_devices_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == 2
    return result


def start(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A training run in a process group of its own (killed as a group if the test fails)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def signal_at_first_checkpoint(proc: subprocess.Popen[str], out: Path, sig: int, rank: int | None = None) -> None:
    """Send ``sig`` to ``proc`` (or to its child of torchrun rank ``rank``) once ``out`` holds a
    checkpoint or one being written: the loop runs (so the stop is after step 1, or 2 if missed)."""
    deadline = time.monotonic() + 300
    while not (checkpoints(out) or list(out.glob(".checkpoint-*.tmp"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"no checkpoint in {out}: {proc.communicate()[1][-2000:]}")
        time.sleep(0.02)
    os.kill(proc.pid if rank is None else rank_pid(proc.pid, rank), sig)


def rank_pid(launcher: int, rank: int) -> int:
    """The pid of torchrun's worker of ``rank`` (its environment says RANK)."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    environ = {int(c): Path(f"/proc/{c}/environ").read_bytes().split(b"\0") for c in children}
    (pid,) = [c for c, env in environ.items() if f"RANK={rank}".encode() in env]
    return pid


def finish(proc: subprocess.Popen[str], timeout: float = 300) -> tuple[int, list[str]]:
    """(exit status, the non-blank lines of stderr) of a run `start` started."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, [line for line in err.splitlines() if line.strip()]


def one_process(out: str, steps: int) -> TrainConfig:
    """`FSDP_RUN` in one process (the persistent compilation cache next to ``out``: the second compiles nothing);
    the scripts `jax_on_two_devices` runs import it."""
    from jax_impl import train as jtrain

    cache = str(Path(out).parent / "jax-cache-one")
    return replace(FSDP_RUN, steps=steps, checkpoint_every=100, out=out, options=jtrain.JaxOptions(jax_cache=cache))
