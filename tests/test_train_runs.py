"""Run folders that never lose work: ownership, the lock, temp cleanup, integrity-checked checkpoints,
the resume record, the NaN guard and the early checks, in both training CLIs.

Each fault is one line on stderr naming what is wrong, exit 2 (bad input) or 1 (a failed run, a
checkpoint write that failed: disk full, permission lost, an I/O error), and leaves the checkpoint
on disk byte for byte as it was, with no temp file. Checkpoints are written without training
(`save_checkpoint` on a fresh state): the checks under test run before any step, so the JAX cases
never compile a step.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from torch.distributed.checkpoint.filesystem import FileSystem

from jax_impl import checkpoint_io as jio
from jax_impl.unet import UNet as FlaxUNet
from shared_configs import load_spec
from shared_configs.training.config import TrainConfig
from shared_configs.training.loop import manifest_for
from shared_configs.training.manifest import MANIFEST, CheckpointWriteError, Manifest
from shared_configs.training.run_folder import LOCK, checkpoints, owned
from tests.helpers.specs import TINY
from tests.helpers.training import LOSSES, MAINS, RUN, assert_one_line, cli, jax_setup, saved_run, snapshot, train_argv
from torch_impl import train as ttrain


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {fw: saved_run(fw, tmp_path_factory.mktemp(fw)).parent for fw in MAINS}


@pytest.fixture(params=list(MAINS))
def run(request: pytest.FixtureRequest, saved: dict[str, Path], tmp_path: Path) -> tuple[str, Path]:
    """(framework, a fresh copy of its saved run folder)."""
    out = tmp_path / "run"
    shutil.copytree(saved[request.param], out)
    return request.param, out


def test_a_fresh_run_does_not_replace_a_checkpoint(run: tuple[str, Path], capsys) -> None:
    framework, out = run
    before = snapshot(out)
    code, err = cli(framework, train_argv(replace(RUN, out=str(out))), capsys)
    assert_one_line(code, err, 2, "holds a checkpoint (checkpoint-00000002)", "--resume", "--overwrite")
    assert snapshot(out) == before


def test_overwrite_starts_afresh_and_replaces_it_at_its_first_checkpoint(saved: dict[str, Path], tmp_path) -> None:
    out = tmp_path / "run"
    shutil.copytree(saved["torch"], out)
    losses = ttrain.train(replace(RUN, steps=1, out=str(out), overwrite=True))
    assert [step for step, _ in checkpoints(out)] == [1]
    assert json.loads((out / "losses.json").read_text()) == losses and len(losses) == 1


@pytest.mark.parametrize("framework", list(MAINS))
def test_a_second_run_on_a_folder_refuses_naming_the_holder(framework: str, tmp_path: Path, capsys) -> None:
    with owned(tmp_path):  # this process holds the lock, as a running run would
        code, err = cli(framework, train_argv(replace(RUN, out=str(tmp_path))), capsys)
    assert_one_line(code, err, 2, "in use by another run", f"pid {os.getpid()} on {socket.gethostname()}")
    assert not checkpoints(tmp_path)


def test_a_stale_lock_and_temp_files_of_killed_writes_are_cleared(saved: dict[str, Path], tmp_path, capsys) -> None:
    out = tmp_path / "run"
    shutil.copytree(saved["torch"], out)
    # A run killed mid-write: its lock names it (nobody holds the flock), its temps remain.
    (out / LOCK).write_text(json.dumps({"pid": 999999999, "host": socket.gethostname(), "since": "then"}))
    (out / ".checkpoint-00000003.tmp" / "state").mkdir(parents=True)
    (out / ".checkpoint-00000003.tmp" / "state" / "__0_0.distcp").write_bytes(b"x" * 1000)
    (out / ".losses.json.k2j3.tmp").write_bytes(b"[1.0,")
    (out / ".checkpoint.pt.abc123").write_bytes(b"half")  # an older writer's temp name
    assert ttrain.train(replace(RUN, steps=3, out=str(out), resume=True))[:2] == LOSSES
    err = capsys.readouterr().err
    assert "took over the lock of a run that died (pid 999999999" in err
    assert "removed 3 temp file(s) of killed writes" in err
    assert sorted(p.name for p in out.iterdir()) == [LOCK, "checkpoint-00000003", "loss.png", "losses.json"]
    assert (out / LOCK).read_text() == ""  # released: nobody's name in it


def _biggest_state_file(out: Path) -> Path:
    return max((checkpoints(out)[-1][1] / "state").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else -1)


def _damage(fault: str, out: Path) -> Path:
    """Apply ``fault`` to the checkpoint in ``out``; returns the file the message must name."""
    folder, target = checkpoints(out)[-1][1], _biggest_state_file(out)
    data = target.read_bytes()
    if fault == "corrupted":  # 64 bytes overwritten in the middle
        middle = len(data) // 2
        target.write_bytes(data[:middle] + bytes(64) + data[middle + 64 :])
    elif fault == "truncated":
        target.write_bytes(data[: len(data) // 2])
    elif fault == "empty":
        target.write_bytes(b"")
    elif fault == "garbage":
        target.write_bytes(os.urandom(len(data)))
    elif fault == "missing":
        target.unlink()
    elif fault == "foreign_file":
        target = folder / "state" / "stray.bin"
        target.write_bytes(b"not ours")
    elif fault == "manifest_edited":  # valid JSON, a loss changed: the manifest's own digest catches it
        target = folder / MANIFEST
        target.write_text(target.read_text().replace("0.5", "0.25", 1))
    elif fault == "manifest_garbage":
        target = folder / MANIFEST
        target.write_bytes(os.urandom(300))
    elif fault == "incomplete":  # no manifest: never committed
        target = folder / MANIFEST
        target.unlink()
    return target


FAULTS = {
    "corrupted": "corrupted",
    "truncated": "truncated",
    "empty": "truncated (0 bytes",
    "garbage": "corrupted",
    "missing": "missing",
    "foreign_file": "not in the manifest",
    "manifest_edited": "damaged",
    "manifest_garbage": "not a checkpoint manifest",
    "incomplete": "is not a complete checkpoint",
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_damaged_checkpoint_is_one_line_naming_the_file(run: tuple[str, Path], fault: str, capsys) -> None:
    framework, out = run
    target = _damage(fault, out)
    before = snapshot(out)
    code, err = cli(framework, train_argv(replace(RUN, out=str(out)), "--resume"), capsys)
    assert_one_line(code, err, 2, str(target), FAULTS[fault])
    assert snapshot(out) == before  # nothing written, nothing removed


def test_a_checkpoint_of_the_other_framework_is_refused(saved: dict[str, Path], tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    shutil.copytree(saved["jax"], out)
    code, err = cli("torch", train_argv(replace(RUN, out=str(out)), "--resume"), capsys)
    assert_one_line(code, err, 2, "written by jax_impl (orbax)", "torch_impl.train reads torch.distributed.checkpoint")


@pytest.mark.parametrize("framework, legacy", [("torch", "checkpoint.pt"), ("jax", "checkpoint.msgpack")])
def test_a_single_file_checkpoint_of_an_earlier_version_is_refused(framework, legacy, tmp_path, capsys) -> None:
    (tmp_path / legacy).write_bytes(b"an old checkpoint")
    code, err = cli(framework, train_argv(replace(RUN, out=str(tmp_path)), "--resume"), capsys)
    assert_one_line(code, err, 2, f"{tmp_path / legacy}: a single-file checkpoint", "--overwrite")
    code, err = cli(framework, train_argv(replace(RUN, out=str(tmp_path))), capsys)
    assert_one_line(code, err, 2, f"holds a checkpoint ({legacy})")


def test_resume_refuses_a_changed_curve_listing_the_values(run: tuple[str, Path], capsys) -> None:
    framework, out = run
    changed = replace(RUN, out=str(out), batch_size=8, lr=0.01, seed=3)
    code, err = cli(framework, [*train_argv(changed, "--resume"), "--schedule", "cosine"], capsys)
    diffs = (
        "--batch-size 8 (run: 4)",
        "--lr 0.01 (run: 0.001)",
        "--seed 3 (run: 0)",
        "--schedule cosine (run: linear)",
    )
    assert_one_line(code, err, 2, "--resume: the command line differs", *diffs)


def test_resume_refuses_steps_already_done(run: tuple[str, Path], capsys) -> None:
    framework, out = run
    code, err = cli(framework, train_argv(replace(RUN, out=str(out), steps=2), "--resume"), capsys)
    assert_one_line(code, err, 2, "--steps 2: the run in", "is already at step 2")


@pytest.mark.parametrize("framework", list(MAINS))
def test_an_output_folder_that_cannot_be_made_is_refused_first(framework: str, tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("")
    code, err = cli(framework, train_argv(replace(RUN, out=str(tmp_path / "file" / "run"))), capsys)
    assert_one_line(code, err, 2, "--out", "cannot write to")


@pytest.mark.parametrize("framework", list(MAINS))
def test_the_objective_refuses_out_channels_unlike_in_channels(framework: str, tmp_path: Path, capsys) -> None:
    config = tmp_path / "in1_out4.yaml"
    config.write_text(yaml.safe_dump({**TINY, "name": "in1_out4", "in_channels": 1, "out_channels": 4}))
    code, err = cli(framework, [*train_argv(replace(RUN, out=str(tmp_path / "run"))), "--config", str(config)], capsys)
    assert_one_line(code, err, 2, "out_channels", "needs out_channels == in_channels")
    assert not (tmp_path / "run").exists()  # refused before the run folder was made


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path: Path, capsys) -> None:
    # lr 1e30: step 1 blows the weights up
    code, err = cli("torch", train_argv(replace(RUN, out=str(tmp_path), lr=1e30)), capsys)
    assert_one_line(code, err, 1, "step 2 of 4: the loss is nan", f"checkpoint of step 1 in {tmp_path}")
    assert [step for step, _ in checkpoints(tmp_path)] == [1]
    assert not (tmp_path / "losses.json").exists()


class _FillingFile:
    """A file that raises ``OSError(code)`` once the files written through ``count`` hold ``limit`` bytes."""

    def __init__(self, file: Any, code: int, limit: int, count: list[int]) -> None:
        self.file, self.code, self.limit, self.count = file, code, limit, count

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if self.count[0] + size > self.limit:
            raise OSError(self.code, os.strerror(self.code))  # a write error names no file, as the kernel's
        self.count[0] += size
        return self.file.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)


def failing_streams(code: int, limit: int) -> Any:
    """A stand-in for DCP's `FileSystem.create_stream`: opening a file to write fails (``limit`` 0,
    naming the file) or writing fails once ``limit`` bytes are written, with ``OSError(code)``."""

    @contextmanager
    def create_stream(self: Any, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        if limit == 0 and "w" in mode:
            raise OSError(code, os.strerror(code), str(path))
        with Path(path).open(mode) as file:
            yield _FillingFile(file, code, limit, count) if "w" in mode else file

    count = [0]
    return create_stream


# (errno, bytes written before it, what the line says): tiny's checkpoint is ~4.8 MB
WRITE_FAULTS = {
    "disk full": (errno.ENOSPC, 100_000, "No space left on device (the last checkpoint took"),
    "permission lost": (errno.EACCES, 0, "/state/__0_0.distcp: Permission denied"),
    "I/O error": (errno.EIO, 2_000_000, "Input/output error"),
}


@pytest.mark.parametrize("fault", list(WRITE_FAULTS))
def test_a_failed_checkpoint_write_is_one_line_and_leaves_the_last_checkpoint(
    fault, saved, tmp_path, monkeypatch, capsys
) -> None:
    out = tmp_path / "run"
    shutil.copytree(saved["torch"], out)
    before = snapshot(out)
    code, limit, says = WRITE_FAULTS[fault]
    monkeypatch.setattr(FileSystem, "create_stream", failing_streams(code, limit))
    status, err = cli("torch", train_argv(replace(RUN, out=str(out), steps=3), "--resume"), capsys)
    where = f"writing the checkpoint of step 3: {out / '.checkpoint-00000003.tmp'}"
    assert_one_line(status, err, 1, where, says, "the checkpoint of step 2 is kept; the partial write was removed")
    assert snapshot(out) == before  # step 2 as it was, no temp file left


def test_a_full_disk_is_refused_before_writing(saved, tmp_path, monkeypatch) -> None:
    """With less room than the last checkpoint took, nothing is written (orbax failing half-way
    would log its threads' tracebacks)."""
    out = tmp_path / "run"
    shutil.copytree(saved["jax"], out)
    before, size = snapshot(out), sum(len(data) for name, data in snapshot(out).items() if "/state/" in name)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(CheckpointWriteError) as raised:
        jio.save_checkpoint(out, jax_setup(load_spec("tiny"), "none")[2], jax_manifest(out, 3))
    tmp = out / ".checkpoint-00000003.tmp"
    assert str(raised.value) == (
        f"writing the checkpoint of step 3: {tmp}: No space left on device (the last checkpoint took {size:,} bytes, "
        "1,000 bytes are free there); the checkpoint of step 2 is kept; nothing partial was left"
    )
    assert snapshot(out) == before


def test_an_orbax_write_failing_half_way_leaves_the_last_checkpoint(saved, tmp_path) -> None:
    """A real write error from the kernel inside orbax's writers (tensorstore, C++): files may not
    grow past 50 kB (RLIMIT_FSIZE, with SIGXFSZ ignored: the write fails with EFBIG)."""
    out = tmp_path / "run"
    shutil.copytree(saved["jax"], out)
    before, state = snapshot(out), jax_setup(load_spec("tiny"), "none")[2]
    limit, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, limit[1]))
    try:
        with pytest.raises(CheckpointWriteError) as raised:
            jio.save_checkpoint(out, state, jax_manifest(out, 3))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)
    line = str(raised.value)
    assert line.startswith(f"writing the checkpoint of step 3: {out / '.checkpoint-00000003.tmp'}/"), line
    assert "File too large; the checkpoint of step 2 is kept; the partial write was removed" in line, line
    assert snapshot(out) == before


def jax_manifest(out: Path, step: int) -> Manifest:
    cfg = replace(RUN, out=str(out))
    return manifest_for(cfg, load_spec(cfg.config), jio.FRAMEWORK, jio.LAYOUT, [1.0] * step)


def test_the_specs_checkpoint_field_is_the_default_policy(tmp_path: Path) -> None:
    config = tmp_path / "tiny_full.yaml"
    config.write_text(yaml.safe_dump({**TINY, "checkpoint": "full"}))
    cfg = TrainConfig(config=str(config))
    assert cfg.policy is None
    assert ttrain.build(cfg)[0].plan.policy == "full"
    assert FlaxUNet(spec=load_spec(str(config)), policy=cfg.policy).plan.policy == "full"
    assert ttrain.build(replace(cfg, policy="none"))[0].plan.policy == "none"  # --policy wins
