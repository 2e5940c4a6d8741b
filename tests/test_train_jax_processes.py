"""JAX over two processes (`jax.distributed`, gloo), one CPU device each, ``--distributed fsdp``:
the curve of one process with two devices, an orbax checkpoint both write, checkpoints moving
between one process with two devices and two processes, the stop step agreed on, and a killed
process reported instead of waited for.

One module-scoped set of runs (the tiny spec, batch 4, compiled with backend optimisation off):

1. one process with two forced devices trains 2 steps (its checkpoint: what the pair resumes,
   and no pair has to compile the initialisation);
2. two processes resume it; SIGTERM to process 1 once they have checkpointed a step: both stop
   after the same step (exit 143), process 0 alone prints and writes ``losses.json``;
3. one process with two devices: the uninterrupted curve, and the pair's checkpoint resumed;
4. two processes resume the pair's checkpoint; once they have checkpointed a step, process 1 is
   SIGKILLed and process 0 must exit non-zero, saying so, within a bounded time.

The one-process runs share a persistent compilation cache, and so do the pairs: each program is
compiled once per layout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest

from jax_impl import train as jtrain
from jax_impl.processes import HEARTBEAT_S
from shared_configs.training.config import TrainConfig
from shared_configs.training.manifest import CheckpointError, read_manifest
from shared_configs.training.run_folder import checkpoints
from tests.helpers.processes import FSDP_RUN as RUN
from tests.helpers.processes import finish, jax_on_two_devices, start
from tests.helpers.specs import fast_xla_flags
from tests.helpers.training import train_argv

STEPS = 8  # the uninterrupted curve: the pair is killed after its first checkpoint (step 3, or a few more)
PROGRAM = [sys.executable, "-m", "jax_impl.train"]
KILL_BOUND_S = HEARTBEAT_S + 30  # the slowest way out: JAX's own heartbeat timeout, then its abort


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_device_env() -> dict[str, str]:
    """One CPU device per process, XLA's backend optimisation off (`FAST_COMPILE`)."""
    return {**os.environ, "XLA_FLAGS": fast_xla_flags()}


def start_pair(cfg: TrainConfig, cache: Path, *extra: str) -> list[subprocess.Popen[str]]:
    """The training CLI as processes 0 and 1 of a two-process run on this machine."""
    port = free_port()
    procs = []
    for i in range(2):
        own = jtrain.JaxOptions(jax_cache=str(cache), coordinator=f"127.0.0.1:{port}", num_processes=2, process_id=i)
        procs.append(start([*PROGRAM, *train_argv(replace(cfg, options=own)), *extra], one_device_env()))
    return procs


def wait_for_checkpoint(procs: list[subprocess.Popen[str]], out: Path, after: int = 0) -> int:
    """The step of the first checkpoint in ``out`` beyond step ``after`` (polled: the run goes on)."""
    deadline = time.monotonic() + 300
    while not (found := [s for s, _ in checkpoints(out) if s > after]):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            for p in procs:
                os.killpg(p.pid, signal.SIGKILL)
            raise AssertionError(f"no checkpoint in {out}: {[p.communicate()[1][-1500:] for p in procs]}")
        time.sleep(0.02)
    return found[0]


def latest_losses(out: Path) -> list[float]:
    """The losses in the manifest of the latest checkpoint in ``out`` (a later one may replace it meanwhile)."""
    for _ in range(100):
        try:
            return list(read_manifest(checkpoints(out)[-1][1]).losses)
        except (CheckpointError, FileNotFoundError):
            time.sleep(0.01)
    raise AssertionError(f"no stable checkpoint in {out}")


FRESH = """
import json, sys
from pathlib import Path
import jax
from jax_impl import train as jtrain
from tests.helpers.processes import one_process
root, steps = Path(sys.argv[1]), int(sys.argv[2])
whole = jtrain.train(one_process(str(root / "whole"), steps))  # uninterrupted
jtrain.train(one_process(str(root / "pair"), 2))  # where the pair starts (compiled already)
print(json.dumps({"devices": len(jax.devices()), "losses": whole}))
"""

RESUMED = """
import json, sys
from dataclasses import replace
import jax
from jax_impl import train as jtrain
from tests.helpers.processes import one_process
losses = jtrain.train(replace(one_process(sys.argv[1], int(sys.argv[2])), resume=True))
print(json.dumps({"devices": len(jax.devices()), "losses": losses}))
"""


