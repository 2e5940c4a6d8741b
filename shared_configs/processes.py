"""Worker processes that never outlive their parent: each in a process group of its own, stopped
as a group (a worker, or torchrun and its ranks) when the parent leaves by an exception (an
interrupt, an error). Framework-free."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any


@contextmanager
def worker_group(cmd: list[str], **popen: Any) -> Iterator[subprocess.Popen]:
    """``Popen(cmd, **popen)`` in a process group of its own, stopped whole if the block is left by an exception."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    try:
        yield proc
    except BaseException:
        stop_group(proc)
        raise
    finally:
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        proc.wait()


STOP_GRACE_S = 5.0


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s process group; SIGKILL to what is left once ``proc`` exits or `STOP_GRACE_S` pass."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(STOP_GRACE_S)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
