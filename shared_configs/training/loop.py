"""The training loop both CLIs run, framework-free: the frameworks hand it a step and a saver.

`open_run` owns the run folder and finds where the run starts; `run_loop` runs the steps, saves every
``checkpoint_every`` and at the end, and stops cleanly on a non-finite loss or a stop signal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from shared_configs.cli import handling
from shared_configs.spec import UNetSpec
from shared_configs.training.config import TrainConfig, check_finite, run_record
from shared_configs.training.manifest import Manifest
from shared_configs.training.outputs import progress_bar, write_losses
from shared_configs.training.preemption import STOP_SIGNALS, Stopped, StopSignals
from shared_configs.training.run_folder import (
    SOLO,
    Comm,
    check_resume,
    checkpoint_name,
    find_start,
    owned,
    read_checkpoint,
)

State = TypeVar("State")


@dataclass(frozen=True)
class RunStart:
    """Where a run starts: its folder and, when resuming, the checkpoint and its manifest."""

    out: Path
    checkpoint: Path | None = None
    manifest: Manifest | None = None

    @property
    def losses(self) -> list[float]:
        """The losses of the steps already done (empty for a fresh run)."""
        return [] if self.manifest is None else list(self.manifest.losses)


@contextmanager
def open_run(cfg: TrainConfig, spec: UNetSpec, framework: str, layout: str, owner: bool = True) -> Iterator[RunStart]:
    """Own ``cfg.out`` for the block (``owner``: rank 0 holds the lock) and find where to start (before any model)."""
    out = Path(cfg.out)
    with owned(out, owner):
        path = find_start(out, cfg.resume, cfg.overwrite)
        if path is None:
            yield RunStart(out)
            return
        manifest = read_checkpoint(path, framework, layout)
        check_resume(path, manifest, cfg, spec)
        yield RunStart(out, path, manifest)


def manifest_for(cfg: TrainConfig, spec: UNetSpec, framework: str, layout: str, losses: list[float]) -> Manifest:
    """The manifest of a checkpoint after ``len(losses)`` steps (its files are added when written)."""
    return Manifest(framework, layout, len(losses), list(losses), run_record(cfg, spec))


def run_loop(
    cfg: TrainConfig,
    state: State,
    losses: list[float],
    step_fn: Callable[[State, int], tuple[State, float]],
    save_fn: Callable[[State, list[float]], Any],
    title: str,
    comm: Comm = SOLO,
    settings: str = "",
) -> State:
    """Steps ``len(losses) .. cfg.steps - 1`` with ``save_fn`` at each checkpoint boundary; a non-finite loss raises
    `NonFiniteLoss`, a stop signal to any rank ends every rank after the same step, saved (`Stopped`)."""
    saved = len(losses)
    shown = progress_bar(cfg.steps, len(losses), title, settings, comm.rank == 0, cfg.log_every)  # the logs: rank 0's
    signals = StopSignals()
    with handling(STOP_SIGNALS, signals.note), shown as update:
        for step in range(len(losses), cfg.steps):
            state, loss = step_fn(state, step)
            kept = f"The checkpoint of step {saved} in {cfg.out} is the last good one." if saved else "No checkpoint."
            check_finite(loss, step, cfg.steps, kept)
            losses.append(loss)
            update(loss)
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                save_fn(state, losses)
                saved = step + 1
            signum = comm.max(signals.signum or 0)
            if signum and step + 1 < cfg.steps:
                if saved != step + 1:
                    save_fn(state, losses)
                if comm.rank == 0:
                    write_losses(cfg.out, losses)
                raise Stopped(signum, step + 1, cfg.steps, cfg.out, checkpoint_name(step + 1))
    return state
