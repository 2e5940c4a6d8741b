"""The flags only ``python -m jax_impl.train`` has, and what they resolve to on the run's device.

`JaxOptions` is the JAX side's `shared_configs.training.config.Options`: the attention chunk, the
persistent compilation cache, and the launch over several processes (`jax_impl.processes`).
`CLI` registers them with the shared training CLI; `on_device` resolves them where the run trains.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, replace

import jax

from jax_impl import processes
from shared_configs.cli import cache_dir
from shared_configs.defaults import AUTO, CHUNK_HELP, chunk_arg, jax_cache_dir, resolve_chunk
from shared_configs.training.config import FrameworkCLI, TrainConfig, options_of, used


@dataclass(frozen=True)
class JaxOptions:
    """The flags only ``jax_impl.train`` has (`shared_configs.training.config.Options`): torch's CPU
    attention is fused already (nothing to chunk), torch keeps no XLA cache, and torchrun launches
    torch's processes (JAX's join with `jax.distributed`)."""

    # UNet(attention_chunk=...); "auto": the device's (`shared_configs.defaults`), resolved by `on_device`
    attention_chunk: int | str | None = AUTO
    jax_cache: str | None = field(default_factory=jax_cache_dir)  # the persistent compilation cache; None: off
    coordinator: str | None = None  # jax.distributed (`jax_impl.processes`); the three None: detected, else one process
    num_processes: int | None = None
    process_id: int | None = None

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        d = cls()
        parser.add_argument("--attention-chunk", type=chunk_arg, default=d.attention_chunk, metavar="N",
                            help=CHUNK_HELP)  # fmt: skip
        parser.add_argument("--jax-cache", type=cache_dir, default=d.jax_cache or "none", metavar="DIR",
                            help="JAX's persistent compilation cache folder (%(default)s; 'none': off)")  # fmt: skip
        processes.add_flags(parser)

    def check(self, cfg: TrainConfig) -> None:
        processes.check_flags(self.coordinator, self.num_processes, self.process_id, cfg.distributed)


CLI = FrameworkCLI("jax", JaxOptions, rank=processes.process_rank)


def run_settings(cfg: TrainConfig, device: str) -> str:
    """What the run uses on ``device`` (`shared_configs.training.config.used`): its attention chunk,
    dtype and compilation cache."""
    own = options_of(cfg, JaxOptions)
    return used(cfg, device, attention_chunk=resolve_chunk(own.attention_chunk, device), jax_cache=own.jax_cache)


def on_device(cfg: TrainConfig, device: str) -> tuple[TrainConfig, JaxOptions]:
    """``cfg`` with its attention chunk resolved on ``device`` ("auto": this device's; the plan
    profiles it too), and its options; JAX's compilation cache turned on where it names one."""
    own = options_of(cfg, JaxOptions)
    own = replace(own, attention_chunk=resolve_chunk(own.attention_chunk, device))
    if own.jax_cache is not None:  # a repeated run loads its compiled steps
        jax.config.update("jax_compilation_cache_dir", own.jax_cache)
    return replace(cfg, options=own), own
