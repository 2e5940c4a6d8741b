"""Runs stopped the way machines stop them: SIGTERM, SIGINT or SIGUSR1 mid-run.

The step in flight finishes, the checkpoint of that step and ``losses.json`` are written, one line
names the step and the exact ``--resume`` command, the exit status is 128 + the signal's number,
and the resumed run continues the uninterrupted curve exactly. A second signal during the save
does not cut it short. The loop's tests send real signals to this process from inside a step or a
save (no framework involved); the CLI tests at the end send them from outside, to real runs.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp

from shared_configs.training.config import TrainConfig
from shared_configs.training.loop import run_loop
from shared_configs.training.manifest import CheckpointWriteError, Manifest, read_manifest
from shared_configs.training.preemption import STOP_SIGNALS, Stopped, resume_command
from shared_configs.training.run_folder import SOLO, Fault, Solo, checkpoints, save, verify
from tests.helpers.processes import finish, signal_at_first_checkpoint, start
from tests.helpers.training import CFG, train_argv
from torch_impl import train as ttrain


def loop(
    out: Path,
    signal_at: dict[int, int],
    in_save: tuple[int, ...] = (),
    comm: Any = None,
    steps: int = 6,
    every: int = 100,
) -> tuple[list[float], list[int], Stopped | None]:
    """`run_loop` over a counter: ``signal_at[step]`` is sent to this process during that step,
    ``in_save`` during every save. Returns (losses, the step count at each save, what it raised)."""
    cfg, losses, saves = TrainConfig(steps=steps, checkpoint_every=every, out=str(out)), [], []

    def step_fn(state: int, step: int) -> tuple[int, float]:
        if step in signal_at:
            os.kill(os.getpid(), signal_at[step])
        return state + 1, 1.0 / (step + 1)

    def save_fn(state: int, losses: list[float]) -> None:
        for sig in in_save:
            os.kill(os.getpid(), sig)
        saves.append(state)

    try:
        run_loop(cfg, 0, losses, step_fn, save_fn, "test", comm or SOLO)
    except Stopped as stop:
        return losses, saves, stop
    return losses, saves, None


@pytest.mark.parametrize("sig", STOP_SIGNALS, ids=[s.name for s in STOP_SIGNALS])
def test_a_signal_stops_the_loop_after_the_step_in_flight(sig: signal.Signals, tmp_path: Path) -> None:
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    losses, saves, stop = loop(tmp_path, {2: sig})
    assert stop is not None and (stop.signum, stop.step) == (sig, 3)
    assert str(stop) == f"stopped by {sig.name} after step 3 of 6"
    assert losses == [1.0, 0.5, 1 / 3] and saves == [3]  # step 3 finished, then saved once
    assert json.loads((tmp_path / "losses.json").read_text()) == losses
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before  # the handlers are given back


def test_a_signal_at_a_checkpoint_boundary_saves_once_and_one_in_the_last_step_finishes(tmp_path: Path) -> None:
    losses, saves, stop = loop(tmp_path, {2: signal.SIGTERM}, every=3)
    assert stop is not None and stop.step == 3 and saves == [3]
    losses, saves, stop = loop(tmp_path, {5: signal.SIGTERM}, every=3)
    assert stop is None and saves == [3, 6] and len(losses) == 6  # nothing left to resume: the run ends


def test_a_second_signal_during_the_save_is_noted_and_the_save_finishes(tmp_path: Path, capfd) -> None:
    _, saves, stop = loop(tmp_path, {1: signal.SIGUSR1}, in_save=(signal.SIGTERM, signal.SIGINT))
    assert stop is not None and (stop.signum, stop.step, saves) == (signal.SIGUSR1, 2, [2])  # the first one counts
    notes = capfd.readouterr().err.strip().splitlines()
    assert [n.split(":")[1] for n in notes] == [" SIGTERM again", " SIGINT again"], notes
    assert all("SIGKILL stops now" in n for n in notes)


class OtherRankSignalled(Solo):
    """Rank 1 of 2, never signalled itself; the max over ranks says rank 0 got SIGTERM at step 2."""

    def __init__(self) -> None:
        super().__init__(rank=1, world=2)
        object.__setattr__(self, "calls", [])

    def max(self, value: int) -> int:
        self.calls.append(value)  # type: ignore[attr-defined]
        return signal.SIGTERM if len(self.calls) == 2 else value  # type: ignore[attr-defined]


def test_every_rank_stops_after_the_step_any_rank_was_signalled_in(tmp_path: Path) -> None:
    comm = OtherRankSignalled()
    _, saves, stop = loop(tmp_path, {}, comm=comm)
    assert stop is not None and (stop.signum, stop.step, saves) == (signal.SIGTERM, 2, [2])
    assert comm.calls == [0, 0]  # asked once per step, with no signal of its own
    assert not (tmp_path / "losses.json").exists()  # rank 0 writes it


def test_the_resume_command_is_the_command_line_with_resume() -> None:
    args = ["--steps", "9", "--overwrite", "--out", "my runs/a"]
    assert resume_command("torch_impl.train", args, env={}) == (
        "python -m torch_impl.train --steps 9 --out 'my runs/a' --resume"
    )
    torchrun = {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}
    assert resume_command("torch_impl.train", [*args, "--resume"], env=torchrun) == (
        "torchrun --nproc-per-node 2 -m torch_impl.train --steps 9 --out 'my runs/a' --resume"
    )


class Rank1Fails(Solo):
    """Rank 0 of 2 whose partner fails writing its shards (the second phase of a save)."""

    def __init__(self) -> None:
        super().__init__(rank=0, world=2)
        object.__setattr__(self, "phase", [0])

    def gather(self, obj: Any) -> list[Any]:
        self.phase[0] += 1  # type: ignore[attr-defined]
        failed = self.phase[0] == 2  # type: ignore[attr-defined]
        return [obj, Fault(1, "No space left on device", errno.ENOSPC, "/shards/__1_0.distcp") if failed else None]


def test_a_rank_that_fails_to_write_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    manifest = Manifest("test", "test", 1, [1.0], {})
    with pytest.raises(CheckpointWriteError) as raised:
        save(tmp_path, manifest, lambda folder: (folder.mkdir(), (folder / "x").write_bytes(b"1")), Rank1Fails(), 1000)
    assert str(raised.value).startswith(
        "writing the checkpoint of step 1: rank 1: /shards/__1_0.distcp: No space left on device (the state holds "
        "1,000 bytes, "
    )
    assert str(raised.value).endswith("bytes are free there); no earlier checkpoint; the partial write was removed")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_torch_stops_on_a_signal_and_resumes_on_the_uninterrupted_curve(tmp_path: Path, monkeypatch, capfd) -> None:
    """In this process: SIGUSR1 during step 3 of 5; SIGTERM as the stop's checkpoint is written."""
    cfg = replace(CFG, steps=5, checkpoint_every=100)
    whole = ttrain.train(replace(cfg, out=str(tmp_path / "whole")))
    capfd.readouterr()
    out, steps, real_step, real_save = tmp_path / "run", [], ttrain.train_step, dcp.save

    def step(*args: Any, **kwargs: Any) -> float:
        steps.append(None)
        if len(steps) == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
        return real_step(*args, **kwargs)

    def dcp_save(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        return real_save(*args, **kwargs)

    monkeypatch.setattr(ttrain, "train_step", step)
    monkeypatch.setattr(dcp, "save", dcp_save)  # looked up by checkpoint_io at each save
    args = train_argv(replace(cfg, out=str(out)))
    assert ttrain.main(args) == 128 + signal.SIGUSR1
    note, line = capfd.readouterr().err.strip().splitlines()
    assert note.startswith("note: SIGTERM again: still finishing the step and its checkpoint")
    assert line == (
        f"python -m torch_impl.train: stopped by SIGUSR1 after step 3 of 5; checkpoint-00000003 and losses.json "
        f"saved in {out}; resume with: python -m torch_impl.train {shlex.join(args)} --resume"
    )
    (step3,) = [path for step_, path in checkpoints(out) if step_ == 3]
    verify(step3, read_manifest(step3))  # whole, despite the second signal
    assert json.loads((out / "losses.json").read_text()) == whole[:3]
    monkeypatch.undo()
    assert ttrain.main([*args, "--resume"]) == 0
    assert json.loads((out / "losses.json").read_text()) == whole


# ---- real runs, signalled from outside ---------------------------------------------------------


@pytest.mark.slow
def test_torch_cli_stopped_by_sigterm_resumes_on_the_uninterrupted_curve(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = replace(CFG, steps=10_000, checkpoint_every=2, out=str(out))
    proc = start([sys.executable, "-m", "torch_impl.train", *train_argv(cfg)])
    signal_at_first_checkpoint(proc, out, signal.SIGTERM)
    code, lines = finish(proc)
    assert code == 143 and len(lines) == 1, lines
    stopped = len(json.loads((out / "losses.json").read_text()))
    assert lines[0].startswith(f"python -m torch_impl.train: stopped by SIGTERM after step {stopped} of 10000; ")
    assert [s for s, _ in checkpoints(out)] == [stopped]
    resumed = ttrain.train(replace(cfg, steps=stopped + 2, resume=True))
    assert resumed == ttrain.train(replace(cfg, steps=stopped + 2, out=str(tmp_path / "whole")))
