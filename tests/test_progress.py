"""`shared_configs.progress`: a library call is quiet unless logging is on or its wait is long; with
logging on every step is an INFO record; a terminal gets one live line, a log plain lines; a
worker's progress lines reach the parent's log and its other stderr lines are kept."""

from __future__ import annotations

import io
import logging

import pytest

from shared_configs import progress as pg


def run(total: int = 3, quiet_s: float = pg.QUIET_S) -> None:
    p = pg.Progress("profiling tiny in torch", total, quiet_s=quiet_s)
    for unit in ("down.0", "mid", "up.0")[:total]:
        p.advance(detail=unit)
    p.close()


def test_a_library_call_is_quiet_unless_logging_is_on(capsys: pytest.CaptureFixture[str]) -> None:
    run()
    assert capsys.readouterr().err == ""


def test_a_long_wait_speaks_on_stderr_without_logging(capsys: pytest.CaptureFixture[str]) -> None:
    run(quiet_s=0.0)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("profiling tiny in torch: 1/3, down.0, 0 s, about 0 s left")
    assert lines[-1].startswith("profiling tiny in torch: 3/3, done in 0 s")
    assert len(lines) == 4  # not a terminal: a plain line per step


def test_with_logging_on_each_step_is_an_info_record(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="unet_remat")
    run()
    messages = [r.getMessage() for r in caplog.records if r.name == "unet_remat"]
    assert [m.split(", ")[:2] for m in messages] == [
        ["profiling tiny in torch: 1/3", "down.0"],
        ["profiling tiny in torch: 2/3", "mid"],
        ["profiling tiny in torch: 3/3", "up.0"],
        ["profiling tiny in torch: 3/3", "done in 0 s"],
    ]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_one_live_line_a_log_plain_lines() -> None:
    for stream, live in ((Terminal(), True), (io.StringIO(), False)):
        with pg.cli_logging(stream=stream):
            run()
            pg.LOGGER.info("a note")
        assert pg.LOGGER.level == logging.NOTSET and pg.LOGGER.handlers == []  # as it was
        text = stream.getvalue()
        assert text.count("\n") == (2 if live else 5)  # live: the final line and the note
        assert ("\r\x1b[2K" in text) == live


def test_a_workers_progress_reaches_the_parent_and_nothing_else(caplog: pytest.LogCaptureFixture) -> None:
    stderr = io.StringIO()
    pg.worker_logging(stream=stderr)
    run(total=2)
    pg.LOGGER.handlers.clear()
    caplog.set_level(logging.INFO, logger="unet_remat")
    pg.LOGGER.propagate = True
    relay = pg.Relay("jax worker")
    for line in [*stderr.getvalue().splitlines(keepends=True), "Traceback ...\n", "ValueError: bad\n"]:
        relay.feed(line)
    relayed = [r.getMessage() for r in caplog.records if r.name == "unet_remat"]
    assert relayed[0].startswith("jax worker: profiling tiny in torch: 1/2, down.0")
    assert len(relayed) == 3  # the two progress lines and the final one; the traceback is the caller's


def test_tracked_yields_every_item_and_says_which_is_next(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="unet_remat")
    assert list(pg.tracked(["none", "full"], "compiles")) == ["none", "full"]
    messages = [r.getMessage().split(", ")[:2] for r in caplog.records if r.name == "unet_remat"]
    assert messages == [
        ["compiles: 0/2", "none"],
        ["compiles: 1/2", "full"],
        ["compiles: 2/2", "0 s"],
        ["compiles: 2/2", "done in 0 s"],
    ]


def test_what_the_user_must_see_goes_to_stderr_or_through_logging(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    pg.say("guard: step 3: re-planned")
    assert capsys.readouterr().err == "guard: step 3: re-planned\n"
    caplog.set_level(logging.INFO, logger="unet_remat")
    pg.say("guard: step 4: re-planned")
    assert capsys.readouterr().err == "" and [r.levelname for r in caplog.records] == ["WARNING"]
