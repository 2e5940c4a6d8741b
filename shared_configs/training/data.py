"""The training data both loops share, in numpy, so torch and JAX see the same batches for a seed: `load_dataset`
(digits or synthetic, fitted to the spec), the conditioning each spec takes (`Conditioner`, and a ControlNet's
edge maps, `control_image`) and `Dataset.batch` (a function of (seed, step), so a resumed run sees the same
batches). Docs: docs/training.md.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from shared_configs.inputs import INPUT_NAMES, LATENT_SCALE, NUM_TIMESTEPS, class_label_width, input_specs
from shared_configs.spec import UNetSpec

if TYPE_CHECKING:
    from shared_configs.controlnet import ControlNetSpec
    from shared_configs.training.ddpm import Schedule

NUM_CLASSES = 10
CONTEXT_TABLE_SEED = 1234  # the class-embedding table is the same for every run
TEXT_TABLE_SEED = 1235  # so are the class-vector and text_embeds tables
DATASETS = ("digits", "synthetic")
CONDITIONING: tuple[str, ...] = INPUT_NAMES[2:]  # context, class_labels, text_embeds, time_ids
EDGE_THRESHOLD = 0.5  # an edge: a jump of a quarter of the images' [-1, 1] range between neighbouring pixels


@dataclass(frozen=True)
class Batch:
    """One training batch, NCHW float32: (noisy, t, conditioning) -> noise; conditioning the spec lacks is None;
    a ControlNet step's also ``controlnet_cond``, the conditioning image the ControlNet reads (its own size)."""

    noisy: np.ndarray
    t: np.ndarray
    noise: np.ndarray
    context: np.ndarray | None
    labels: np.ndarray
    class_labels: np.ndarray | None = None
    text_embeds: np.ndarray | None = None
    time_ids: np.ndarray | None = None
    controlnet_cond: np.ndarray | None = None

    def conditioning(self) -> dict[str, np.ndarray | None]:
        """The forward's inputs after (x, t), by name, in `CONDITIONING` order (then a ControlNet step's
        ``controlnet_cond``)."""
        inputs = {name: getattr(self, name) for name in CONDITIONING}
        return inputs if self.controlnet_cond is None else inputs | {"controlnet_cond": self.controlnet_cond}

    def shard(self, rank: int, world: int) -> Batch:
        """This rank's contiguous slice of the global batch (data parallelism)."""
        n = len(self.t)
        if n % world:
            raise ValueError(f"batch-size: {n} does not split evenly over {world} processes")
        part = slice(rank * n // world, (rank + 1) * n // world)
        return replace(self, **{name: a[part] for name, a in vars(self).items() if a is not None})


def check_conditioning(spec: UNetSpec, given: Mapping[str, Any]) -> None:
    """Refuse a batch (``given``: name -> array or None) whose conditioning inputs are not exactly ``spec``'s."""
    wanted = input_specs(spec, 1, context_len=1)
    for name in CONDITIONING:
        if wanted[name] is not None and given.get(name) is None:
            raise ValueError(
                f"batch: spec {spec.name!r} takes {name} but the batch has none; make batches for the "
                "spec (shared_configs.training.data.load_dataset(kind, spec), or "
                "shared_configs.training.data.example_batch)"
            )
        if wanted[name] is None and given.get(name) is not None:
            raise ValueError(f"batch: spec {spec.name!r} takes no {name} but the batch has one; set it to None")


@dataclass(frozen=True)
class Conditioner:
    """The conditioning inputs ``spec`` takes (None: none), made from class labels by fixed seeded tables
    (docs/training.md): one context token, class ids or vectors, text_embeds, and SDXL's time_ids (drawn in
    training)."""

    spec: UNetSpec | None = None

    @functools.cached_property
    def _tables(self) -> dict[str, np.ndarray]:
        """The seeded tables by input name, drawn once (the same for every run of the spec)."""
        spec, drawn = self.spec, {}
        assert spec is not None
        tables = np.random.default_rng(TEXT_TABLE_SEED)
        if spec.cross_attention_dim is not None:  # its own seed: the context of older runs is unchanged
            context = np.random.default_rng(CONTEXT_TABLE_SEED).standard_normal((NUM_CLASSES, spec.cross_attention_dim))
            drawn["context"] = context.astype(np.float32)[:, None, :]  # a token per class: (B, 1, D) once indexed
        if spec.class_embedding is not None and (width := class_label_width(spec)) is not None:
            drawn["class_labels"] = tables.standard_normal((NUM_CLASSES, width)).astype(np.float32)
        if (add := spec.addition_embedding) is not None:
            drawn["text_embeds"] = tables.standard_normal((NUM_CLASSES, add.text_embeds_dim)).astype(np.float32)
        return drawn

    def __call__(self, labels: np.ndarray, rng: np.random.Generator | None = None) -> dict[str, np.ndarray | None]:
        """(B,) labels -> every conditioning input by name; ``rng`` draws the time ids (None: sampling's)."""
        out: dict[str, np.ndarray | None] = dict.fromkeys(CONDITIONING)
        spec = self.spec
        if spec is None:
            return out
        out |= {name: table[labels] for name, table in self._tables.items()}
        if spec.class_embedding is not None and "class_labels" not in self._tables:
            modulus = spec.class_embedding.num_classes  # None: the ids as they are
            out["class_labels"] = (labels % modulus if modulus else labels).astype(np.int32)  # input_specs' dtype
        if (add := spec.addition_embedding) is not None:
            out["time_ids"] = _time_ids(len(labels), LATENT_SCALE * spec.sample_size, add.num_time_ids, rng)
        return out


def _time_ids(n: int, size: int, count: int, rng: np.random.Generator | None) -> np.ndarray:
    """SDXL's (B, ``count``) time ids of ``size`` px images: original size, crop corner, target size, repeated."""
    target = np.full((n, 2), size)
    if rng is None:
        original, crop = target, np.zeros((n, 2), np.int64)
    else:  # images of any size from half to twice the target, cropped by up to a quarter of it
        original, crop = rng.integers(size // 2, 2 * size + 1, (n, 2)), rng.integers(0, size // 4 + 1, (n, 2))
    six = np.concatenate([original, crop, target], axis=1)  # (B, 6)
    return six[:, np.arange(count) % 6].astype(np.float32)


def example_batch(spec: UNetSpec, batch_size: int, context_length: int = 77, seed: int = 0) -> Batch:
    """The benchmark's and the planner's inputs (conditioning from `Conditioner`), the same in both frameworks."""
    rng = np.random.default_rng(seed)
    size = spec.sample_size
    noisy = rng.standard_normal((batch_size, spec.in_channels, size, size), dtype=np.float32)
    t = rng.integers(0, NUM_TIMESTEPS, batch_size).astype(np.float32)
    noise = rng.standard_normal((batch_size, spec.out_channels, size, size), dtype=np.float32)
    width = spec.cross_attention_dim
    context = None if width is None else rng.standard_normal((batch_size, context_length, width), dtype=np.float32)
    labels = rng.integers(0, NUM_CLASSES, batch_size)  # drawn after the others: their values stay as they were
    conditioning = {**Conditioner(spec)(labels, rng), "context": context}
    return Batch(noisy=noisy, t=t, noise=noise, labels=labels, **conditioning)


@dataclass(frozen=True)
class Dataset:
    """Images (N, C, H, W) in [-1, 1] with class labels, and the conditioning they come with (a ``--controlnet``
    run's: each sample's edge map for ``controlnet``; the sampler gets each class's first image's)."""

    images: np.ndarray
    labels: np.ndarray
    conditioner: Conditioner = Conditioner()
    controlnet: ControlNetSpec | None = None

    def conditioning(
        self, labels: np.ndarray, rng: np.random.Generator | None = None, idx: np.ndarray | None = None
    ) -> dict[str, Any]:
        """(B,) labels (of the images ``idx``) -> the spec's conditioning inputs by name (see `Conditioner`), and
        with a ``controlnet`` ``controlnet_cond``; ``rng`` and ``idx``: a training batch's, None for the sampler's."""
        inputs = self.conditioner(labels, rng)
        if self.controlnet is None:
            return inputs
        if idx is None:
            idx = np.array([np.flatnonzero(self.labels == label)[0] for label in labels])
        return inputs | {"controlnet_cond": control_image(self.images[idx], self.controlnet)}

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
        # A stream of its own: the images, timesteps and noise of a seed stay what they were.
        conditioning = self.conditioning(labels, np.random.default_rng([seed, step, 2]), idx)
        arrays = (a.astype(np.float32) for a in (noisy, t, noise))
        return Batch(*arrays, labels=labels, **conditioning)


def control_image(images: np.ndarray, spec: ControlNetSpec) -> np.ndarray:
    """Each sample's edge map, (B, C, S, S) in [-1, 1] -> (B, channels, S f, S f) in {0, 1} like diffusers' Canny
    maps: 1 where the first channel jumps by more than `EDGE_THRESHOLD` to its right or lower neighbour."""
    x = images[:, 0].astype(np.float64)
    dx, dy = np.zeros_like(x), np.zeros_like(x)
    dx[:, :, :-1] = np.abs(np.diff(x, axis=2))
    dy[:, :-1, :] = np.abs(np.diff(x, axis=1))
    edges = (np.maximum(dx, dy) > EDGE_THRESHOLD).astype(np.float32)
    f = spec.conditioning_factor
    edges = edges.repeat(f, axis=1).repeat(f, axis=2)  # (B, S f, S f)
    return np.repeat(edges[:, None], spec.conditioning_channels, axis=1)


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
    images = np.repeat(_fit(images, spec.sample_size)[:, None], spec.in_channels, axis=1).astype(np.float32)
    return Dataset(images, labels, Conditioner(spec))


def _fit(images: np.ndarray, size: int) -> np.ndarray:
    """(N, 8, 8) -> (N, size, size): nearest upscale by an integer factor, then pad with -1 (or crop)."""
    factor = max(size // images.shape[1], 1)
    images = images.repeat(factor, axis=1).repeat(factor, axis=2)
    h = images.shape[1]
    if h > size:
        start = (h - size) // 2
        return images[:, start : start + size, start : start + size]
    before = (size - h) // 2
    return np.pad(images, ((0, 0), (before, size - h - before), (before, size - h - before)), constant_values=-1.0)


def step_seed(seed: int, step: int) -> int:
    """A per-step seed for framework RNGs (dropout): resuming at ``step`` replays the same masks."""
    return int(np.random.default_rng([seed, step, 1]).integers(0, 2**31 - 1))


def step_arrays(batch: Batch) -> list[np.ndarray]:
    """The arrays a training step reads (not the labels)."""
    return [batch.noisy, batch.t, batch.noise, *(a for a in batch.conditioning().values() if a is not None)]


def batch_bytes(batch: Batch) -> int:
    """Bytes of the arrays a training step reads."""
    return sum(a.nbytes for a in step_arrays(batch))
