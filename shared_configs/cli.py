"""What every CLI shares: a parser whose errors are one line, number types, the output-folder check
and the exit codes.

Bad input is one line on stderr, ``<prog>: error: <flag>: <what is wrong>``, and exit status 2; a
framework that cannot be measured 1; Ctrl-C 130. No usage block, no traceback. Framework-free (no
torch or jax import), so every CLI can import it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from shared_configs.spec import SpecError

Number = int | float


class BenchmarkError(RuntimeError):
    """A whole framework could not be measured or profiled (one line, shown to the user)."""


class OneLineParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose errors are one line, ``<prog>: error: <message>`` (argparse's
    own format without the usage block), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _number(kind: type, lowest: Number, inclusive: bool, unit: str) -> Callable[[str], Number]:
    what = f"a {'non-negative' if inclusive else 'positive'} {'integer' if kind is int else 'number'}{unit}"

    def parse(text: str) -> Number:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(value) or value < lowest or (value == lowest and not inclusive):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


def positive(kind: type, unit: str = "") -> Callable[[str], Number]:
    """An argparse ``type``: ``kind`` (int or float), finite and > 0 (``nan``, ``inf`` refused);
    ``unit`` (e.g. ``" of MiB"``) ends the error's description."""
    return _number(kind, 0, inclusive=False, unit=unit)


def nonnegative(kind: type, unit: str = "") -> Callable[[str], Number]:
    """An argparse ``type``: ``kind`` (int or float), finite and >= 0."""
    return _number(kind, 0, inclusive=True, unit=unit)


positive_int = positive(int)  # an integer >= 1
positive_float = positive(float)  # a finite number > 0
positive_mib = positive(float, " of MiB")  # a finite number of MiB above zero


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
def cli_errors(module: str) -> Iterator[None]:
    """Bad input (SpecError) exits 2, a framework that cannot be measured 1, Ctrl-C 130, each with
    one line on stderr and no traceback, headed like argparse's own errors (``python -m
    MODULE: error: ...``) so that every message of a command starts the same way."""
    prog = f"python -m {module}"
    try:
        yield
    except (SpecError, BenchmarkError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2 if isinstance(err, SpecError) else 1) from None
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
