"""The benchmark's parent side: its framework workers' rows (`shared_configs.planning.workers`).

Each framework runs in its own worker. A worker that dies mid-row (the kernel's OOM killer, a
segfault) costs only that row: it is reported as ``oom`` (killed) or ``error`` and a fresh worker
carries on with the rows left. Workers are stopped with the parent (`shared_configs.planning.workers.worker_group`).
"""

from __future__ import annotations

import signal
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from benchmarks.harness.job import Job, worker_env
from shared_configs.cli import BenchmarkError
from shared_configs.planning import workers

Event = dict[str, Any]
KILLED = (-signal.SIGKILL, 128 + signal.SIGKILL)
BACKEND = "benchmarks.backends.worker"  # what answers the rows in the worker


def run_job(job: Job, on_event: Callable[[Event], None], verbose: bool = False) -> None:
    """Run ``job``, each of its events to ``on_event``: one ``env`` and one ``row`` per (policy, batch size)."""
    done: list[tuple[str, int]] = []
    while True:
        todo = replace(job, done=tuple(done))
        if not todo.rows():
            return
        started, finished, rc, stderr_tail = _run_worker(todo, on_event, verbose)
        done += finished
        if started is not None:  # the worker died inside a row: report it, go on
            killed = rc in KILLED
            on_event(
                {
                    "event": "row",
                    "framework": job.framework,
                    "policy": started[0],
                    "batch_size": started[1],
                    "status": "oom" if killed else "error",
                    "error": "worker killed (SIGKILL), most likely by the out-of-memory killer"
                    if killed
                    else f"worker died (exit {rc}): {stderr_tail or 'no output'}",
                }
            )
            done.append(started)
        elif rc != 0:
            raise BenchmarkError(f"{job.framework} worker failed (exit {rc}): {stderr_tail or 'no output'}")
        elif not finished:
            raise BenchmarkError(f"{job.framework} worker exited without measuring anything")


def static_floor(job: Job) -> dict[str, int]:
    """`benchmarks.backends.torch_bench.static_floor`, from a short worker."""
    done = workers.run({"kind": "floor", "backend": BACKEND, "job": asdict(job)}, worker_env(job))
    floor = next((e for e in done.events if e["event"] == "floor"), None)
    if floor is None:
        raise BenchmarkError(f"could not build the model to size it: {done.stderr_tail or 'no output'}")
    return {k: v for k, v in floor.items() if k != "event"}


def _run_worker(
    job: Job, on_event: Callable[[Event], None], verbose: bool
) -> tuple[tuple[str, int] | None, list[tuple[str, int]], int, str]:
    """One worker process; returns (row it died in, rows it finished, exit code, stderr tail)."""
    # torch's ranks are processes (torchrun); jax's, devices of one
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(job.world_size)]
    launcher = launcher if job.framework != "jax" and job.world_size > 1 else None
    since, started, finished = time.time(), [None], []

    def seen(event: Event) -> None:
        if event["event"] == "fatal":
            raise BenchmarkError(event["message"])
        key = event.get("policy"), event.get("batch_size")
        if event["event"] == "start":
            started[0] = key
        elif event["event"] == "row":
            finished.append(key)
            started[0] = None
        on_event(event)

    request = {"kind": "rows", "backend": BACKEND, "job": asdict(job)}
    try:
        echo = sys.stderr.write if verbose else (lambda line: None)
        done = workers.run(request, worker_env(job), seen, launcher, echo)
    except BaseException:  # stopped: it may have been writing a compilation cache entry
        check_jax_cache(job, since)
        raise
    if done.returncode in KILLED:
        check_jax_cache(job, since)
    return started[0], finished, done.returncode, done.stderr_tail


def check_jax_cache(job: Job, since: float) -> None:
    """Remove the damaged entries a killed JAX worker may have left in its compilation cache: JAX writes
    an entry in place and never replaces one, so a truncated entry would fail every later run's read.
    The entries written since ``since`` are decompressed (zlib, JAX's format without zstandard)."""
    if job.framework != "jax" or job.jax_cache is None:
        return
    for path in Path(job.jax_cache).glob("*-cache"):
        try:
            if path.stat().st_mtime < since or (data := path.read_bytes())[:1] != b"\x78":  # zlib's first byte
                continue
            zlib.decompress(data)
        except zlib.error:
            path.unlink(missing_ok=True)
            print(f"note: removed {path}: a compilation cache entry cut short by a stopped worker", file=sys.stderr)
        except OSError:
            continue
