"""Spec variants for the tests: `tiny` and random variants of it, the hub configs the presets equal,
random planner profiles, and the XLA options of a fast compile. Frameworks are not imported here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import yaml

from shared_configs import UNetSpec, spec_from_dict

# XLA:CPU spends seconds optimising each gradient program; these tests check values, not speed,
# so compile with backend optimisation off (about 4x faster; the computation is unchanged), and in
# one LLVM module (the split only runs codegen on more threads: two test processes fill two cores).
FAST_COMPILE = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
    "xla_cpu_parallel_codegen_split_count": 1,
}


def fast_xla_flags(*extra: str) -> str:
    """`FAST_COMPILE` as an ``XLA_FLAGS`` value, for compiles that take no options (and subprocesses)."""
    return " ".join([*(f"--{k}={str(v).lower()}" for k, v in FAST_COMPILE.items()), *extra])


TINY: dict[str, Any] = yaml.safe_load((Path(__file__).parents[2] / "shared_configs" / "tiny.yaml").read_text())

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
    "sdxl_style": {  # SDXL-like: text_time conditioning, no attention at level 0, per-level depth, linear proj
        "down_attention": ["none", "transformer"],
        "use_linear_projection": True,
        "transformer_layers_per_block": [1, 2],
        "attention_head_dim": None,
        "num_attention_heads": [2, 4],
        "addition_embedding": {"time_id_dim": 4, "input_dim": 30, "num_time_ids": 3},
    },
    "sd21_style": {  # SD 2.x-like, learned variance (out = 2 x in), heads x head_dim != channels (as diffusers rounds)
        "down_attention": ["transformer", "transformer"],
        "use_linear_projection": True,
        "attention_head_dim": [5, 10],
        "num_attention_heads": [3, 3],
        "out_channels": 8,
    },
    "class_cond": {  # class-conditional DDPM-style: a class table, inpainting-like 9 -> 4 channels, mid norm groups
        "in_channels": 9,
        "down_attention": ["self", "none"],
        "mid_attention": "self",
        "mid_attention_norm_groups": 8,
        "cross_attention_dim": None,
        "class_embedding": {"kind": "embedding", "num_classes": 10},
    },
    "class_timestep_concat": {  # class ids through sinusoids, concatenated with the time embedding
        "class_embedding": {"kind": "timestep", "concat": True},
        "resnet_time_scale_shift": "scale_shift",
    },
}


# Hub configs (unet/config.json as stored), which the presets of the same name must equal.
_DDPM_CIFAR10 = {
    "_class_name": "UNet2DModel",
    "_diffusers_version": "0.0.4",
    "act_fn": "silu",
    "attention_head_dim": None,
    "block_out_channels": [128, 256, 256, 256],
    "center_input_sample": False,
    "down_block_types": ["DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"],
    "downsample_padding": 0,
    "flip_sin_to_cos": False,
    "freq_shift": 1,
    "in_channels": 3,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-06,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 32,
    "time_embedding_type": "positional",
    "up_block_types": ["UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"],
}
_SD15 = {
    "_class_name": "UNet2DConditionModel",
    "_diffusers_version": "0.6.0",
    "act_fn": "silu",
    "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "out_channels": 4,
    "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
}


_SDXL = {  # stabilityai/stable-diffusion-xl-base-1.0 unet/config.json (the options that differ from defaults)
    "_class_name": "UNet2DConditionModel",
    "_diffusers_version": "0.19.0.dev0",
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256,
    "attention_head_dim": [5, 10, 20],
    "block_out_channels": [320, 640, 1280],
    "cross_attention_dim": 2048,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "projection_class_embeddings_input_dim": 2816,
    "sample_size": 128,
    "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "upcast_attention": None,
    "use_linear_projection": True,
    "addition_embed_type_num_heads": 64,
    "class_embed_type": None,
    "class_embeddings_concat": False,
    "mid_block_type": "UNetMidBlock2DCrossAttn",
    "time_embedding_type": "positional",
}
_SD21 = {  # stabilityai/stable-diffusion-2-1 unet/config.json
    "_class_name": "UNet2DConditionModel",
    "_diffusers_version": "0.10.0.dev0",
    "act_fn": "silu",
    "attention_head_dim": [5, 10, 20, 20],
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 1024,
    "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    "downsample_padding": 1,
    "dual_cross_attention": False,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "num_class_embeds": None,
    "only_cross_attention": False,
    "out_channels": 4,
    "sample_size": 96,
    "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3,
    "upcast_attention": True,
    "use_linear_projection": True,
}
HUB_CONFIGS: dict[str, dict[str, Any]] = {"ddpm_cifar10": _DDPM_CIFAR10, "sd15": _SD15, "sd21": _SD21, "sdxl": _SDXL}


def public_options(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json's constructor options (without ``_class_name`` and the like)."""
    return {k: v for k, v in config.items() if not k.startswith("_")}


def variant(name: str, **overrides: Any) -> UNetSpec:
    return spec_from_dict({**TINY, "name": name, **VARIANTS[name], **overrides})


def random_profile(spec: UNetSpec, seed: int, framework: str = "test") -> Any:
    """A `shared_configs.planning.budget.Profile` of ``spec`` with random per-unit figures (MiB scale,
    forward holds on recompute choices): for solver and CLI tests that need a profile but not a measurement."""
    from shared_configs.planning.budget import Cost, Profile
    from shared_configs.planning.units import CHOICES, PLAIN, block_layers, is_pseudo, segments

    mib = 2**20
    rng = np.random.default_rng(seed)
    holds = np.random.default_rng(seed + 1000)  # its own draws: the other figures stay as they were
    units: dict[str, dict[str, Cost]] = {}
    ends = [b for b, _ in segments(spec) if is_pseudo(b)]  # stem, head (and a ControlNet pair's own)
    names = ends[:1] + ends[-1:] + ends[1:-1] + [n for b, layers in block_layers(spec).items() for n in (b, *layers)]
    for name in names:
        block = name in block_layers(spec)
        choices = (PLAIN,) if is_pseudo(name) else CHOICES[1:] if block else CHOICES
        units[name] = {}
        for c in choices:
            keep = int(rng.integers(1, 40)) * mib // (4 if c != PLAIN else 1)
            peak = keep + int(rng.integers(0, 60)) * mib
            seconds = float(rng.uniform(0.1, 1.0)) * (c != PLAIN)
            # A recomputed unit may hold bytes to the forward's end (autocast's weight casts).
            hold = int(holds.integers(0, 8)) * mib // 4 * (c != PLAIN)
            fwd = int(peak * holds.uniform(0.5, 1.0))
            units[name][c] = Cost(keep, fwd, peak, seconds, 1e9 * seconds, hold=hold)
    return Profile(framework, spec.name, spec.sample_size, 2, units, opt_peak=20 * mib, step_time_s=1.0, scale=1.03)
