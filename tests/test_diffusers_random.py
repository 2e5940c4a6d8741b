"""No refusal of what diffusers builds: random configs over the supported block classes.

Each config is drawn from a seeded generator, built by diffusers' own constructor, randomised,
saved with ``save_pretrained`` and loaded back by both our frameworks, which must reproduce
diffusers' output to ‖a-b‖/‖b‖ ≤ 1e-5. The draws cover the settings diffusers derives from other
settings (a middle attention without GroupNorm under scale_shift, heads that do not divide the
channels, Attn*Block2D heads that differ from a transformer's at the same level) and every class
and text_time conditioning it builds.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import torch
from diffusers import UNet2DConditionModel, UNet2DModel

from jax_impl import diffusers_io as jax_io
from shared_configs import from_diffusers_config
from shared_configs.diffusers.folders import live_config
from shared_configs.inputs import example_inputs
from tests.helpers.diffusers_ref import diffusers_forward
from tests.helpers.specs import FAST_COMPILE
from tests.helpers.tensors import as_flax, as_torch, randomize_, rel_err
from torch_impl import UNet

TOL = 1e-5
SEEDS = {"UNet2DModel": range(6), "UNet2DConditionModel": range(7)}  # together: every derived setting
CASES = [(cls, seed) for cls, seeds in SEEDS.items() for seed in seeds]


def _choice(rng: np.random.Generator, options: list[Any]) -> Any:
    return options[int(rng.integers(len(options)))]


def _common(rng: np.random.Generator, down: list[str], up: list[str]) -> dict[str, Any]:
    """Options both classes share: widths, norms, time embedding, channels in and out."""
    n = len(down)
    groups = _choice(rng, [4, 8])
    in_channels = int(rng.integers(1, 10))
    return {
        "block_out_channels": [groups * int(k) for k in rng.integers(1, 5, n)],
        "norm_num_groups": groups,
        "down_block_types": down,
        "up_block_types": up,
        "layers_per_block": int(rng.integers(1, 3)),
        "sample_size": 2 ** (n - 1) * _choice(rng, [1, 2]),
        "in_channels": in_channels,
        "out_channels": _choice(rng, [in_channels, 2 * in_channels, 4]),  # same, learned variance, inpainting-like
        "norm_eps": _choice(rng, [1e-5, 1e-6]),
        "resnet_time_scale_shift": _choice(rng, ["default", "scale_shift"]),
        "downsample_padding": _choice(rng, [0, 1]),
        "mid_block_scale_factor": _choice(rng, [1, 1.4142]),
        "flip_sin_to_cos": _choice(rng, [True, False]),
        "freq_shift": _choice(rng, [0, 1]),
        "time_embedding_dim": _choice(rng, [None, 24]),
    }


def _pixel(rng: np.random.Generator) -> dict[str, Any]:
    n = int(rng.integers(2, 4))
    blocks = [_choice(rng, ["DownBlock2D", "AttnDownBlock2D"]) for _ in range(n)]
    up = [_choice(rng, ["UpBlock2D", "AttnUpBlock2D"]) for _ in range(n)]
    cfg = _common(rng, blocks, up)
    smallest = min(cfg["block_out_channels"])
    class_kind = _choice(rng, [None, "table", "timestep", "identity"])
    return cfg | {
        "attention_head_dim": _choice(rng, [None] + [d for d in (3, 4, 8) if d <= smallest]),
        "attn_norm_num_groups": _choice(rng, [None, None, cfg["norm_num_groups"], 2]),
        "add_attention": _choice(rng, [True, True, False]),
        "num_class_embeds": 6 if class_kind == "table" else None,
        "class_embed_type": class_kind if class_kind in ("timestep", "identity") else None,
    }


def _conditional(rng: np.random.Generator) -> dict[str, Any]:
    n = int(rng.integers(2, 4))
    down = [_choice(rng, ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "AttnDownBlock2D"])]
    down += [_choice(rng, ["DownBlock2D", "CrossAttnDownBlock2D", "AttnDownBlock2D"]) for _ in range(n - 1)]
    up = [_choice(rng, ["UpBlock2D", "CrossAttnUpBlock2D", "AttnUpBlock2D"]) for _ in range(n)]
    cfg = _common(rng, down, up)
    heads = [d for d in (1, 2, 3, 4) if d <= min(cfg["block_out_channels"])]
    text_time = bool(rng.integers(2))
    time_dim = _choice(rng, [4, 6])
    class_kind = _choice(rng, [None, "table", "timestep", "identity", "projection", "simple_projection"])
    return cfg | {
        "attention_head_dim": _choice(rng, [_choice(rng, heads), [_choice(rng, heads) for _ in range(n)]]),
        "cross_attention_dim": _choice(rng, [8, 12]),
        "transformer_layers_per_block": _choice(rng, [1, 2, [int(d) for d in rng.integers(1, 3, n)]]),
        "use_linear_projection": _choice(rng, [True, False]),
        "upcast_attention": _choice(rng, [True, False]),
        "num_class_embeds": 6 if class_kind == "table" else None,
        "class_embed_type": None if class_kind in (None, "table") else class_kind,
        # concatenated class embeddings cannot meet text_time (diffusers fails in the forward)
        "class_embeddings_concat": class_kind is not None and not text_time and bool(rng.integers(2)),
        "addition_embed_type": "text_time" if text_time else None,
        "addition_time_embed_dim": time_dim if text_time else None,
        "projection_class_embeddings_input_dim": int(rng.integers(2, 9)) + 6 * time_dim,
    }


CLASSES = {"UNet2DModel": (UNet2DModel, _pixel), "UNet2DConditionModel": (UNet2DConditionModel, _conditional)}


@pytest.fixture(scope="module", params=CASES, ids=[f"{c}-{s}" for c, s in CASES])
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A random diffusers model saved to a folder, all the inputs it takes, and its output."""
    cls, seed = request.param
    model_cls, draw = CLASSES[cls]
    config = draw(np.random.default_rng(seed))
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' notes on defaults, our upcast_attention note
        model = model_cls(**config).eval()
        spec = from_diffusers_config(live_config(model))
    randomize_(model, seed=seed, scale=0.1)
    folder = tmp_path_factory.mktemp(f"{cls}-{seed}")
    model.save_pretrained(folder)
    inputs = example_inputs(spec, np.random.default_rng(seed), batch=2, context_len=3)
    ref = diffusers_forward(model, as_torch(inputs)).numpy()
    assert np.abs(ref).mean() > 1e-2  # a live signal
    return {"config": config, "folder": folder, "inputs": inputs, "ref": ref}


