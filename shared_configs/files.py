"""Writing files so that a kill at any moment leaves the old file or the new one, never half of one.

`atomic_write` is the project's one way to write an output file. Its temp files are named
``.<name>.<random>.tmp`` next to the target: `TEMP_GLOB` finds the ones a killed writer left.
`locked` makes processes that fill the same cache entry take turns. Framework-free (no torch or
jax import).
"""

from __future__ import annotations

import fcntl
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

TEMP_SUFFIX = ".tmp"
TEMP_GLOB = f".*{TEMP_SUFFIX}"  # what atomic_write and the checkpoint writers leave when killed


def atomic_write(path: str | Path, data: bytes) -> None:
    """Write ``data`` to a temp file next to ``path``, then `os.replace` it: never half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would make every output private
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def locked(path: str | Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<path>.lock`` for the block (waiting, with a note, while another
    process holds it): processes filling the same cache entry take turns, so the later ones can
    read what the first wrote instead of computing it again. The kernel releases the lock when its
    holder dies; the empty lock file stays (removing it would race with a process opening it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(f"{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"note: waiting for another process filling {path}", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
