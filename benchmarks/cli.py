"""What the benchmark CLIs share: one-line argument errors, argument types, the output-folder check
and the exit codes (2 for bad input, 1 for a framework that cannot be measured, 130 on Ctrl-C).
Framework-free."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shared_configs import SpecError, cli


class BenchmarkError(RuntimeError):
    """A whole framework could not be measured (one line, shown to the user)."""


positive = cli.positive(int)  # an argparse type: an integer >= 1
positive_mib = cli.positive(float, " of MiB")  # an argparse type: a finite number of MiB above zero


def check_out_dir(path: Path, flag: str = "--out") -> None:
    """Refuse (SpecError) an output folder that cannot be created or written, before any work."""
    if path.exists() and not path.is_dir():
        raise SpecError(f"{flag}: {path} exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as err:
        raise SpecError(f"{flag}: cannot write to {path} ({err.strerror or err})") from None


def cache_dir(text: str) -> str | None:
    """An argparse type: a folder path, or ``none`` for no cache."""
    return None if text.lower() in ("none", "off", "") else os.path.abspath(os.path.expanduser(text))


@contextmanager
def cli_errors(prog: str) -> Iterator[None]:
    """Bad input (SpecError) exits 2, a framework that cannot be measured 1, Ctrl-C 130, each with
    one line on stderr and no traceback, headed like argparse's own errors (``python -m
    benchmarks.PROG: error: ...``) so that every message of a command starts the same way."""
    prog = f"python -m benchmarks.{prog}"
    try:
        yield
    except (SpecError, BenchmarkError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2 if isinstance(err, SpecError) else 1) from None
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