def _load(load: Any, folder: Path) -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "upcast_attention")
        return load(folder)


def test_torch_loads_and_matches(case: dict[str, Any]) -> None:
    ours = _load(UNet.from_diffusers, case["folder"])
    with torch.no_grad():
        out = ours(**as_torch(case["inputs"])).numpy()
    assert rel_err(out, case["ref"]) <= TOL, case["config"]


@pytest.mark.slow_for(  # 2-7 s each; the -1 cases stay in the inner loop
    *(f"UNet2DModel-{i}" for i in (0, 2, 3, 4, 5)), *(f"UNet2DConditionModel-{i}" for i in (0, 2, 3, 4, 5, 6))
)
def test_flax_loads_and_matches(case: dict[str, Any]) -> None:
    module, params = _load(jax_io.from_diffusers, case["folder"])
    inputs = as_flax(case["inputs"])
    apply = jax.jit(module.apply).lower({"params": params}, **inputs).compile(FAST_COMPILE)
    out = np.asarray(apply({"params": params}, **inputs)).transpose(0, 3, 1, 2)
    assert rel_err(out, case["ref"]) <= TOL, case["config"]


def test_draws_cover_the_derived_settings() -> None:
    """The draws above really include the cases diffusers derives (else this file proves little)."""
    specs = []
    for cls, seed in CASES:
        model_cls, draw = CLASSES[cls]
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            specs.append(from_diffusers_config(live_config(model_cls(**draw(np.random.default_rng(seed))))))
    assert any(s.mid_attention_norm_groups == 0 for s in specs)  # middle attention without GroupNorm
    assert any(s.attention_head_dim is not None and s.num_attention_heads is not None for s in specs)  # rounding
    assert any(s.block_heads for s in specs)  # Attn*Block2D heads beside a transformer's
    assert {s.class_embedding.kind for s in specs if s.class_embedding} >= {"embedding", "timestep", "identity"}
    assert any(s.addition_embedding for s in specs) and any(s.in_channels != s.out_channels for s in specs)
