"""Progress of long waits, through stdlib logging (the ``unet_remat`` logger).

`progress(what, total)` reports ``what: done/total, detail, elapsed, about N s left`` at INFO; a library call
stays quiet unless logging is on or the wait passes `QUIET_S`. CLIs run inside `cli_logging()` (a live line
on a terminal); a worker calls `worker_logging()` and its parent passes the lines on with `Relay`.
`reporting_to(logger)` sends the progress and notes of the calls in a block elsewhere (`SILENT`: nowhere).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing, contextmanager
from contextvars import ContextVar
from typing import IO, TypeVar

LOGGER = logging.getLogger("unet_remat")
QUIET_S = 5.0  # a library call's wait shorter than this says nothing unless logging is on
T = TypeVar("T")
MARK = "unet_remat progress: "  # a worker's progress line on its stderr, for the parent to pass on
SILENT = logging.getLogger("unet_remat.silent")  # says nothing: `reporting_to(SILENT)` keeps a block's calls quiet
SILENT.addHandler(logging.NullHandler())
SILENT.propagate = False
SILENT.setLevel(logging.INFO)
_TARGET: ContextVar[logging.Logger] = ContextVar("unet_remat_progress", default=LOGGER)


@contextmanager
def reporting_to(logger: logging.Logger) -> Iterator[None]:
    """The progress and notes of the library calls in the block (the planner's: profiling, checking) go to
    ``logger`` instead of the ``unet_remat`` logger; a `Relay` made in the block passes its worker's there too."""
    token = _TARGET.set(logger)
    try:
        yield
    finally:
        _TARGET.reset(token)


class LiveHandler(logging.StreamHandler):
    """Progress records overwrite one live line on a terminal; every record is a plain line otherwise."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        super().__init__(stream)  # None: sys.stderr
        self.setFormatter(logging.Formatter("%(message)s"))
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self._pending = False  # a live line is on screen, without its newline

    def emit(self, record: logging.LogRecord) -> None:
        try:
            live = bool(self.live and getattr(record, "progress", False))  # a live line ends without its newline
            clear = "\r\x1b[2K" if live or self._pending else ""
            self.stream.write(clear + self.format(record) + ("" if live else "\n"))
            self._pending = live
            self.flush()
        except Exception:  # logging's contract: a broken stream never breaks the program
            self.handleError(record)


_fallback: LiveHandler | None = None


def _speaks(logger: logging.Logger) -> bool:
    """Whether the caller turned logging on for ``logger`` (a handler anywhere up, INFO enabled)."""
    return logger.isEnabledFor(logging.INFO) and logger.hasHandlers()


def _emit(logger: logging.Logger, text: str, live: bool, started: float, quiet_s: float) -> bool:
    """Log ``text``; with logging off, say it on stderr once the wait passes ``quiet_s``. Whether it was said."""
    if _speaks(logger):
        logger.info(text, extra={"progress": live})
        return True
    if time.monotonic() - started < quiet_s:
        return False
    global _fallback
    if _fallback is None:
        _fallback = LiveHandler()
    _fallback.stream = sys.stderr  # whatever it is now (as logging's lastResort): a redirect, a test's capture
    _fallback.handle(logger.makeRecord(logger.name, logging.INFO, "", 0, text, None, None, extra={"progress": live}))
    return True


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


class Progress:
    """One long wait: ``advance`` after each piece of work, ``note`` what is under way."""

    def __init__(
        self, what: str, total: int | None = None, logger: logging.Logger | None = None, quiet_s: float = QUIET_S
    ) -> None:
        self.what, self.total, self.logger, self.quiet_s = what, total, logger or _TARGET.get(), quiet_s
        self.done, self.detail, self.shown = 0, "", False
        self.started = time.monotonic()

    def _head(self) -> str:
        return f"{self.what}: {self.done}/{self.total}" if self.total else self.what

    def line(self) -> str:
        """``what: done/total, detail, 12 s, about 30 s left`` (the estimate from the pace so far)."""
        elapsed = time.monotonic() - self.started
        parts = [self._head(), *([self.detail] if self.detail else []), _seconds(elapsed)]
        if self.total and 0 < self.done < self.total:
            parts.append(f"about {_seconds(elapsed / self.done * (self.total - self.done))} left")
        return ", ".join(parts)

    def note(self, detail: str) -> None:
        self.detail = detail
        self.shown |= _emit(self.logger, self.line(), True, self.started, self.quiet_s)

    def advance(self, n: int = 1, detail: str | None = None) -> None:
        self.done += n
        self.note(self.detail if detail is None else detail)

    def close(self) -> None:
        """The final line (only where something was said, or logging is on)."""
        if self.shown or _speaks(self.logger):
            self.detail = f"done in {_seconds(time.monotonic() - self.started)}"
            _emit(self.logger, f"{self._head()}, {self.detail}", False, self.started, 0.0)


def progress(what: str, total: int | None = None, logger: logging.Logger | None = None) -> closing[Progress]:
    """A `Progress` closed on the way out (its final line says how long the wait took)."""
    return closing(Progress(what, total, logger))


def tracked(items: Iterable[T], what: str, label: Callable[[T], str] = str) -> Iterator[T]:
    """tqdm's ``tqdm(items)``: each item in turn, reported as `progress` (``label`` names the item under way)."""
    items = list(items)
    with progress(what, len(items)) as p:
        for i, item in enumerate(items):
            if i == 0:
                p.note(label(item))
            yield item
            p.advance(detail=label(items[i + 1]) if i + 1 < len(items) else "")


def note(text: str) -> None:
    """A line for whoever turned logging on (a CLI does): what a long wait is about to do."""
    if _speaks(logger := _TARGET.get()):
        logger.info(text)


def say(text: str) -> None:
    """A line the user must see (a re-plan, a retry): a WARNING when logging is on, else a line on stderr."""
    if _speaks(LOGGER):
        LOGGER.warning(text)
    else:
        print(text, file=sys.stderr, flush=True)


class Relay(Progress):
    """The parent's side of a worker's progress, a wait of its own: the worker's `MARK` lines logged as
    ``what: line`` (its other lines are its caller's: `shared_configs.planning.workers` keeps its last ones)."""

    def feed(self, line: str) -> None:
        if line.startswith(MARK):
            text = f"{self.what}: {line.removeprefix(MARK).rstrip()}"
            self.shown |= _emit(self.logger, text, True, self.started, self.quiet_s)

    def close(self) -> None:
        """With logging off, a final line under the progress said (with it on, the caller's next line says it)."""
        if self.shown and not _speaks(self.logger):
            _emit(self.logger, f"{self.what}: done in {_seconds(time.monotonic() - self.started)}", False, 0.0, 0.0)


def worker_logging(stream: IO[str] | None = None) -> None:
    """In a worker process: progress as `MARK` lines on stderr (flushed), for the parent's `Relay`."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter(MARK + "%(message)s"))
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    LOGGER.propagate = False


@contextmanager
def cli_logging(verbose: bool = False, stream: IO[str] | None = None) -> Iterator[LiveHandler]:
    """In a command, while it runs: the library's progress and notes on stderr; the logger as it was afterwards."""
    saved = (list(LOGGER.handlers), LOGGER.level, LOGGER.propagate)
    handler = LiveHandler(stream)
    LOGGER.handlers[:] = [handler]
    LOGGER.setLevel(logging.DEBUG if verbose else logging.INFO)
    LOGGER.propagate = False
    try:
        yield handler
    finally:
        LOGGER.handlers[:], LOGGER.level, LOGGER.propagate = saved
