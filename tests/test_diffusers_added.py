"""diffusers' LCM, attention-mask and Kandinsky 2.2 options in both frameworks, diffusers the reference.

Tiny random diffusers models are saved with ``save_pretrained`` and loaded back by both frameworks:
outputs within 1e-5 (torch) and 1e-4 (Flax) of diffusers' (‖a-b‖/‖b‖), parameter counts equal,
exported back to a folder diffusers reads. Gradients under checkpoint plans equal the plain model's,
in both frameworks and on diffusers' own model.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import UNet2DConditionModel

import jax_impl
from jax_impl.diffusers_io import to_diffusers_state_dict
from shared_configs import SpecError, UNetSpec, from_diffusers_config, to_diffusers_config
from shared_configs.controlnet import load_controlnet_spec
from shared_configs.inputs import example_inputs
from tests.helpers.diffusers_ref import diffusers_forward
from tests.helpers.policies import (
    LossAndGrads,
    assert_plans_keep_loss_and_grads,
    jax_loss_and_grads,
    torch_loss_and_grads,
)
from tests.helpers.tensors import as_flax, as_torch, randomize_, rel_err
from torch_impl import UNet, apply_plan

TINY = {
    "_class_name": "UNet2DConditionModel",
    "block_out_channels": [32, 64],
    "norm_num_groups": 8,
    "layers_per_block": 1,
    "sample_size": 8,
    "cross_attention_dim": 32,
}
CONFIGS: dict[str, dict[str, Any]] = {
    # LCM: SD-style transformers, the guidance embedding projected onto the timestep sinusoids
    "lcm": {
        **TINY,
        "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
        "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
        "attention_head_dim": 2,
        "time_cond_proj_dim": 6,
    },
    # a masked, projected text context (encoder_hid_dim: text_proj) over transformers
    "mask": {
        **TINY,
        "down_block_types": ["CrossAttnDownBlock2D"] * 2,
        "up_block_types": ["CrossAttnUpBlock2D"] * 2,
        "attention_head_dim": 4,
        "encoder_hid_dim": 12,
        "use_linear_projection": True,
    },
    # Kandinsky 2.2's decoder: image conditioning, ResNet resamplers, SimpleCrossAttn blocks, scale/shift
    "kandinsky": {
        **TINY,
        "out_channels": 8,
        "down_block_types": ["ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"],
        "up_block_types": ["SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"],
        "mid_block_type": "UNetMidBlock2DSimpleCrossAttn",
        "attention_head_dim": 16,
        "encoder_hid_dim": 24,
        "encoder_hid_dim_type": "image_proj",
        "addition_embed_type": "image",
        "resnet_time_scale_shift": "scale_shift",
        "cross_attention_norm": "group_norm",
        "resnet_skip_time_act": True,
        "resnet_out_scale_factor": 2.0,
    },
}
CONTEXT = 5


def _inputs(spec: UNetSpec) -> dict[str, np.ndarray | None]:
    """Example inputs, every new one present, with a mask dropping a context token of each sample."""
    inputs = example_inputs(spec, np.random.default_rng(1), batch=2, context_len=CONTEXT)
    img = spec.image_embedding
    tokens = img.context_tokens if img is not None and img.context_tokens else CONTEXT
    if spec.reads_context:
        mask = np.ones((2, tokens), np.float32)
        mask[0, -1] = mask[1, 1] = 0.0
        inputs["encoder_attention_mask"] = mask
    return inputs


@pytest.fixture(scope="module", params=list(CONFIGS))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    torch.manual_seed(0)
    theirs = UNet2DConditionModel(**{k: v for k, v in CONFIGS[request.param].items() if k != "_class_name"}).eval()
    randomize_(theirs, seed=2)
    folder = tmp_path_factory.mktemp(request.param)
    theirs.save_pretrained(folder)
    spec = from_diffusers_config(CONFIGS[request.param])
    inputs = _inputs(spec)
    return {"theirs": theirs, "folder": folder, "inputs": inputs, "ref": diffusers_forward(theirs, as_torch(inputs))}


@pytest.mark.slow_for("lcm", "mask")  # Kandinsky's case, with every new layer, stays in the inner loop
def test_both_frameworks_load_and_match_diffusers(saved: dict[str, Any], tmp_path: Path) -> None:
    ours = UNet.from_diffusers(saved["folder"])
    with torch.no_grad():
        out = ours(**as_torch(saved["inputs"]))
    assert rel_err(out, saved["ref"]) <= 1e-5
    module, params = jax_impl.from_diffusers(saved["folder"])
    flax_out = jax.jit(module.apply)({"params": params}, **as_flax(saved["inputs"]))
    assert rel_err(np.asarray(flax_out).transpose(0, 3, 1, 2), saved["ref"]) <= 1e-4
    count = sum(p.numel() for p in saved["theirs"].parameters())
    assert sum(p.numel() for p in ours.parameters()) == count == sum(x.size for x in jax.tree.leaves(params))
    # export: our folder is diffusers' model again; Flax's parameters are its state_dict
    back = UNet2DConditionModel.from_pretrained(ours.save_diffusers(tmp_path / "ours")).eval()
    assert rel_err(diffusers_forward(back, as_torch(saved["inputs"])), saved["ref"]) <= 1e-6
    back.load_state_dict(to_diffusers_state_dict(params, module.resolved_spec), strict=True)


def _torch_step(model: torch.nn.Module, inputs: dict[str, Any], diffusers: bool = False) -> LossAndGrads:
    forward = model
    if diffusers:
        kwargs = {
            "encoder_hidden_states": inputs["context"],
            "timestep_cond": inputs.get("timestep_cond"),
            "encoder_attention_mask": inputs["encoder_attention_mask"],
            "added_cond_kwargs": {"image_embeds": inputs["image_embeds"]},
        }
        inputs = {"x": inputs["x"], "t": inputs["t"]}

        def forward(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return model(x, t, **kwargs).sample

    wrt = dict(model.named_parameters())
    return torch_loss_and_grads(forward, inputs, loss=lambda out: out.square().mean(), wrt=wrt)


# Kandinsky-style with a Transformer2D middle block: every new layer kind, the mask through both attentions
PLANNED = {**CONFIGS["kandinsky"], "mid_block_type": "UNetMidBlock2DCrossAttn", "time_cond_proj_dim": 6}


def test_plans_leave_gradients_unchanged_in_torch_and_on_diffusers() -> None:
    spec = from_diffusers_config(PLANNED)
    torch.manual_seed(0)
    ours = UNet(spec)
    randomize_(ours, seed=4)
    inputs = as_torch(_inputs(spec))

    def ours_step(policy: str) -> LossAndGrads:
        ours.enable_gradient_checkpointing(policy)
        return _torch_step(ours, inputs)

    assert_plans_keep_loss_and_grads(ours_step, ("full", "layers", "down.0,up.1;mid,down.1/save=conv+matmul"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = UNet2DConditionModel.from_config(to_diffusers_config(spec))
    theirs.load_state_dict(ours.to_diffusers_state_dict(), strict=True)

    def theirs_step(policy: str) -> LossAndGrads:
        if policy != "none":
            apply_plan(theirs, policy)
        return _torch_step(theirs, inputs, diffusers=True)

    assert_plans_keep_loss_and_grads(theirs_step, ["layers"])  # bit for bit, both


@pytest.mark.slow
def test_plans_leave_gradients_unchanged_in_flax() -> None:
    spec = from_diffusers_config(PLANNED)
    inputs = as_flax(_inputs(spec))
    params = jax_impl.UNet(spec=spec).init(jax.random.key(0), **inputs)

    def step(policy: str) -> LossAndGrads:
        model = jax_impl.UNet(spec=spec, policy=policy)
        return jax_loss_and_grads(lambda p: jnp.mean(model.apply(p, **inputs) ** 2), params)

    # every layer its own remat (the blocks' own recompute is the same transform, tested on `tiny`)
    assert_plans_keep_loss_and_grads(step, ["layers"], tol=1e-5)


SPEC_BASE = {
    "name": "s",
    "in_channels": 4,
    "out_channels": 4,
    "sample_size": 8,
    "block_out_channels": [32, 64],
    "norm_num_groups": 8,
    "down_attention": ["none", "simple_cross"],
    "cross_attention_dim": 32,
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cross_attention_dim": None}, "cross_attention_dim: required by simple_cross"),
        ({"resnet_out_scale_factor": 2.0}, "resnet_out_scale_factor: only read with resampler: resnet"),
        (
            {"down_attention": ["none", "none"], "mid_attention": "none", "context_norm_groups": 32},
            "context_norm_groups: only read by simple_cross",
        ),
        ({"context_proj_dim": 8, "image_embedding": {"input_dim": 8}}, "context_proj_dim: cannot be combined"),
        ({"image_embedding": {"input_dim": 8, "add_to_time": False, "context_tokens": None}}, "neither used"),
    ],
)
def test_spec_refuses_options_nothing_reads(change: dict[str, Any], message: str) -> None:
    from shared_configs.loader import spec_from_dict

    with pytest.raises(SpecError, match=message):
        spec_from_dict({**SPEC_BASE, **change})


def test_inputs_and_controlnet_refuse_in_one_line() -> None:
    from shared_configs.loader import spec_from_dict

    spec = from_diffusers_config(CONFIGS["kandinsky"])
    model = UNet(spec)
    good = as_torch(_inputs(spec))
    for bad, message in [
        ({"image_embeds": None}, "image_embeds: spec .* has image conditioning; pass image_embeds"),
        ({"context": torch.zeros(2, 3, 32)}, "context: spec .* makes it from image_embeds"),
        ({"encoder_attention_mask": torch.ones(2, 3)}, r"encoder_attention_mask: expected shape \(2, 32\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            model(**{**good, **bad})
    plain = spec_from_dict({**SPEC_BASE, "down_attention": ["none", "self"], "cross_attention_dim": None})
    with pytest.raises(ValueError, match="encoder_attention_mask: spec 's' has no attention over a context"):
        UNet(plain)(torch.zeros(1, 4, 8, 8), 1.0, encoder_attention_mask=torch.ones(1, 3))
    with pytest.raises(SpecError, match=r"unet\.image_embedding: not supported in a ControlNet"):
        load_controlnet_spec({"unet": spec})
