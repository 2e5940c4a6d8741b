"""A run folder (``--out``): owned by one run at a time (an advisory ``flock`` on ``OUT/.lock``), its checkpoints
written whole or not at all (into ``OUT/.checkpoint-<step>.tmp/``, the manifest last, then renamed into place).
A failed write is agreed by every rank and said in one line: `together` runs a save's phase on every rank and
gathers each rank's `Fault`, so one rank's failure fails the save everywhere instead of hanging the others;
`fault_of` finds the OS error inside torch DCP's and orbax's errors. Layout and guarantees: docs/training.md.
No torch or jax import.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from shared_configs.cli import check_out_dir
from shared_configs.files import TEMP_GLOB, TEMP_SUFFIX
from shared_configs.spec import UNetSpec
from shared_configs.training.config import TrainConfig, resume_differences
from shared_configs.training.manifest import (
    MANIFEST,
    CheckpointError,
    CheckpointWriteError,
    Manifest,
    check_files,
    files_of,
    hash_files,
    read_manifest,
    write_manifest,
)

LOCK = ".lock"
PREFIX = "checkpoint-"
STATE = "state"  # the framework's files, inside a checkpoint folder
LEGACY = ("checkpoint.pt", "checkpoint.msgpack")  # single files, before manifests: refused
_OLD_OUTPUTS = (*LEGACY, "losses.json", "loss.png", "samples.png")  # older writers' temps: .<name>.<random>


class Comm(Protocol):
    """The collectives a checkpoint needs: torch's process group, or `run_folder.SOLO` for one process."""

    rank: int
    world: int

    def gather(self, obj: Any) -> list[Any]: ...  # every rank gets every rank's obj, in rank order

    def max(self, value: int) -> int: ...  # the largest of every rank's value (cheap: once per step)


@dataclass(frozen=True)
class Fault:
    """A failed write as every rank sees it (picklable): the rank, the OS error's number and path."""

    rank: int
    text: str
    errno: int | None = None
    filename: str | None = None


class Failed(Exception):
    """Some rank's phase of a save failed: its `Fault`."""

    def __init__(self, fault: Fault) -> None:
        self.fault = fault


def together(comm: Comm, fn: Callable[[], Any]) -> Any:
    """``fn()`` on every rank, then agree (the gather is the barrier): any rank's failure raises `Failed` on all."""
    try:
        result, fault = fn(), None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:  # torch DCP's CheckpointException is a BaseException
        result, fault = None, fault_of(err, comm.rank)
    if faults := [f for f in comm.gather(fault) if f is not None]:
        raise Failed(faults[0])
    return result


_OS_CODE = re.compile(r"os_error_code='(\d+)'")  # tensorstore's (orbax's) way of carrying errno
_LOCAL_FILE = re.compile(r'local file "([^"]+)"')


def fault_of(err: BaseException, rank: int) -> Fault:
    """The OS error inside ``err`` (its causes, DCP's per-rank failures, a tensorstore message)."""
    seen: list[BaseException] = []
    todo = [err]
    while todo and len(seen) < 20:
        e = todo.pop(0)
        seen.append(e)
        if isinstance(e, OSError) and e.errno is not None:
            return Fault(rank, e.strerror or str(e), e.errno, e.filename and str(e.filename))
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [c for c in (e.__cause__, e.__context__) if c is not None and c not in seen]
    text = " ".join(str(err).split()) or type(err).__name__
    if code := _OS_CODE.search(text):
        found = _LOCAL_FILE.search(text)
        return Fault(rank, os.strerror(int(code[1])), int(code[1]), found and found[1])
    return Fault(rank, f"{type(err).__name__}: {text[:300]}")


class RunFolderError(ValueError):
    """A run folder this run may not use as asked: one line saying why and what to do."""


@dataclass(frozen=True)
class Solo:
    """One process: a gather returns this process's object."""

    rank: int = 0
    world: int = 1

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def max(self, value: int) -> int:
        return value


SOLO = Solo()