@dataclass
class Runs:
    stopped: int  # the last step the pair checkpointed before process 1 was killed
    state_files: list[str]  # the top of that checkpoint's state/ folder
    pair_losses: list[float]  # steps 0-1 by one process, 2 .. stopped - 1 by two
    whole: list[float]  # one process with two devices, uninterrupted
    resumed: list[float]  # the pair's checkpoint, resumed in one process
    kill_code: int
    kill_lines: list[str]
    kill_s: float  # from SIGKILL to process 0's exit
    wall_s: float


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root, began = tmp_path_factory.mktemp("processes"), time.monotonic()
    whole = jax_on_two_devices(FRESH, str(root), str(STEPS))["losses"]
    pair = start_pair(replace(RUN, out=str(root / "pair")), root / "jax-cache-pair", "--resume")
    wait_for_checkpoint(pair, root / "pair", after=2)  # the pair trains: its first checkpoint is there
    os.kill(pair[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    kill_code, kill_lines = finish(pair[0], timeout=KILL_BOUND_S)
    kill_s = time.monotonic() - killed
    finish(pair[1])
    pair_losses = latest_losses(root / "pair")
    state = sorted(p.name for p in (checkpoints(root / "pair")[-1][1] / "state").iterdir())
    resumed = jax_on_two_devices(RESUMED, str(root / "pair"), str(STEPS))["losses"]
    return Runs(
        len(pair_losses), state, pair_losses, whole, resumed, kill_code, kill_lines, kill_s, time.monotonic() - began
    )


@pytest.mark.slow
def test_the_checkpoint_holds_both_processes_shards(runs: Runs) -> None:
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(runs.state_files), runs.state_files


@pytest.mark.slow
def test_two_processes_train_the_curve_of_one_process_with_two_devices(runs: Runs) -> None:
    """The pair resumed one process's checkpoint of step 2 and trained on: one process's curve."""
    assert 2 < runs.stopped < STEPS, runs.pair_losses
    np.testing.assert_allclose(runs.pair_losses, runs.whole[: runs.stopped], rtol=1e-5, atol=0)
    print(f"pair: {runs.stopped} steps, max |loss - one process's| {_max_diff(runs.pair_losses, runs.whole)}")


@pytest.mark.slow
def test_the_pairs_checkpoint_resumes_in_one_process_on_the_uninterrupted_curve(runs: Runs) -> None:
    assert runs.resumed[: runs.stopped] == runs.pair_losses
    np.testing.assert_allclose(runs.resumed, runs.whole, rtol=1e-5, atol=0)
    print(f"resumed: {len(runs.resumed)} steps, max |loss - uninterrupted| {_max_diff(runs.resumed, runs.whole)}")


def _max_diff(losses: list[float], reference: list[float]) -> float:
    return float(np.max(np.abs(np.array(losses) - np.array(reference[: len(losses)]))))


@pytest.mark.slow
def test_a_killed_process_is_reported_not_waited_for(runs: Runs) -> None:
    """Process 1 SIGKILLed mid-run: process 0 exits non-zero within the bound, with one line when a
    collective noticed (the usual case), or JAX's own fatal error when it waited at orbax's barrier."""
    ours = [line for line in runs.kill_lines if "another process of the run is gone" in line]
    jax_own = [line for line in runs.kill_lines if "another task died" in line]
    assert runs.kill_code != 0 and (ours or jax_own), runs.kill_lines
    if ours:
        assert runs.kill_code == 1 and ours[0].startswith("python -m jax_impl.train: error: "), runs.kill_lines
    assert runs.kill_s < KILL_BOUND_S
    joined = "jax.distributed: 2 processes via --coordinator 127.0.0.1:"
    assert any(line.startswith(joined) for line in runs.kill_lines), runs.kill_lines
    print(f"kill: exit {runs.kill_code} after {runs.kill_s:.1f} s; the runs took {runs.wall_s:.0f} s")


AGREED_STOP = """
import json, os, signal, sys
from jax_impl import processes
processes.join(f"127.0.0.1:{sys.argv[1]}", 2, int(sys.argv[2]))
from shared_configs.training.config import TrainConfig
from shared_configs.training.loop import run_loop
from shared_configs.training.preemption import Stopped
comm, saves = processes.current_comm(), []

def step(state, index):
    if index == 2 and comm.rank == 1:  # a signal to process 1 only, in step 3
        os.kill(os.getpid(), signal.SIGTERM)
    return state, float(comm.max(index))  # a collective in every step, as training has

try:
    run_loop(TrainConfig(steps=50, checkpoint_every=100, out=sys.argv[3]), 0, [], step,
             lambda state, losses: saves.append(len(losses)), "stop", comm)
except Stopped as stop:
    print(json.dumps({"rank": comm.rank, "step": stop.step, "saves": saves}), file=sys.stderr, flush=True)
    processes.leave(128 + stop.signum)
"""


@pytest.mark.slow
def test_a_signal_to_one_process_stops_both_after_the_same_step(tmp_path: Path) -> None:
    """The preemption rule over processes (`ProcessComm.max` after every step): SIGTERM to process 1
    alone; both save after the same step and exit 143, process 0 writing ``losses.json``."""
    port = free_port()
    procs = [start([sys.executable, "-c", AGREED_STOP, str(port), str(i), str(tmp_path)]) for i in range(2)]
    done = [finish(p, timeout=120) for p in procs]
    assert [code for code, _ in done] == [143, 143], done
    for rank, (_, lines) in enumerate(done):
        said = [json.loads(line) for line in lines if line.startswith("{")]
        assert said == [{"rank": rank, "step": 3, "saves": [3]}], lines
    assert json.loads((tmp_path / "losses.json").read_text()) == [0.0, 1.0, 2.0]


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        ("--coordinator 10.0.0.1", "argument --coordinator: expected HOST:PORT (a port in 1..65535), got '10.0.0.1'"),
        ("--coordinator h:1 --num-processes 2", "--process-id: needed with --coordinator, --num-processes (give all"),
        ("--coordinator h:1 --num-processes 2 --process-id 2 --distributed", "--process-id 2: expected 0 .. 1"),
        ("--coordinator h:1 --num-processes 2 --process-id 1", "--distributed: needed over 2 processes (ddp or fsdp)"),
    ],
)
def test_launch_flags_are_refused_in_one_line(flags: str, error: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        jtrain.parse_args(flags.split())
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"python -m jax_impl.train: error: {error}"), err
