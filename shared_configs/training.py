"""Framework-free DDPM training pieces shared by `torch_impl.train` and `jax_impl.train`.

Everything random lives here, in numpy, so both frameworks see the *same* batches, timesteps,
noise and class contexts for a given seed (layouts: NCHW here; the JAX loop transposes to NHWC):

* the noise schedule (`make_schedule`: linear or cosine betas) and the forward process
  ``x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps``, computed in float64, handed over as float32;
* the data (`load_dataset`): scikit-learn's 8x8 digits (bundled, no download) or a synthetic set,
  resized/padded to the spec's ``sample_size``, tiled to ``in_channels``, scaled to [-1, 1];
* the class context for cross-attention: a fixed random embedding table (seeded, not learned),
  one token per image, shape (B, 1, cross_attention_dim); ``None`` for specs without it;
* batch ``step`` depends only on (seed, step), so a resumed run sees the batches it would have seen;
* a short ancestral sampler over respaced timesteps, parameterised by an ``eps_fn`` callback;
* the CLI, progress bar, plots and atomic file writes.

No torch or jax import (matplotlib and rich are imported lazily where used).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared_configs.spec import UNetSpec

NUM_CLASSES = 10
CONTEXT_TABLE_SEED = 1234  # the class-embedding table is the same for every run


# ---- noise schedule ------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    """DDPM betas and their cumulative products (float64)."""

    betas: np.ndarray

    @property
    def num_timesteps(self) -> int:
        return len(self.betas)

    @property
    def alphas_cumprod(self) -> np.ndarray:
        return np.cumprod(1.0 - self.betas)


def make_schedule(kind: str = "linear", num_timesteps: int = 1000) -> Schedule:
    """``linear`` (Ho et al. 2020, 1e-4 .. 0.02 scaled to T) or ``cosine`` (Nichol & Dhariwal 2021)."""
    if kind == "linear":
        scale = 1000 / num_timesteps
        return Schedule(np.linspace(scale * 1e-4, scale * 0.02, num_timesteps, dtype=np.float64))
    if kind == "cosine":
        s, steps = 0.008, np.arange(num_timesteps + 1, dtype=np.float64) / num_timesteps
        abar = np.cos((steps + s) / (1 + s) * np.pi / 2) ** 2
        return Schedule(np.clip(1 - abar[1:] / abar[:-1], 0.0, 0.999))
    raise ValueError(f"schedule: unknown {kind!r} (allowed: linear, cosine)")


# ---- data ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    """One training batch, NCHW float32: the model sees (noisy, t, context) and must predict noise."""

    noisy: np.ndarray
    t: np.ndarray
    noise: np.ndarray
    context: np.ndarray | None
    labels: np.ndarray

    def shard(self, rank: int, world: int) -> Batch:
        """This rank's contiguous slice of the global batch (data parallelism)."""
        n = len(self.t)
        if n % world:
            raise ValueError(f"batch-size: {n} does not split evenly over {world} processes")
        part = slice(rank * n // world, (rank + 1) * n // world)
        context = None if self.context is None else self.context[part]
        return Batch(self.noisy[part], self.t[part], self.noise[part], context, self.labels[part])


@dataclass(frozen=True)
class Dataset:
    """Images (N, C, H, W) in [-1, 1] with class labels, and the class-context table."""

    images: np.ndarray
    labels: np.ndarray
    context_table: np.ndarray | None

    def context(self, labels: np.ndarray) -> np.ndarray | None:
        """(B,) labels -> (B, 1, cross_attention_dim) fixed embeddings, or None."""
        return None if self.context_table is None else self.context_table[labels][:, None, :]

    def batch(self, step: int, batch_size: int, schedule: Schedule, seed: int) -> Batch:
        """The batch for ``step``: a function of (seed, step) only."""
        rng = np.random.default_rng([seed, step])
        idx = rng.integers(0, len(self.images), batch_size)
        t = rng.integers(0, schedule.num_timesteps, batch_size)
        x0 = self.images[idx].astype(np.float64)
        noise = rng.standard_normal(x0.shape)
        abar = schedule.alphas_cumprod[t][:, None, None, None]
        noisy = np.sqrt(abar) * x0 + np.sqrt(1.0 - abar) * noise
        labels = self.labels[idx]
        return Batch(
            noisy.astype(np.float32), t.astype(np.float32), noise.astype(np.float32), self.context(labels), labels
        )


def load_dataset(kind: str, spec: UNetSpec, seed: int = 0) -> Dataset:
    """``digits`` (sklearn's 1797 8x8 digits) or ``synthetic`` (noisy per-class patterns)."""
    if kind == "digits":
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = digits.images.astype(np.float64) / 16.0 * 2.0 - 1.0  # (N, 8, 8) in [-1, 1]
        labels = digits.target.astype(np.int64)
    elif kind == "synthetic":
        rng = np.random.default_rng(seed)
        patterns = np.tanh(2 * rng.standard_normal((NUM_CLASSES, 8, 8)))
        labels = rng.integers(0, NUM_CLASSES, 1000)
        images = np.clip(patterns[labels] + 0.1 * rng.standard_normal((1000, 8, 8)), -1, 1)
    else:
        raise ValueError(f"data: unknown {kind!r} (allowed: digits, synthetic)")
    images = _fit(images, spec.sample_size)
    images = np.repeat(images[:, None], spec.in_channels, axis=1).astype(np.float32)
    table = None
    if spec.cross_attention_dim is not None:
        rng = np.random.default_rng(CONTEXT_TABLE_SEED)
        table = rng.standard_normal((NUM_CLASSES, spec.cross_attention_dim)).astype(np.float32)
    return Dataset(images, labels, table)


def _fit(images: np.ndarray, size: int) -> np.ndarray:
    """(N, 8, 8) -> (N, size, size): nearest upscale by an integer factor, then pad with -1 (or crop)."""
    h = images.shape[1]
    factor = max(size // h, 1)
    images = images.repeat(factor, axis=1).repeat(factor, axis=2)
    h = images.shape[1]
    if h > size:
        start = (h - size) // 2
        return images[:, start : start + size, start : start + size]
    before = (size - h) // 2
    pad = ((0, 0), (before, size - h - before), (before, size - h - before))
    return np.pad(images, pad, constant_values=-1.0)


def step_seed(seed: int, step: int) -> int:
    """A per-step seed for framework RNGs (dropout): resuming at ``step`` replays the same masks."""
    return int(np.random.default_rng([seed, step, 1]).integers(0, 2**31 - 1))


# ---- sampling ------------------------------------------------------------------------------


def sample(
    eps_fn: Callable[[np.ndarray, np.ndarray, np.ndarray | None], np.ndarray],
    schedule: Schedule,
    dataset: Dataset,
    shape: tuple[int, int, int, int],
    num_steps: int,
    seed: int,
) -> np.ndarray:
    """Ancestral DDPM sampling over ``num_steps`` evenly respaced timesteps; NCHW in [-1, 1].

    ``eps_fn(x_nchw, t, context)`` returns the model's noise prediction as numpy. Sample ``i`` is
    conditioned on class ``i % 10``.
    """
    rng = np.random.default_rng([seed, 2**31])
    labels = np.arange(shape[0]) % NUM_CLASSES
    context = dataset.context(labels)
    timesteps = np.unique(np.linspace(0, schedule.num_timesteps - 1, num_steps).round().astype(np.int64))[::-1]
    abar = schedule.alphas_cumprod
    x = rng.standard_normal(shape)
    for i, t in enumerate(timesteps):
        ab_t = abar[t]
        ab_prev = abar[timesteps[i + 1]] if i + 1 < len(timesteps) else 1.0
        beta = 1.0 - ab_t / ab_prev  # the respaced step's beta
        eps = eps_fn(x.astype(np.float32), np.full(shape[0], t, np.float32), context).astype(np.float64)
        x = (x - beta / np.sqrt(1.0 - ab_t) * eps) / np.sqrt(1.0 - beta)
        if i + 1 < len(timesteps):
            x += np.sqrt(beta * (1.0 - ab_prev) / (1.0 - ab_t)) * rng.standard_normal(shape)
    return np.clip(x, -1.0, 1.0).astype(np.float32)


# ---- configuration and CLI ---------------------------------------------------------------


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run depends on (the CLI flags, one for one)."""

    config: str = "tiny"
    policy: str = "none"
    batch_size: int = 16
    steps: int = 200
    lr: float = 1e-3
    weight_decay: float = 0.0
    seed: int = 0
    dtype: str = "float32"
    out: str = "runs/train"
    resume: bool = False
    data: str = "digits"
    schedule: str = "linear"
    timesteps: int = 1000
    sample_steps: int = 20
    num_samples: int = 20
    checkpoint_every: int = 100
    distributed: str | None = None  # None: one process; else a key of DISTRIBUTED[framework]
    attention_chunk: int | None = None  # jax_impl only: UNet(attention_chunk=...)


# --distributed modes per framework. ddp: the batch split over processes (torch DDP) or devices
# (JAX), parameters replicated; fsdp: torch FSDP2, parameters, gradients and optimizer state sharded.
DISTRIBUTED: dict[str, tuple[str, ...]] = {"torch_impl": ("ddp", "fsdp"), "jax_impl": ("ddp",)}


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage + message; we want one line
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _positive(kind: type) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
        return value

    return parse


def parse_args(argv: list[str] | None, framework: str) -> TrainConfig:
    """Parse the shared CLI of ``python -m {torch_impl,jax_impl}.train``."""
    d = TrainConfig()
    p = _OneLineParser(prog=f"python -m {framework}.train", description="DDPM noise-prediction training.")
    p.add_argument("--config", default=d.config, help="preset name or YAML path (default: tiny)")
    p.add_argument("--policy", default=d.policy, help="checkpoint policy: none, full, balanced, layers, every:N")
    p.add_argument("--batch-size", type=_positive(int), default=d.batch_size)
    p.add_argument("--steps", type=_positive(int), default=d.steps, help="total steps (a resumed run stops here too)")
    p.add_argument("--lr", type=_positive(float), default=d.lr)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW decoupled weight decay")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=d.dtype)
    p.add_argument("--out", default=f"runs/{framework}", help="output folder (checkpoint, loss.png, samples.png)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--data", choices=("digits", "synthetic"), default=d.data)
    p.add_argument("--schedule", choices=("linear", "cosine"), default=d.schedule)
    p.add_argument("--timesteps", type=_positive(int), default=d.timesteps)
    p.add_argument("--sample-steps", type=int, default=d.sample_steps, help="sampler steps; 0 skips sampling")
    p.add_argument("--num-samples", type=_positive(int), default=d.num_samples)
    p.add_argument("--checkpoint-every", type=_positive(int), default=d.checkpoint_every)
    p.add_argument(
        "--distributed",
        nargs="?",
        const="ddp",
        default=d.distributed,
        choices=DISTRIBUTED["torch_impl"],  # every mode; the check below narrows it per framework
        help="ddp (what --distributed alone means): torch DDP over gloo (launch with torchrun), or JAX over all "
        "devices; fsdp: torch FSDP2, one shard unit per U-Net block (torch_impl only; launch with torchrun)",
    )
    if framework == "jax_impl":  # torch's CPU attention kernel is fused already: no twin
        p.add_argument(
            "--attention-chunk",
            type=_positive(int),
            default=d.attention_chunk,
            help="compute attention this many queries at a time, each chunk rematerialised (default: off)",
        )
    args = p.parse_args(argv)
    modes = DISTRIBUTED[framework]
    if args.distributed is not None and args.distributed not in modes:
        p.error(f"--distributed {args.distributed}: {framework}.train supports {', '.join(modes)} only")
    return TrainConfig(**vars(args))


def cli_main(train: Callable[[TrainConfig], list[float]], argv: list[str] | None, framework: str) -> int:
    """Run ``train`` from the command line; bad input exits with one line and status 2."""
    from shared_configs.spec import SpecError

    cfg = parse_args(argv, framework)
    try:
        train(cfg)
    except (SpecError, ValueError, FileNotFoundError, NotImplementedError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


# ---- outputs ------------------------------------------------------------------------------


def atomic_write(path: str | Path, data: bytes) -> None:
    """Write ``data`` to a temp file next to ``path``, then `os.replace` it: never half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def progress_bar(total: int, start: int, title: str) -> Iterator[Callable[[float], None]]:
    """A rich progress bar; the yielded ``update(loss)`` advances it and shows the running loss.

    On exit it prints the training speed (`speed_line`) to stderr.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
               TextColumn("loss {task.fields[loss]}"))  # fmt: skip
    with Progress(*columns, transient=False, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task(title, total=total, completed=start, loss="-")
        running: list[float] = []
        stamps = [time.perf_counter()]

        def update(loss: float) -> None:
            stamps.append(time.perf_counter())
            running.append(loss)
            bar.update(task, advance=1, loss=f"{np.mean(running[-20:]):.4f}")

        yield update
    if len(stamps) > 1:
        print(speed_line(title, np.diff(stamps)), file=sys.stderr)


def speed_line(title: str, seconds: np.ndarray) -> str:
    """Steps per second, leaving out the first step (it compiles in JAX and warms caches in torch)."""
    first = f"{len(seconds)} step(s); first {seconds[0]:.2f} s (compile/warm-up)"
    if len(seconds) < 2:
        return f"{title}: {first}"
    median = float(np.median(seconds[1:]))
    return f"{title}: {first}; then median {median:.3f} s/step = {1 / median:.2f} steps/s over {len(seconds) - 1}"


def save_plots(out: str | Path, losses: list[float], samples: np.ndarray | None, title: str) -> None:
    """``loss.png`` (raw and smoothed loss) and, given samples (N, C, H, W), ``samples.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(losses, alpha=0.4, label="loss")
    window = min(20, len(losses))
    if window > 1:
        ax.plot(np.arange(window - 1, len(losses)), np.convolve(losses, np.ones(window) / window, "valid"),
                label=f"mean of {window}")  # fmt: skip
    ax.set(xlabel="step", ylabel="MSE on noise", yscale="log", title=title)
    ax.legend()
    _save_figure(fig, Path(out) / "loss.png")
    if samples is not None:
        cols = min(10, len(samples))
        rows = -(-len(samples) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(cols, rows), squeeze=False)
        for ax, img in zip(axes.flat, samples, strict=False):
            ax.imshow(img[0], cmap="gray", vmin=-1, vmax=1)
        for ax in axes.flat:
            ax.axis("off")
        _save_figure(fig, Path(out) / "samples.png")


def _save_figure(fig: object, path: Path) -> None:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")  # type: ignore[attr-defined]
    plt.close(fig)  # type: ignore[arg-type]
    atomic_write(path, buf.getvalue())
