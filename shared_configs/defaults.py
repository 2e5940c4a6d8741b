"""One set of defaults per device (attention, dtype, context length, timed steps, JAX compilation cache) for
every tool and library call, each printing what it used (`Defaults.describe`): a step benchmarked with one tool
is the step another plans or trains. A tool that knows its device only inside a framework's process passes the
attention chunk as ``"auto"`` and resolves it there (`resolve_chunk`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from shared_configs.cli import cache_dir, nonnegative

DEVICES: tuple[str, ...] = ("cpu", "gpu")
AUTO = "auto"
# Queries per attention chunk where XLA's attention is unfused (XLA:CPU): sd_narrow's 16x16 attention
# (256 tokens) in 4 chunks, each recomputed in the backward instead of keeping its scores. On GPU
# XLA's own attention (None).
CPU_ATTENTION_CHUNK = 64
# UNET_REMAT_JAX_CACHE: another folder for JAX's persistent compilation cache, or "none" (the tests
# turn it off: a cache hit compiles nothing, so an XLA dump a test reads would be missing).
JAX_CACHE_ENV = "UNET_REMAT_JAX_CACHE"
FIELDS: tuple[str, ...] = ("attention_chunk", "dtype", "context_length", "steps", "jax_cache")


@dataclass(frozen=True)
class Defaults:
    """What a tool uses when not told otherwise, on one device."""

    device: str  # "cpu" or "gpu"
    attention_chunk: int | None  # JAX: queries per attention chunk (UNet(attention_chunk)); None: unchunked
    dtype: str = "float32"  # the forward's compute dtype ("bfloat16": mixed precision)
    context_length: int = 77  # cross-attention tokens of a benchmarked or planned step (CLIP's 77)
    steps: int = 3  # timed steps per policy after a warm-up (a measured row; plan --verify)
    jax_cache: str | None = None  # JAX's persistent compilation cache folder; None: off

    def describe(self, fields: tuple[str, ...] = FIELDS) -> str:
        """One line naming ``fields`` as used, e.g. for a tool's stderr or its header."""
        text = {
            "attention_chunk": f"jax attention {chunk_text(self.attention_chunk)}",
            "dtype": self.dtype,
            "context_length": f"context {self.context_length} tokens",
            "steps": f"{self.steps} timed step{'s' * (self.steps != 1)}",
            "jax_cache": f"jax compilation cache {self.jax_cache or 'off'}",
        }
        return f"{self.device}: " + ", ".join(text[f] for f in fields)


def jax_cache_dir() -> str | None:
    """The persistent compilation cache folder: ``$UNET_REMAT_JAX_CACHE`` ("none": off), else under XDG's cache."""
    if (chosen := os.environ.get(JAX_CACHE_ENV)) is not None:
        return cache_dir(chosen)
    return str(Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "unet-remat" / "jax")


def defaults(device: str) -> Defaults:
    """The defaults on ``device`` ("cpu" or "gpu")."""
    if device not in DEVICES:
        raise ValueError(f"device: expected one of {', '.join(DEVICES)}, got {device!r}")
    return Defaults(
        device=device, attention_chunk=CPU_ATTENTION_CHUNK if device == "cpu" else None, jax_cache=jax_cache_dir()
    )


def device_of(platform: str) -> str:
    """A JAX or torch device's platform ("cpu", "cuda", "gpu", "rocm") as a `DEVICES` name."""
    return "cpu" if platform == "cpu" else "gpu"


def resolve_chunk(chunk: int | str | None, device: str) -> int | None:
    """An attention-chunk setting as used on ``device``: ``"auto"`` is the device's default."""
    return defaults(device).attention_chunk if chunk == AUTO else chunk  # type: ignore[return-value]


def chunk_text(chunk: int | str | None) -> str:
    if chunk == AUTO:
        return f"auto ({CPU_ATTENTION_CHUNK} queries per chunk on CPU, unchunked on GPU)"
    return f"query-chunked, {chunk} queries per chunk" if chunk else "unchunked"


def chunk_arg(text: str) -> int | str | None:
    """An argparse type: ``auto`` (the device's default), 0 (unchunked) or queries per chunk."""
    if text == AUTO:
        return AUTO
    try:
        return nonnegative(int)(text) or None
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected auto, 0 (unchunked) or a number of queries, got {text!r}") from None


CHUNK_HELP = (
    f"jax: compute attention N queries at a time, each chunk rematerialised (UNet(attention_chunk=N)); auto "
    f"(default): {CPU_ATTENTION_CHUNK} on CPU, where XLA's attention is unfused, off on GPU; 0: unchunked"
)
