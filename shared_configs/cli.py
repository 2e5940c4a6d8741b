"""What every CLI shares: a parser whose errors are one line, number types, the output-folder check
and the exit codes; the library's progress on stderr (`shared_configs.progress`).

Bad input is one line on stderr, ``<prog>: error: <flag>: <what is wrong>``, and exit status 2; a
framework that cannot be measured 1; SIGINT or SIGTERM 128 + the signal's number (130, 143), with
a line saying what the run kept. No usage block, no traceback. Framework-free (no
torch or jax import), so every CLI can import it.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from types import FrameType
from typing import NoReturn

from shared_configs.loader import preset_names
from shared_configs.progress import cli_logging
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


def number_list(
    kind: type, what: str, ok: Callable[[Number], bool] = lambda v: 0 < v < math.inf, skip_blank: bool = False
) -> Callable[[str], list[Number]]:
    """An argparse ``type``: ``kind`` values separated by commas, each ``ok`` (by default finite and > 0),
    else the error "expected ``what`` separated by commas"; ``skip_blank``: empty items are left out."""

    def parse(text: str) -> list[Number]:
        try:
            values = [kind(v) for v in text.split(",") if v.strip() or not skip_blank]
        except ValueError:
            values = []
        if not values or not all(ok(v) for v in values):
            raise argparse.ArgumentTypeError(f"expected {what} separated by commas, got {text!r}")
        return values

    return parse


positive_int = positive(int)  # an integer >= 1
positive_float = positive(float)  # a finite number > 0
positive_mib = positive(float, " of MiB")  # a finite number of MiB above zero


def config_help(default: str | None = None) -> str:
    """``--config``'s help: the presets by name (and the default, if any)."""
    return f"a preset ({', '.join(preset_names())}) or a spec YAML path" + (f" (default: {default})" if default else "")


def check_out_dir(path: Path, flag: str = "--out") -> None:
    """Refuse (SpecError) an output folder that cannot be created or written, before any work."""
    if path.exists() and not path.is_dir():
        raise SpecError(f"{flag}: {path} exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-").close()  # made and removed
    except OSError as err:
        raise SpecError(f"{flag}: cannot write to {path} ({err.strerror or err})") from None


def cache_dir(text: str) -> str | None:
    """An argparse type: a folder path, or ``none`` for no cache."""
    return None if text.lower() in ("none", "off", "") else os.path.abspath(os.path.expanduser(text))


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM stopped a run: ``kept`` says, in a few words, what it leaves behind."""

    def __init__(self, signum: int, kept: str = "nothing written") -> None:
        super().__init__(signum, kept)
        self.signum, self.kept = signum, kept


@contextmanager
def cli_errors(module: str) -> Iterator[None]:
    """Bad input (SpecError) exits 2, a framework that cannot be measured 1, SIGINT or SIGTERM
    128 + its number, each with one line on stderr and no traceback, headed like argparse's own
    errors (``python -m MODULE: error: ...``) so that every message of a command starts the same way.

    SIGINT and SIGTERM raise `Interrupted` (a KeyboardInterrupt) once: the workers are stopped on
    the way out (`shared_configs.planning.workers.worker_group`), and a second signal does not cut that short.
    """
    prog = f"python -m {module}"
    try:  # the library's progress on stderr: a live line on a terminal, plain lines in a log
        with cli_logging(), _interrupts():
            yield
    except (SpecError, BenchmarkError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2 if isinstance(err, SpecError) else 1) from None
    except KeyboardInterrupt as err:
        signum, kept = (err.signum, err.kept) if isinstance(err, Interrupted) else (signal.SIGINT, "nothing written")
        print(f"{prog}: interrupted by {signal.Signals(signum).name}; {kept}", file=sys.stderr)
        raise SystemExit(128 + signum) from None


@contextmanager
def stopping(kept: str) -> Iterator[None]:
    """Inside `cli_errors`: an interrupt of the block says ``kept`` (what it leaves behind)."""
    try:
        yield
    except KeyboardInterrupt as stop:
        raise Interrupted(stop.signum if isinstance(stop, Interrupted) else signal.SIGINT, kept) from None


def _interrupts() -> AbstractContextManager[None]:
    fired: list[int] = []

    def interrupt(signum: int, frame: FrameType | None) -> None:
        if not fired:  # later signals: the run is already stopping (workers, partial results)
            fired.append(signum)
            raise Interrupted(signum)

    return handling((signal.SIGINT, signal.SIGTERM), interrupt)


@contextmanager
def handling(signals: Iterable[int], handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    """For the block, ``handler`` handles ``signals``; the handlers before it are given back. From the main thread
    only (elsewhere Python refuses to set one): in any other thread the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)
