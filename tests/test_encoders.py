"""The models beside the U-Net (`shared_configs.planning.encoders`, `torch_impl.encoders`): their
bytes from shapes against PyTorch's own MemTracker on real tensors of small configs, their
parameter counts against the models diffusers and transformers build from the same configs, a
trained one's Adafactor state against a real Adafactor step, and the whole step's arithmetic
(`whole_step`) term by term."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from shared_configs import load_spec
from shared_configs.planning import encoders as enc
from shared_configs.planning import whole
from shared_configs.planning.budget import predict
from shared_configs.planning.pipeline import CACHE_ENV, Workload
from shared_configs.regime import Regime
from shared_configs.spec import SpecError
from tests.helpers.specs import random_profile
from torch_impl import encoders as torch_encoders
from torch_impl.encoders import build, measure
from torch_impl.memory import memtracker
from torch_impl.profile import ShapesOnly
from torch_impl.regime import DTYPE

VAE = {
    **enc.VAE,
    "block_out_channels": [8, 16],
    "norm_num_groups": 4,
    "down_block_types": ["DownEncoderBlock2D"] * 2,
    "up_block_types": ["UpDecoderBlock2D"] * 2,
    "layers_per_block": 1,
}
CLIP = {
    **enc.CLIP_L,
    "vocab_size": 100,
    "max_position_embeddings": 16,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}
SMALL = [
    enc.Encoder("vae", "vae", json.dumps(VAE), "float32", image_size=32),
    enc.Encoder("text_encoder", "clip", json.dumps(CLIP), "float32", tokens=16),
    enc.Encoder("text_encoder", "clip", json.dumps(CLIP), "float32", trained=True, tokens=16),
]


def _real(encoder: enc.Encoder) -> torch.nn.Module:
    """The same model on real tensors (the fake one's weights made real: same shapes, same dtype)."""
    torch.manual_seed(0)
    model = build(encoder, ShapesOnly())
    for module in model.modules():
        for name, t in module._parameters.items():
            module._parameters[name] = torch.nn.Parameter(torch.randn(t.shape, dtype=t.dtype), t.requires_grad)
    return model


@pytest.mark.slow  # diffusers and transformers imported, three small models run
@pytest.mark.parametrize("encoder", SMALL, ids=["vae", "text", "text-trained"])
def test_bytes_from_shapes_as_memtracker_sees_the_real_run(encoder: enc.Encoder) -> None:
    found = measure(encoder, 2)
    model = _real(encoder)
    if encoder.kind == "vae":
        x = torch.randn(2, 3, encoder.image_size, encoder.image_size, dtype=DTYPE[encoder.dtype])
    else:
        x = torch.zeros(2, encoder.tokens, dtype=torch.long)
    assert found["params"] == sum(p.numel() for p in model.parameters())
    with memtracker(model, [], inputs=[x]) as tracked, torch.set_grad_enabled(encoder.trained):
        out = model.encode(x).latent_dist.sample() if encoder.kind == "vae" else model(x).last_hidden_state
        if encoder.trained:
            out.sum().backward()
    above = tracked["peak"] - found["weights"] - x.numel() * x.element_size()
    want = max(found["peak"], found.get("backward_peak", 0))
    assert abs(above - want) <= 0.02 * want, (above, want)


def test_the_families_by_cross_attention_width() -> None:
    sd15 = Workload.of("sd15", batch_size=1, regime=Regime("fp16-mixed"), with_encoders=True)
    names = [(e.name, e.dtype) for e in enc.encoders_of(sd15)]
    assert names == [("vae", "float16"), ("text_encoder", "float16")]
    sdxl = Workload.of("sdxl", batch_size=1, regime=Regime("bf16-mixed"), with_encoders=True, train_text_encoder=True)
    xl = enc.encoders_of(sdxl)
    assert [(e.name, e.dtype, e.trained) for e in xl] == [
        ("vae", "float32", False),
        ("text_encoder", "float32", True),
        ("text_encoder_2", "bfloat16", False),
    ]
    assert xl[0].image_size == 1024 and all(e.hidden_states for e in xl[1:])
    cached = enc.encoders_of(Workload.of("sd15", batch_size=1, with_encoders=True, cached_latents=True))
    assert [e.name for e in cached] == ["text_encoder"]
    with pytest.raises(SpecError, match="no known text encoders for cross_attention_dim 12"):
        enc.family(load_spec("tiny"))


def test_the_whole_step_term_by_term() -> None:
    spec = load_spec("tiny")
    profile = dataclasses.replace(
        random_profile(spec, 1, framework="torch"),
        opt_peak=10**6,
        static_bytes=5000,
        grad_bytes=3000,
        flops_per_s=1e6,
        step_time_s=1.0,
    )
    vae, _, trained = SMALL
    measured = {
        "vae": {"weights": 100, "params": 25, "peak": 10**11, "flops": 10**6},
        "text_encoder": {"weights": 40, "params": 10, "peak": 7, "keep": 11, "backward_peak": 13, "state": 84},
    }
    regime = Regime()
    out = enc.whole_step(profile, regime, [vae, trained], measured, device="cuda")
    static = 100 + 40 + 84  # both encoders' weights; the trained one's optimizer state as measured
    assert out.static_bytes == 5000 + static
    unit, choice = "down.0.resnets.0", "plain"
    assert out.units[unit][choice].fwd_peak == profile.units[unit][choice].fwd_peak + static + 11  # its kept bytes
    base = 5000 + static
    assert out.phases["vae forward"] == base + 2 * 3 * 32**2 * 4 + 10**11
    assert out.phases["text_encoder backward"] == base + 3000 + 2 * 16 * 8 + 13
    # the optimizer: its own peak, the trained encoder's gradients and (foreach on CUDA) one copy of its weights
    assert out.phases["optimizer"] == 10**6 + static + 40 + 40
    assert predict(out, spec, {}).peak_unit == "vae forward" and out.opt_peak == out.phases["vae forward"]
    assert out.step_time_s == 2.0  # the VAE's FLOPs at the profile's rate


def test_a_pipeline_folder_names_its_own_encoders(tmp_path: Path) -> None:
    (tmp_path / "unet").mkdir()
    (tmp_path / "unet" / "config.json").write_text("{}")
    assert enc.pipeline_configs(str(tmp_path / "unet")) is None  # nothing beside it yet
    for name, config in (
        ("vae", VAE),
        ("text_encoder", {**CLIP, "architectures": ["CLIPTextModel"]}),
        ("text_encoder_2", {**CLIP, "architectures": ["CLIPTextModelWithProjection"]}),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    found = enc.pipeline_configs(str(tmp_path))
    work = Workload.of("sd15", batch_size=1, with_encoders=True, encoder_configs=found)
    encoders = enc.encoders_of(dataclasses.replace(work, regime=Regime("bf16-mixed")))
    assert [(e.name, e.kind, e.dtype) for e in encoders] == [
        ("vae", "vae", "float32"),  # two text encoders: SDXL's scripts keep the VAE in float32
        ("text_encoder", "clip", "bfloat16"),
        ("text_encoder_2", "clip-projection", "bfloat16"),
    ]
    assert encoders[1].config_dict["hidden_size"] == 32 and encoders[0].config_dict["block_out_channels"] == [8, 16]
    assert work.request("torch", "profile") == Workload.of("sd15", batch_size=1).request("torch", "profile")


@pytest.mark.slow  # transformers imported, a small text encoder measured and trained one step
def test_a_trained_text_encoders_adafactor_state_as_a_real_adafactor_step_holds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole step under Adafactor with the text encoder trained (a folder's small CLIP, measured in this
    process) holds its weights and the state torch's Adafactor keeps after one step on the real model: row and
    column factors, far under AdamW's two float32 moments."""
    from transformers import CLIPTextConfig, CLIPTextModel

    config = {**CLIP, "max_position_embeddings": 77}  # the scripts' 77 tokens
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(whole, "run_worker", torch_encoders.encoders)
    work = Workload.of(
        "tiny",
        batch_size=2,
        regime=Regime(optimizer="adafactor"),
        with_encoders=True,
        cached_latents=True,
        train_text_encoder=True,
        encoder_configs=json.dumps({"text_encoder": config}),
    )
    profile = random_profile(work.spec, 1, framework="torch")
    held = whole.extender(work)(profile, "cpu").static_bytes - profile.static_bytes

    torch.manual_seed(0)
    model = CLIPTextModel(CLIPTextConfig(**config))
    model(torch.zeros(2, 77, dtype=torch.long)).last_hidden_state.sum().backward()
    adafactor = torch.optim.Adafactor(model.parameters())
    adafactor.step()
    state = sum(t.nbytes for st in adafactor.state.values() for t in st.values() if isinstance(t, torch.Tensor))
    weights = sum(p.nbytes for p in model.parameters())
    assert held == weights + state
    assert state < 0.1 * 2 * weights  # AdamW: two float32 moments per weight