@contextmanager
def owned(out: Path, owner: bool = True) -> Iterator[None]:
    """Check ``out`` is (or can be made) a writable folder; the ``owner`` also holds its lock and removes old temps."""
    check_out_dir(out)
    if not owner:
        yield
        return
    fd = _lock(out)
    try:
        _remove_temps(out)
        yield
    finally:
        with suppress(OSError):  # the folder became read-only: its lock keeps our name
            os.ftruncate(fd, 0)  # an empty lock file: nobody holds it (a killed holder leaves its name)
        os.close(fd)  # releases the flock


def _lock(out: Path) -> int:
    try:
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise RunFolderError(f"--out {out}: not writable ({err.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(os.read(fd, 4096))
        os.close(fd)
        raise RunFolderError(
            f"--out {out}: in use by another run ({holder}); let it finish or pick another --out"
        ) from None
    if stale := os.read(fd, 4096):
        print(f"note: {out}: took over the lock of a run that died ({_holder(stale)})", file=sys.stderr)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    return fd


def _holder(text: bytes) -> str:
    try:
        who = json.loads(text)
        return f"pid {who['pid']} on {who['host']}, since {who['since']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


def _remove_temps(out: Path) -> None:
    stale = set(out.glob(TEMP_GLOB)) | {p for name in _OLD_OUTPUTS for p in out.glob(f".{name}.*")}
    for path in sorted(stale):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    if stale:
        names = ", ".join(p.name for p in sorted(stale))
        print(f"note: {out}: removed {len(stale)} temp file(s) of killed writes: {names}", file=sys.stderr)


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def checkpoints(out: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every committed checkpoint in ``out``, oldest first."""
    return sorted((int(n), p) for p in out.glob(PREFIX + "*") if (n := p.name.removeprefix(PREFIX)).isdigit())


def find_start(out: Path, resume: bool, overwrite: bool) -> Path | None:
    """The checkpoint to resume from (``--resume``), or None for a fresh run (over a checkpoint: ``overwrite``)."""
    latest = found[-1][1] if (found := checkpoints(out)) else None
    legacy = next((out / name for name in LEGACY if (out / name).is_file()), None)
    if resume:
        if latest is not None:
            return latest
        if legacy is not None:
            raise RunFolderError(
                f"{legacy}: a single-file checkpoint of an earlier version, without integrity record: "
                "it cannot be resumed; --overwrite starts a new run there"
            )
        raise FileNotFoundError(f"--resume: no checkpoint in {out}")
    if (latest or legacy) is not None and not overwrite:
        raise RunFolderError(
            f"--out {out} holds a checkpoint ({(latest or legacy).name}): --resume continues it, "
            "--overwrite starts a new run there"
        )
    return None


def read_checkpoint(path: Path, framework: str, layout: str) -> Manifest:
    """The manifest of the checkpoint folder ``path``, refusing one another framework wrote."""
    manifest = read_manifest(path)
    if (manifest.framework, manifest.layout) != (framework, layout):
        raise CheckpointError(
            f"{path / MANIFEST}: written by {manifest.framework} ({manifest.layout}); {framework}.train reads {layout}"
        )
    return manifest


def check_resume(path: Path, manifest: Manifest, cfg: TrainConfig, spec: UNetSpec) -> None:
    """Refuse a ``--resume`` whose command line changes the run's curve or does not add steps."""
    if diffs := resume_differences(manifest.run, cfg, spec):
        raise RunFolderError(f"--resume: the command line differs from the run in {path}: {'; '.join(diffs)}")
    if cfg.steps <= manifest.step:
        raise RunFolderError(
            f"--steps {cfg.steps}: the run in {path.parent} is already at step {manifest.step}; "
            "give a larger --steps to continue it"
        )


def verify(path: Path, manifest: Manifest, comm: Comm = SOLO) -> None:
    """Check every file of the checkpoint against its manifest (each rank a share of them)."""
    listed = sorted(manifest.files)
    problems = [f"{path / name}: not in the manifest" for name in sorted(set(files_of(path)) - set(listed))]
    problems += [p for part in comm.gather(check_files(path, manifest, listed[comm.rank :: comm.world])) for p in part]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"{problems[0]}{more}; nothing was changed")


def save(
    out: Path, manifest: Manifest, write_state: Callable[[Path], None], comm: Comm = SOLO, nbytes: int | None = None
) -> Path:
    """Write the checkpoint of ``manifest.step`` (each rank its ``write_state`` files and hash share) and return its
    folder; a failure on any rank keeps the previous one and raises the same `CheckpointWriteError` on every rank."""
    tmp = out / f".{checkpoint_name(manifest.step)}{TEMP_SUFFIX}"
    try:
        together(comm, lambda: _fresh(out, tmp) if comm.rank == 0 else None)
        together(comm, lambda: write_state(tmp / STATE))
        names = files_of(tmp)
        parts = comm.gather(together(comm, lambda: hash_files(tmp, names[comm.rank :: comm.world])))
        files = {k: v for part in parts for k, v in part.items()}
        together(comm, lambda: _commit(out, tmp, replace(manifest, files=files)) if comm.rank == 0 else None)
    except Failed as failed:
        message = _failure_line(out, tmp, manifest.step, failed.fault, nbytes) if comm.rank == 0 else failed.fault.text
        raise CheckpointWriteError(message) from None
    return out / checkpoint_name(manifest.step)


def _fresh(out: Path, tmp: Path) -> None:
    """An empty ``tmp``, if there is room for a checkpoint the size of the last one (refused before writing)."""
    shutil.rmtree(tmp, ignore_errors=True)
    need = _last_size(out)
    if need and shutil.disk_usage(out).free < need:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))
    tmp.mkdir(parents=True)


