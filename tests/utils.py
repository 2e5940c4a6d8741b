"""Shared test helpers: tiny spec variants, deterministic weights, relative errors, torchrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from shared_configs import UNetSpec, spec_from_dict
from shared_configs.training.config import TrainConfig, flags_of

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
    "_class_name": "UNet2DModel", "_diffusers_version": "0.0.4", "act_fn": "silu", "attention_head_dim": None,
    "block_out_channels": [128, 256, 256, 256], "center_input_sample": False,
    "down_block_types": ["DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"], "downsample_padding": 0,
    "flip_sin_to_cos": False, "freq_shift": 1, "in_channels": 3, "layers_per_block": 2, "mid_block_scale_factor": 1,
    "norm_eps": 1e-06, "norm_num_groups": 32, "out_channels": 3, "sample_size": 32, "time_embedding_type": "positional",
    "up_block_types": ["UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"],
}  # fmt: skip
_SD15 = {
    "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.6.0", "act_fn": "silu", "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280], "center_input_sample": False, "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4, "layers_per_block": 2,
    "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32, "out_channels": 4, "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
}  # fmt: skip


_SDXL = {  # stabilityai/stable-diffusion-xl-base-1.0 unet/config.json (the options that differ from defaults)
    "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.19.0.dev0", "addition_embed_type": "text_time",
    "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20], "block_out_channels": [320, 640, 1280],
    "cross_attention_dim": 2048, "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "projection_class_embeddings_input_dim": 2816, "sample_size": 128, "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], "upcast_attention": None,
    "use_linear_projection": True, "addition_embed_type_num_heads": 64, "class_embed_type": None,
    "class_embeddings_concat": False, "mid_block_type": "UNetMidBlock2DCrossAttn", "time_embedding_type": "positional",
}  # fmt: skip
_SD21 = {  # stabilityai/stable-diffusion-2-1 unet/config.json
    "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.10.0.dev0", "act_fn": "silu",
    "attention_head_dim": [5, 10, 20, 20], "block_out_channels": [320, 640, 1280, 1280], "center_input_sample": False,
    "cross_attention_dim": 1024, "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
    "downsample_padding": 1, "dual_cross_attention": False, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4,
    "layers_per_block": 2, "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32,
    "num_class_embeds": None, "only_cross_attention": False, "out_channels": 4, "sample_size": 96,
    "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3, "upcast_attention": True,
    "use_linear_projection": True,
}  # fmt: skip
HUB_CONFIGS: dict[str, dict[str, Any]] = {"ddpm_cifar10": _DDPM_CIFAR10, "sd15": _SD15, "sd21": _SD21, "sdxl": _SDXL}


def public_options(config: dict[str, Any]) -> dict[str, Any]:
    """A config.json's constructor options (without ``_class_name`` and the like)."""
    return {k: v for k, v in config.items() if not k.startswith("_")}


def variant(name: str, **overrides: Any) -> UNetSpec:
    return spec_from_dict({**TINY, "name": name, **VARIANTS[name], **overrides})


