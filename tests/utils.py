"""Shared test helpers: tiny spec variants, deterministic weights, relative errors, torchrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from shared_configs import UNetSpec, spec_from_dict
from shared_configs.training import TrainConfig

# XLA:CPU spends seconds optimising each gradient program; these tests check values, not speed,
# so compile with backend optimisation off (about 4x faster; the computation is unchanged).
FAST_COMPILE = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}

TINY: dict[str, Any] = yaml.safe_load((Path(__file__).parents[1] / "shared_configs" / "tiny.yaml").read_text())

# Random variants of `tiny` that together exercise every architectural option.
VARIANTS: dict[str, dict[str, Any]] = {
    "tiny": {},
    "ddpm_style": {  # UNet2DModel-like: self-attention only, no context, DDPM padding/time options
        "down_attention": ["none", "self"],
        "mid_attention": "self",
        "cross_attention_dim": None,
        "resnet_time_scale_shift": "scale_shift",
        "downsample_padding": 0,
        "mid_block_scale_factor": 1.4142,
        "time_embedding": {"flip_sin_to_cos": False, "freq_shift": 1},
    },
    "sd_linear_proj": {  # SD2-like: linear projections, per-level transformer depth (as SDXL), explicit heads
        "down_attention": ["transformer", "transformer"],
        "use_linear_projection": True,
        "transformer_layers_per_block": [1, 2],
        "attention_head_dim": None,
        "num_attention_heads": [2, 4],
        "layers_per_block": 2,
    },
    "transformer_no_cross": {  # transformer blocks without cross-attention, asymmetric up path
        "block_out_channels": [8, 16, 24],
        "norm_num_groups": 8,
        "cross_attention_dim": None,
        "down_attention": ["none", "transformer", "transformer"],
        "up_attention": ["transformer", "self", "none"],
        "mid_attention": "none",
        "attention_scale": 0.3,
        "sample_size": 8,
        "dropout": 0.0,
    },
}


def variant(name: str, **overrides: Any) -> UNetSpec:
    return spec_from_dict({**TINY, "name": name, **VARIANTS[name], **overrides})


def rel_err(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def randomize_(model: Any, seed: int = 0, scale: float = 0.2) -> None:
    """Perturb every torch parameter (norm scales and biases too) so no layout mistake hides."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))


def train_argv(cfg: TrainConfig) -> list[str]:
    """The ``torch_impl.train`` flags that reproduce ``cfg`` (each field is a flag of the same name)."""
    argv: list[str] = []
    for f in fields(cfg):
        value, flag = getattr(cfg, f.name), "--" + f.name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    return argv


def torchrun_train(cfg: TrainConfig, nproc: int = 2, timeout: float = 300) -> list[float]:
    """``torchrun -m torch_impl.train`` on ``nproc`` CPU processes, one thread each; the losses it wrote.

    The launcher runs in its own session, killed as a group on timeout: no rank outlives the test.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "torch_impl.train", *train_argv(cfg)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:  # fmt: skip
        try:
            _, err = proc.communicate(timeout=timeout)
        except BaseException:  # the timeout, or the test run interrupted
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0, err[-2000:]
    return json.loads((Path(cfg.out) / "losses.json").read_text())


def random_profile(spec: UNetSpec, seed: int, framework: str = "test") -> Any:
    """A `shared_configs.budget.Profile` of ``spec`` with random per-unit figures (MiB scale):
    for solver and CLI tests that need a profile but not a measurement."""
    from shared_configs.budget import CHOICES, PLAIN, Cost, Profile, block_layers, is_pseudo

    mib = 2**20
    rng = np.random.default_rng(seed)
    units: dict[str, dict[str, Cost]] = {}
    names = ["stem", "head"] + [n for b, layers in block_layers(spec).items() for n in (b, *layers)]
    for name in names:
        block = name in block_layers(spec)
        choices = (PLAIN,) if is_pseudo(name) else CHOICES[1:] if block else CHOICES
        units[name] = {}
        for c in choices:
            keep = int(rng.integers(1, 40)) * mib // (4 if c != PLAIN else 1)
            peak = keep + int(rng.integers(0, 60)) * mib
            seconds = float(rng.uniform(0.1, 1.0)) * (c != PLAIN)
            units[name][c] = Cost(keep, peak // 2, peak, seconds, 1e9 * seconds)
    return Profile(framework, spec.name, spec.sample_size, 2, units, opt_peak=20 * mib, step_time_s=1.0, scale=1.03)
