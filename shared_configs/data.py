"""The training data both loops share, in numpy, so torch and JAX see the *same* batches for a seed.

* `load_dataset`: scikit-learn's 8x8 digits (bundled, no download) or a synthetic set, resized or
  padded to the spec's ``sample_size``, tiled to ``in_channels``, scaled to [-1, 1] (NCHW; the JAX
  loop transposes to NHWC);
* the class context for cross-attention: a fixed random embedding table (seeded, not learned),
  one token per image, shape (B, 1, cross_attention_dim); ``None`` for specs without it;
* `Dataset.batch`: batch ``step`` depends only on (seed, step), so a resumed run sees the batches
  it would have seen, and the forward process ``x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps``
  is computed in float64, handed over as float32;
* `step_seed`: the per-step seed of framework RNGs (dropout).

No torch or jax import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from shared_configs.spec import UNetSpec

if TYPE_CHECKING:
    from shared_configs.ddpm import Schedule

NUM_CLASSES = 10
CONTEXT_TABLE_SEED = 1234  # the class-embedding table is the same for every run
DATASETS = ("digits", "synthetic")


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
        raise ValueError(f"data: unknown {kind!r} (allowed: {', '.join(DATASETS)})")
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