def rel_err(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def as_torch(inputs: dict[str, Any]) -> dict[str, Any]:
    """`shared_configs.inputs.example_inputs` (NCHW numpy) -> torch tensors, by name (None kept)."""
    import torch

    return {k: None if v is None else torch.from_numpy(v) for k, v in inputs.items()}


def as_flax(inputs: dict[str, Any]) -> dict[str, Any]:
    """`shared_configs.inputs.example_inputs` (NCHW numpy) -> jax arrays with x in NHWC, by name (None kept)."""
    import jax.numpy as jnp

    out = {k: None if v is None else jnp.asarray(v) for k, v in inputs.items()}
    out["x"] = jnp.asarray(inputs["x"].transpose(0, 2, 3, 1))
    return out


def diffusers_forward(model: Any, inputs: dict[str, Any]) -> Any:
    """A diffusers ``UNet2DModel`` / ``UNet2DConditionModel`` on our named torch inputs (`as_torch`), no grad."""
    import torch

    kwargs: dict[str, Any] = {"class_labels": inputs.get("class_labels")}
    if type(model).__name__ == "UNet2DConditionModel":
        kwargs["encoder_hidden_states"] = inputs.get("context")
        if inputs.get("text_embeds") is not None:
            kwargs["added_cond_kwargs"] = {"text_embeds": inputs["text_embeds"], "time_ids": inputs["time_ids"]}
        if inputs.get("image_embeds") is not None:
            kwargs["added_cond_kwargs"] = {"image_embeds": inputs["image_embeds"]}
        for name in ("timestep_cond", "encoder_attention_mask"):
            kwargs[name] = inputs.get(name)
    with torch.no_grad():
        return model(inputs["x"], inputs["t"], **kwargs).sample


def randomize_(model: Any, seed: int = 0, scale: float = 0.2) -> None:
    """Perturb every torch parameter (norm scales and biases too) so no layout mistake hides."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))


def run_compare(args: list[str], out: Path, **env: str) -> tuple[subprocess.CompletedProcess, dict[str, Any] | None]:
    """``python -m benchmarks.compare ARGS --out OUT`` (LLVM at -O0: compile time halves, buffer
    assignment comes before code generation, so memory figures do not change; torch on one thread,
    as tests/conftest.py sets in-process; no JAX compilation cache); the process and the JSON document it wrote."""
    environ = {**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0", "OMP_NUM_THREADS": "1", **env}
    cmd = [sys.executable, "-m", "benchmarks.compare", *args, "--out", str(out), "--jax-cache", "none"]
    proc = subprocess.run(cmd, cwd=Path(__file__).parents[1], env=environ, capture_output=True, text=True, timeout=600)
    files = sorted(out.glob("*.json"))
    return proc, json.loads(files[-1].read_text()) if files else None


def rows_of(doc: dict[str, Any], framework: str) -> dict[str, dict[str, Any]]:
    """A compare document's rows of one framework, by policy."""
    return {r["policy"]: r for r in doc["rows"] if r["framework"] == framework}


def train_argv(cfg: TrainConfig) -> list[str]:
    """The ``{torch_impl,jax_impl}.train`` flags that reproduce ``cfg`` (each flag is named as its
    field, the regime's and the framework's own options' flattened in; options None: none given)."""
    argv: list[str] = []
    for name, value in flags_of(cfg).items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    return argv


def torchrun_train(cfg: TrainConfig, nproc: int = 2, timeout: float = 300) -> list[float]:
    """``torchrun -m torch_impl.train`` on ``nproc`` CPU processes, one thread each; the losses it wrote.

    The launcher leads its own process group (`start_new_session`), killed whole on timeout: no rank outlives the test.
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
    """A `shared_configs.planning.budget.Profile` of ``spec`` with random per-unit figures (MiB scale,
    forward holds on recompute choices): for solver and CLI tests that need a profile but not a measurement."""
    from shared_configs.planning.budget import CHOICES, PLAIN, Cost, Profile, block_layers, is_pseudo
    from shared_configs.planning.units import segments

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


def count_flops(model: Any, inputs: tuple, backward: bool) -> tuple[int, dict[str, int]]:
    """FLOPs of ``model(*inputs)`` (and of ``.sum().backward()``), total and per module, named by
    path below ``model`` (``down.0``, ...). CPU attention counted too (`torch_impl.flops`)."""
    from torch.utils.flop_counter import FlopCounterMode

    from torch_impl.flops import register_cpu_attention_flops

    register_cpu_attention_flops()
    with FlopCounterMode(display=False) as counter:
        out = model(*inputs)
        if backward:
            out.sum().backward()
    root = type(model).__name__ + "."
    per_module = {k.removeprefix(root): sum(v.values()) for k, v in counter.get_flop_counts().items()}
    return counter.get_total_flops(), per_module
