"""Writing files so that a kill at any moment leaves the old file or the new one, never half of one.

`atomic_write` is the project's one way to write an output file. Its temp files are named
``.<name>.<random>.tmp`` next to the target: `TEMP_GLOB` finds the ones a killed writer left.
Framework-free (no torch or jax import).
"""

from __future__ import annotations

import os
import tempfile
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
