"""The DDPM pieces both training loops share, in numpy: the noise schedule (`make_schedule`, float64,
validated), the objective's check (`check_objective`) and a short ancestral sampler (`sample`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from shared_configs.spec import UNetSpec
from shared_configs.training.data import NUM_CLASSES, Dataset

SCHEDULES = ("linear", "cosine")


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


def _betas(kind: str, num_timesteps: int) -> np.ndarray:
    if kind == "linear":
        scale = 1000 / num_timesteps
        return np.linspace(scale * 1e-4, scale * 0.02, num_timesteps, dtype=np.float64)
    if kind == "cosine":
        s, steps = 0.008, np.arange(num_timesteps + 1, dtype=np.float64) / num_timesteps
        abar = np.cos((steps + s) / (1 + s) * np.pi / 2) ** 2
        return np.clip(1 - abar[1:] / abar[:-1], 0.0, 0.999)
    raise ValueError(f"schedule: unknown {kind!r} (allowed: {', '.join(SCHEDULES)})")


def _valid(betas: np.ndarray) -> bool:
    return bool(np.all((betas > 0) & (betas < 1)))


def make_schedule(kind: str = "linear", num_timesteps: int = 1000) -> Schedule:
    """``linear`` (Ho et al. 2020, scaled to T) or ``cosine`` (Nichol & Dhariwal 2021); a `ValueError` naming the
    smallest valid count where a beta falls outside (0, 1) (linear below 21 steps: it would train NaN)."""
    if num_timesteps < 1:
        raise ValueError(f"--timesteps {num_timesteps}: must be >= 1")
    betas = _betas(kind, num_timesteps)
    if not _valid(betas):
        smallest = next(n for n in range(num_timesteps + 1, 100_000) if _valid(_betas(kind, n)))
        raise ValueError(
            f"--timesteps {num_timesteps}: the {kind} schedule's betas reach {betas.max():.3g} but must "
            f"lie in (0, 1); the smallest valid value is {smallest}"
        )
    return Schedule(betas)


def check_objective(spec: UNetSpec) -> None:
    """Refuse a spec the noise-prediction MSE cannot train (its output must have the input's channels)."""
    if spec.out_channels != spec.in_channels:
        raise ValueError(
            f"out_channels: spec {spec.name!r} maps {spec.in_channels} input channels to "
            f"{spec.out_channels}; the noise-prediction objective needs out_channels == "
            "in_channels"
        )


def sample(
    eps_fn: Callable[[np.ndarray, np.ndarray, dict[str, np.ndarray | None]], np.ndarray],
    schedule: Schedule,
    dataset: Dataset,
    shape: tuple[int, int, int, int],
    num_steps: int,
    seed: int,
) -> np.ndarray:
    """Ancestral DDPM sampling over ``num_steps`` respaced timesteps (``eps_fn``: the noise), NCHW in [-1, 1]."""
    rng = np.random.default_rng([seed, 2**31])
    conditioning = dataset.conditioning(np.arange(shape[0]) % NUM_CLASSES)
    timesteps = np.unique(np.linspace(0, schedule.num_timesteps - 1, num_steps).round().astype(np.int64))[::-1]
    abar = schedule.alphas_cumprod
    x = rng.standard_normal(shape)
    for i, t in enumerate(timesteps):
        ab_t = abar[t]
        ab_prev = abar[timesteps[i + 1]] if i + 1 < len(timesteps) else 1.0
        beta = 1.0 - ab_t / ab_prev  # the respaced step's beta
        eps = eps_fn(x.astype(np.float32), np.full(shape[0], t, np.float32), conditioning).astype(np.float64)
        x = (x - beta / np.sqrt(1.0 - ab_t) * eps) / np.sqrt(1.0 - beta)
        if i + 1 < len(timesteps):
            x += np.sqrt(beta * (1.0 - ab_prev) / (1.0 - ab_t)) * rng.standard_normal(shape)
    return np.clip(x, -1.0, 1.0).astype(np.float32)
