"""Run framework workers as subprocesses and collect their rows (the parent side).

Each framework runs in its own process (two runtimes in one process skew each other). A worker
that dies mid-row (the kernel's OOM killer, a segfault) costs only that row: it is reported as
``oom`` (killed) or ``error`` and a fresh worker carries on with the rows left. Workers run in
their own process group, stopped with the parent (`shared_configs.processes.worker_group`).
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from subprocess import PIPE
from typing import Any

from benchmarks.harness.job import EVENT_PREFIX, REPO_ROOT, Job, worker_env
from shared_configs.cli import BenchmarkError
from shared_configs.processes import worker_group

Event = dict[str, Any]
KILLED = (-signal.SIGKILL, 128 + signal.SIGKILL)


def run_job(job: Job, on_event: Callable[[Event], None] = lambda e: None, verbose: bool = False) -> list[Event]:
    """All events of ``job``: one ``env`` and one ``row`` per (policy, batch size)."""
    events: list[Event] = []
    done: list[tuple[str, int]] = []
    while True:
        todo = replace(job, done=tuple(done))
        if not todo.rows():
            return events
        started, finished, rc, stderr_tail = _run_worker(todo, events, on_event, verbose)
        done += finished
        if started is not None:  # the worker died inside a row: report it, go on
            row = _crash_row(job, started, rc, stderr_tail)
            events.append(row)
            on_event(row)
            done.append(started)
        elif rc != 0:
            raise BenchmarkError(f"{job.framework} worker failed (exit {rc}): {stderr_tail or 'no output'}")
        elif not finished:
            raise BenchmarkError(f"{job.framework} worker exited without measuring anything")


def static_floor(job: Job) -> dict[str, int]:
    """The least memory any step of ``job``'s model can need (see `benchmarks.backends.torch_bench.static_floor`),
    from a short worker that builds the model on the meta device."""
    cmd = [sys.executable, "-m", "benchmarks.backends.worker", "--floor", job.to_json()]
    with worker_group(cmd, cwd=REPO_ROOT, env=worker_env(job), stdout=PIPE, stderr=PIPE, text=True) as proc:
        out, err = proc.communicate()
    for line in out.splitlines():
        if line.startswith(EVENT_PREFIX):
            return json.loads(line[len(EVENT_PREFIX) :])
    tail = [ln for ln in err.splitlines() if ln.strip()]
    raise BenchmarkError(f"could not build the model to size it: {tail[-1] if tail else 'no output'}")


def _run_worker(
    job: Job, events: list[Event], on_event: Callable[[Event], None], verbose: bool
) -> tuple[tuple[str, int] | None, list[tuple[str, int]], int, str]:
    """One worker process; returns (row it died in, rows it finished, exit code, stderr tail)."""
    cmd = [sys.executable, "-m", "benchmarks.backends.worker", job.to_json()]
    if job.framework != "jax" and job.world_size > 1:  # torch's ranks are processes; jax's, devices of one
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(job.world_size)]
    since = time.time()
    with tempfile.TemporaryFile("w+") as err:
        try:
            with worker_group(cmd, cwd=REPO_ROOT, env=worker_env(job), stdout=PIPE, stderr=None if verbose else err,
                              text=True) as proc:  # fmt: skip
                started, finished = _read_events(proc.stdout, events, on_event)
        except BaseException:  # stopped: it may have been writing a compilation cache entry
            check_jax_cache(job, since)
            raise
        if proc.returncode in KILLED:
            check_jax_cache(job, since)
        err.seek(0)
        lines = [ln.strip() for ln in err.read().splitlines() if ln.strip()]
    return started, finished, proc.returncode, lines[-1] if lines else ""


def _read_events(
    stdout: Any, events: list[Event], on_event: Callable[[Event], None]
) -> tuple[tuple[str, int] | None, list[tuple[str, int]]]:
    """A worker's event lines until it exits: (the row it started last and did not finish, rows finished)."""
    started: tuple[str, int] | None = None
    finished: list[tuple[str, int]] = []
    for line in stdout:
        if not line.startswith(EVENT_PREFIX):
            continue
        event = json.loads(line[len(EVENT_PREFIX) :])
        kind = event["event"]
        if kind == "fatal":
            raise BenchmarkError(event["message"])
        if kind == "start":
            started = (event["policy"], event["batch_size"])
        elif kind == "row":
            finished.append((event["policy"], event["batch_size"]))
            started = None
        events.append(event)
        on_event(event)
    return started, finished


def check_jax_cache(job: Job, since: float) -> None:
    """Remove the damaged entries a killed JAX worker may have left in its compilation cache.

    JAX writes an entry in place (not to a temp file renamed into place) and never replaces an
    entry that exists: a worker killed mid-write leaves a truncated one that every later run fails
    to read (JAX warns and compiles again, each time). The entries written since ``since`` are
    decompressed (zlib, JAX's format without zstandard); damaged ones are removed, one note each.
    """
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


def _crash_row(job: Job, key: tuple[str, int], rc: int, stderr_tail: str) -> Event:
    policy, batch_size = key
    if rc in KILLED:
        status, error = "oom", "worker killed (SIGKILL), most likely by the out-of-memory killer"
    else:
        status, error = "error", f"worker died (exit {rc}): {stderr_tail or 'no output'}"
    return {
        "event": "row",
        "framework": job.framework,
        "policy": policy,
        "batch_size": batch_size,
        "status": status,
        "error": error,
    }
