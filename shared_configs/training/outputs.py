"""What a training run shows while and after it runs: a progress bar, its speed line, the plots.

No torch or jax import (matplotlib and rich are imported lazily where used).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from shared_configs.files import atomic_write, write_png


@contextmanager
def progress_bar(
    total: int, start: int, title: str, settings: str = "", show: bool = True, log_every: int | None = None
) -> Iterator[Callable[[float], None]]:
    """A rich progress bar (off a terminal: a mean-loss line every ``log_every`` steps) advanced by the yielded
    ``update(loss)``; on exit, the speed line with ``settings``. Nothing is shown unless ``show``."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TextColumn("loss {task.fields[loss]}"),
    )
    terminal = sys.stderr.isatty()
    with Progress(*columns, transient=False, disable=not (show and terminal)) as bar:
        task = bar.add_task(title, total=total, completed=start, loss="-")
        running: list[float] = []
        stamps = [time.perf_counter()]

        def update(loss: float) -> None:
            stamps.append(time.perf_counter())
            running.append(loss)
            bar.update(task, advance=1, loss=f"{np.mean(running[-20:]):.4f}")
            step = start + len(running)
            if show and not terminal and log_every and (step % log_every == 0 or step == total):
                recent = running[-((step - 1) % log_every + 1) :]  # the steps since the line before
                print(
                    f"{title}: step {step}/{total}, loss {np.mean(recent):.4f} (mean of the last {len(recent)})",
                    file=sys.stderr,
                    flush=True,
                )

        yield update
    if show and len(stamps) > 1:
        print(speed_line(title, np.diff(stamps)) + (f"; settings {settings}" if settings else ""), file=sys.stderr)


def speed_line(title: str, seconds: np.ndarray) -> str:
    """Steps per second, leaving out the first step (it compiles in JAX and warms caches in torch)."""
    first = f"{len(seconds)} step(s); first {seconds[0]:.2f} s (compile/warm-up)"
    if len(seconds) < 2:
        return f"{title}: {first}"
    median = float(np.median(seconds[1:]))
    return f"{title}: {first}; then median {median:.3f} s/step = {1 / median:.2f} steps/s over {len(seconds) - 1}"


def write_outputs(out: str | Path, losses: list[float], samples: np.ndarray | None, title: str) -> None:
    """A finished run's ``losses.json``, ``loss.png`` (raw and smoothed loss) and, given samples (N, C, H, W),
    ``samples.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(losses, alpha=0.4, label="loss")
    window = min(20, len(losses))
    if window > 1:
        ax.plot(
            np.arange(window - 1, len(losses)),
            np.convolve(losses, np.ones(window) / window, "valid"),
            label=f"mean of {window}",
        )
    ax.set(xlabel="step", ylabel="MSE on noise", yscale="log", title=title)
    ax.legend()
    write_png(fig, Path(out) / "loss.png", dpi=80, bbox_inches="tight")
    if samples is not None:
        cols = min(10, len(samples))
        rows = -(-len(samples) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(cols, rows), squeeze=False)
        for ax, img in zip(axes.flat, samples, strict=False):
            ax.imshow(img[0], cmap="gray", vmin=-1, vmax=1)
        for ax in axes.flat:
            ax.axis("off")
        write_png(fig, Path(out) / "samples.png", dpi=80, bbox_inches="tight")
    write_losses(out, losses)


def write_losses(out: str | Path, losses: list[float]) -> None:
    """``losses.json``: the loss of every step from step 0."""
    atomic_write(Path(out) / "losses.json", json.dumps(losses).encode())
