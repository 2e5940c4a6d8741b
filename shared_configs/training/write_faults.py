"""Why a checkpoint write failed, agreed by every rank and said in one line: `together` runs a save's phase on
every rank and gathers each rank's `Fault`, so one rank's failure fails the save everywhere instead of hanging
the others; `fault_of` finds the OS error inside torch DCP's and orbax's errors. No torch or jax import.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class Comm(Protocol):
    """The collectives a checkpoint needs: torch's process group, or `run_folder.SOLO` for one process."""

    rank: int
    world: int

    def barrier(self) -> None: ...

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


def describe(
    fault: Fault, step: int, tmp: Path, kept: int | None, last: int | None, nbytes: int | None, free: int, removed: str
) -> str:
    """The line: step, rank, path and error; on a full disk the bytes needed and ``free``; what is kept and removed."""
    where = f"rank {fault.rank}: " if fault.rank else ""
    line = f"writing the checkpoint of step {step}: {where}{fault.filename or tmp}: {fault.text}"
    if fault.errno == errno.ENOSPC:
        need = f"the last checkpoint took {last:,} bytes" if last else nbytes and f"the state holds {nbytes:,} bytes"
        line += f" ({', '.join([*([need] if need else []), f'{free:,} bytes are free there'])})"
    return f"{line}; {f'the checkpoint of step {kept} is kept' if kept else 'no earlier checkpoint'}; {removed}"
