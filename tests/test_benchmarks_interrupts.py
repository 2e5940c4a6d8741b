"""Benchmark runs stopped by SIGINT or SIGTERM: no worker left behind, one line saying what was
kept (the rows measured so far, in a JSON marked incomplete, or nothing), exit 128 + the signal's
number, and no half-written file. Real signals to this process or to a real `benchmarks.compare`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from benchmarks.harness.job import KILL_SIM_ENV, REPO_ROOT, Job
from benchmarks.harness.runner import check_jax_cache
from shared_configs.cli import cli_errors, stopping
from shared_configs.planning.workers import worker_group


def alive(pid: int, wait_s: float = 5.0) -> bool:
    """Whether ``pid`` still runs ``wait_s`` after it was killed (a zombie, dead but not yet reaped,
    does not run; a loaded machine takes a moment to end a process)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            running = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
        except OSError:
            running = False
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.05)


def test_a_worker_group_is_stopped_with_its_children_when_the_parent_is_interrupted(tmp_path: Path) -> None:
    """A worker that started its own child (torchrun and its ranks): both are gone afterwards."""
    pids = tmp_path / "pids"
    script = f"sleep 300 & echo $$ $! > {pids}; wait"
    with pytest.raises(KeyboardInterrupt), worker_group(["sh", "-c", script]):
        while not pids.exists() or len(pids.read_text().split()) < 2:
            time.sleep(0.01)
        raise KeyboardInterrupt
    assert not any(alive(int(pid)) for pid in pids.read_text().split())


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupt_is_one_line_saying_what_was_kept_and_a_second_one_waits(sig: int, capsys) -> None:
    cleaned, before = [], signal.getsignal(signal.SIGINT)  # a test process's own (an xdist worker may ignore it)
    with pytest.raises(SystemExit) as exit_, cli_errors("benchmarks.plan"), stopping("nothing written"):
        try:
            os.kill(os.getpid(), sig)
            time.sleep(5)  # the handler raises before this ends
        except KeyboardInterrupt:
            os.kill(os.getpid(), signal.SIGTERM)  # while stopping the workers: noted by no one, ignored
            cleaned.append(True)
            raise
    assert exit_.value.code == 128 + sig and cleaned == [True]
    name = signal.Signals(sig).name
    assert capsys.readouterr().err == f"python -m benchmarks.plan: interrupted by {name}; nothing written\n"
    assert signal.getsignal(signal.SIGINT) is before  # given back


def test_a_truncated_jax_cache_entry_a_killed_worker_wrote_is_removed(tmp_path: Path, capsys) -> None:
    entry = zlib.compress(os.urandom(5000))
    (tmp_path / "jit_old-cache").write_bytes(entry[:100])  # older than the worker: not its doing
    os.utime(tmp_path / "jit_old-cache", (0, 0))
    (tmp_path / "jit_cut-cache").write_bytes(entry[:100])
    (tmp_path / "jit_whole-cache").write_bytes(entry)
    job = Job("jax", "tiny", None, ("none",), (1,), 1, "fp32", "cpu", 77, jax_cache=str(tmp_path))
    check_jax_cache(job, since=time.time() - 60)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jit_old-cache", "jit_whole-cache"]
    assert capsys.readouterr().err == (
        f"note: removed {tmp_path / 'jit_cut-cache'}: a compilation cache entry cut short by a stopped worker\n"
    )


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.mark.slow
def test_compare_stopped_by_sigterm_keeps_its_rows_and_no_worker(tmp_path: Path) -> None:
    """The first worker is killed at row 2 (as the OOM killer would), so a second one starting means
    rows 1 and 2 are in: SIGTERM to the parent then, while the second measures row 3."""
    args = ["--framework", "torch", "--config", "tiny", "--policies", "none,full,layers", "--batch-size", "1"]
    cmd = [sys.executable, "-m", "benchmarks.compare", *args, "--steps", "1", "--out", str(tmp_path)]
    env = {**os.environ, KILL_SIM_ENV: "torch:full:1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workers: list[int] = []
        while len(workers) < 2 and proc.poll() is None:
            workers += [pid for pid in children(proc.pid) if pid not in workers]
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    (path,) = tmp_path.glob("compare-tiny-*.json")
    assert proc.returncode == 143 and err.strip().splitlines()[-1] == (
        f"python -m benchmarks.compare: interrupted by SIGTERM; every worker stopped; the 2 row(s) measured are in "
        f"{path} (incomplete)"
    ), err
    assert not any(alive(pid) for pid in workers)
    doc = json.loads(path.read_text())
    assert doc["incomplete"] == "interrupted by SIGTERM after 2 of 3 rows"
    assert [(r["policy"], r["status"]) for r in doc["rows"]] == [("none", "ok"), ("full", "oom")]
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file, no CSV or plot
