"""Stopping a training run on SIGTERM, SIGINT or SIGUSR1 without losing it: `StopSignals` only notes the signal,
the loop saves after the step in flight and raises `Stopped`, the CLI prints the ``--resume`` command and exits
128 + the signal's number. Docs: docs/training.md. No torch or jax import.
"""

from __future__ import annotations

import os
import shlex
import signal
from collections.abc import Sequence
from types import FrameType

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class Stopped(Exception):
    """The run stopped on a signal after saving ``checkpoint`` (of ``step``) and ``losses.json`` in ``out``."""

    def __init__(self, signum: int, step: int, total: int, out: str, checkpoint: str) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step} of {total}")
        self.signum, self.step, self.out, self.checkpoint = signum, step, out, checkpoint


class StopSignals:
    """The signal that asked a run to stop: the loop has `note` handle `STOP_SIGNALS` for its steps (`cli.handling`),
    so that a signal sets `signum` instead of ending the process."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def note(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            return
        # os.write, not print: a handler may run inside another print to the same stream.
        message = (
            f"note: {signal.Signals(signum).name} again: still finishing the step and its checkpoint; "
            "SIGKILL stops now\n"
        )
        os.write(2, message.encode())


def resume_command(program: str, argv: Sequence[str], env: dict[str, str] | None = None) -> str:
    """The command line that resumes a run started with ``argv`` (``--resume`` for ``--overwrite``; torchrun's too)."""
    env = dict(os.environ) if env is None else env
    args = [a for a in argv if a not in ("--overwrite", "--resume")] + ["--resume"]
    if "LOCAL_WORLD_SIZE" not in env:
        return shlex.join(["python", "-m", program, *args])
    launcher = ["torchrun", "--nproc-per-node", env["LOCAL_WORLD_SIZE"]]
    nodes = int(env.get("WORLD_SIZE", env["LOCAL_WORLD_SIZE"])) // int(env["LOCAL_WORLD_SIZE"])
    if nodes > 1:
        launcher += ["--nnodes", str(nodes)]
    return shlex.join([*launcher, "-m", program, *args])
