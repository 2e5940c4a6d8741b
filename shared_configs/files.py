"""Writing files so that a kill at any moment leaves the old file or the new one, never half of one: `atomic_write`
(temp files ``.<name>.<random>.tmp``, `TEMP_GLOB`), `write_sealed` (JSON with its own SHA-256), `write_png` (a
matplotlib figure), and `locked`, for processes filling the same cache entry in turn. Framework-free.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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


def write_png(fig: Any, path: str | Path, **options: Any) -> None:
    """A matplotlib figure as a PNG at ``path``, atomically (``options``: ``savefig``'s), then closed."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", **options)
    plt.close(fig)
    atomic_write(path, buf.getvalue())


def json_digest(body: Mapping[str, Any]) -> str:
    """The SHA-256 of a JSON body (keys sorted), as `write_sealed` records it."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=False).encode()).hexdigest()


def write_sealed(path: str | Path, body: Mapping[str, Any]) -> None:
    """``body`` as JSON with its own `json_digest` under ``sha256``, atomically: a damaged file is caught."""
    atomic_write(path, json.dumps({**body, "sha256": json_digest(body)}, indent=1, allow_nan=False).encode())


@contextmanager
def locked(path: str | Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<path>.lock`` for the block: processes filling one cache entry take turns."""
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