def _failure_line(out: Path, tmp: Path, step: int, fault: Fault, nbytes: int | None) -> str:
    """One line: step, rank, path and error; on a full disk the bytes a checkpoint needs and those free; what is
    kept and what removed."""
    removed = _remove_partial(tmp)
    earlier = checkpoints(out)
    where = f"rank {fault.rank}: " if fault.rank else ""
    line = f"writing the checkpoint of step {step}: {where}{fault.filename or tmp}: {fault.text}"
    if fault.errno == errno.ENOSPC:
        last = _last_size(out)
        need = f"the last checkpoint took {last:,} bytes" if last else nbytes and f"the state holds {nbytes:,} bytes"
        line += f" ({', '.join([*([need] if need else []), f'{shutil.disk_usage(out).free:,} bytes are free there'])})"
    kept = earlier[-1][0] if earlier else None
    return f"{line}; {f'the checkpoint of step {kept} is kept' if kept else 'no earlier checkpoint'}; {removed}"


def _remove_partial(tmp: Path) -> str:
    if not tmp.exists():
        return "nothing partial was left"
    try:
        shutil.rmtree(tmp)
    except OSError as err:
        return f"could not remove the partial {tmp} ({err.strerror}): the next run on the folder will"
    return "the partial write was removed"


def _last_size(out: Path) -> int | None:
    """The bytes of the newest committed checkpoint in ``out``, from its manifest (None: none, or unreadable)."""
    try:
        return sum(f["bytes"] for f in read_manifest(checkpoints(out)[-1][1]).files.values())
    except (IndexError, CheckpointError, OSError, KeyError, TypeError):
        return None


def _commit(out: Path, tmp: Path, manifest: Manifest) -> None:
    """Write the manifest into ``tmp``, rename it into place, then remove the other checkpoints (later ones first)."""
    write_manifest(tmp, manifest)
    for later_step, path in checkpoints(out):
        if later_step >= manifest.step:
            shutil.rmtree(path)
    for name in LEGACY:
        (out / name).unlink(missing_ok=True)
    final = out / checkpoint_name(manifest.step)
    os.rename(tmp, final)
    _fsync_dir(out)
    for _, path in checkpoints(out):
        if path != final:
            shutil.rmtree(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
