"""diffusers interop: configs -> spec, and our torch and Flax U-Nets reproduce diffusers' outputs.

Random tiny diffusers models of both classes are saved with ``save_pretrained`` and loaded back
from the folder; outputs must match diffusers' to ‖a-b‖/‖b‖ ≤ 1e-5 in float32.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import torch
from diffusers import UNet2DConditionModel, UNet2DModel
from safetensors.torch import load_file, save_file

from jax_impl import diffusers_io as jax_io
from shared_configs import SpecError, from_diffusers_config, load_spec
from shared_configs.diffusers.folders import live_config, ours_to_diffusers
from shared_configs.diffusers.unet_config import CLASS_DEFAULTS
from shared_configs.inputs import example_inputs
from tests.helpers.diffusers_ref import diffusers_forward
from tests.helpers.specs import FAST_COMPILE, HUB_CONFIGS, public_options
from tests.helpers.tensors import as_flax, as_torch, randomize_, rel_err
from torch_impl import UNet

TOL = 1e-5
TINY = {"block_out_channels": (32, 64), "norm_num_groups": 8, "sample_size": 8}
CLASSES = {"UNet2DModel": UNet2DModel, "UNet2DConditionModel": UNet2DConditionModel}

# name -> (class, config): together every supported block type and option.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "ddpm": (
        "UNet2DModel",
        {  # google/ddpm-cifar10-32 in small: one head, DDPM padding/time options
            "down_block_types": ("DownBlock2D", "AttnDownBlock2D"),
            "up_block_types": ("AttnUpBlock2D", "UpBlock2D"),
            "attention_head_dim": None,
            "flip_sin_to_cos": False,
            "freq_shift": 1,
            "norm_eps": 1e-6,
            "downsample_padding": 0,
            "mid_block_scale_factor": 1.4142,
        },
    ),
    "ddpm_heads_scale_shift": (
        "UNet2DModel",
        {  # head dim 8, scale/shift time, custom time width
            "down_block_types": ("AttnDownBlock2D", "AttnDownBlock2D"),
            "up_block_types": ("AttnUpBlock2D",) * 2,
            "attention_head_dim": 8,
            "resnet_time_scale_shift": "scale_shift",
            "attn_norm_num_groups": 8,
            "time_embedding_dim": 48,
            "layers_per_block": 1,
        },
    ),
    "ddpm_no_mid_attention": (
        "UNet2DModel",
        {
            "down_block_types": ("DownBlock2D", "DownBlock2D"),
            "up_block_types": ("UpBlock2D", "UpBlock2D"),
            "add_attention": False,
            "layers_per_block": 1,
            "dropout": 0.1,
            "in_channels": 1,
            "out_channels": 2,
        },
    ),
    "sd": (
        "UNet2DConditionModel",
        {  # SD 1.x in small: 3 levels, conv projections, 4 heads
            "block_out_channels": (32, 64, 64),
            "sample_size": 16,
            "layers_per_block": 1,
            "down_block_types": ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
            "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            "attention_head_dim": 4,
            "cross_attention_dim": 24,
        },
    ),
    "sd2_linear": (
        "UNet2DConditionModel",
        {  # SD 2.x in small: linear projections, per-level heads
            "down_block_types": ("CrossAttnDownBlock2D",) * 2,
            "up_block_types": ("CrossAttnUpBlock2D",) * 2,
            "attention_head_dim": (2, 4),
            "use_linear_projection": True,
            "transformer_layers_per_block": 2,
            "cross_attention_dim": 16,
            "upcast_attention": True,
            "layers_per_block": 1,
            "resnet_out_scale_factor": 2.0,
            "resnet_skip_time_act": True,  # inert for these blocks
        },
    ),
    "sdxl_depths": (
        "UNet2DConditionModel",
        {  # SDXL-style per-level transformer depth, no attention at level 0
            "block_out_channels": (32, 64, 64),
            "down_block_types": ("DownBlock2D",) + ("CrossAttnDownBlock2D",) * 2,
            "up_block_types": ("CrossAttnUpBlock2D",) * 2 + ("UpBlock2D",),
            "transformer_layers_per_block": (1, 1, 3),
            "attention_head_dim": (2, 4, 8),
            "use_linear_projection": True,
            "cross_attention_dim": 16,
            "sample_size": 8,
        },
    ),
    "mixed_attention": (
        "UNet2DConditionModel",
        {  # DDPM attention inside a conditional U-Net
            "down_block_types": ("AttnDownBlock2D", "CrossAttnDownBlock2D"),
            "up_block_types": ("CrossAttnUpBlock2D", "AttnUpBlock2D"),
            "attention_head_dim": 4,
            "cross_attention_dim": 24,
            "resnet_time_scale_shift": "scale_shift",
            "norm_eps": 1e-6,
            "flip_sin_to_cos": False,
            "freq_shift": 1,
            "downsample_padding": 0,
            "time_embedding_dim": 40,
            "mid_block_scale_factor": 1.2,
            "layers_per_block": 1,
            "only_cross_attention": [False, False],
        },
    ),
    "sdxl_text_time": (
        "UNet2DConditionModel",
        {  # SDXL in small: text_time conditioning, depths, no level-0 attention
            "block_out_channels": (32, 64, 64),
            "down_block_types": ("DownBlock2D",) + ("CrossAttnDownBlock2D",) * 2,
            "up_block_types": ("CrossAttnUpBlock2D",) * 2 + ("UpBlock2D",),
            "transformer_layers_per_block": (1, 2, 2),
            "attention_head_dim": (2, 4, 8),
            "use_linear_projection": True,
            "cross_attention_dim": 16,
            "addition_embed_type": "text_time",
            "addition_time_embed_dim": 8,
            "projection_class_embeddings_input_dim": 60,
        },
    ),
    "class_ddpm_inpaint": (
        "UNet2DModel",
        {  # class table, 9 -> 4 channels (inpainting), mid attention without norm
            "down_block_types": ("AttnDownBlock2D", "DownBlock2D"),
            "up_block_types": ("UpBlock2D", "AttnUpBlock2D"),
            "num_class_embeds": 7,
            "in_channels": 9,
            "out_channels": 4,
            "resnet_time_scale_shift": "scale_shift",
            "attention_head_dim": 16,
        },
    ),
    "class_projection_variance": (
        "UNet2DConditionModel",
        {  # projected class vectors, out = 2 x in, concat
            "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
            "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
            "attention_head_dim": 3,
            "cross_attention_dim": 8,
            "class_embed_type": "projection",
            "projection_class_embeddings_input_dim": 12,
            "class_embeddings_concat": True,
            "out_channels": 8,
            "layers_per_block": 1,
        },
    ),
}


def _build(name: str) -> torch.nn.Module:
    cls, config = CASES[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = CLASSES[cls](**{**TINY, **config}).eval()
    randomize_(model, seed=len(name))
    return model


def _inputs(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Every input the model takes (ours and diffusers' alike), two samples, one early and one late timestep."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "upcast_attention")
        spec = from_diffusers_config(live_config(model))
    inputs = example_inputs(spec, np.random.default_rng(5), batch=2, context_len=5)
    inputs["t"] = np.array([3.0, 517.0], dtype=np.float32)
    return as_torch(inputs)


def _diffusers_out(model: torch.nn.Module, inputs: dict[str, torch.Tensor | None]) -> np.ndarray:
    return diffusers_forward(model, inputs).numpy()


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A random diffusers model, saved to a folder, with an input and its reference output."""
    model = _build(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    inputs = _inputs(model)
    ref = _diffusers_out(model, inputs)
    assert np.abs(ref).mean() > 0.1  # a live signal
    return {"name": request.param, "model": model, "folder": folder, "inputs": inputs, "ref": ref}


def _torch_out(ours: UNet, case: dict[str, Any]) -> np.ndarray:
    with torch.no_grad():
        return ours(**case["inputs"]).numpy()


def _flax_out(module: Any, params: dict, case: dict[str, Any]) -> np.ndarray:
    inputs = as_flax({k: None if v is None else v.numpy() for k, v in case["inputs"].items()})
    variables = {"params": params}
    out = jax.jit(module.apply).lower(variables, **inputs).compile(FAST_COMPILE)(variables, **inputs)
    return np.asarray(out).transpose(0, 3, 1, 2)  # NHWC -> NCHW


def _quiet_load(load: Any, source: Any) -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "upcast_attention")
        return load(source)


def test_torch_from_folder_matches_diffusers(case: dict[str, Any]) -> None:
    ours = _quiet_load(UNet.from_diffusers, case["folder"])
    assert rel_err(_torch_out(ours, case), case["ref"]) <= TOL


def test_torch_from_live_module_matches_diffusers(case: dict[str, Any]) -> None:
    ours = _quiet_load(UNet.from_diffusers, case["model"])
    assert rel_err(_torch_out(ours, case), case["ref"]) <= TOL


@pytest.mark.slow_for(
    "ddpm",
    "ddpm_heads_scale_shift",
    "sd",
    "sd2_linear",
    "sdxl_depths",
    "mixed_attention",
    "sdxl_text_time",
    "class_ddpm_inpaint",
    "class_projection_variance",
)
def test_flax_from_folder_matches_diffusers(case: dict[str, Any]) -> None:
    module, params = _quiet_load(jax_io.from_diffusers, case["folder"])
    assert rel_err(_flax_out(module, params, case), case["ref"]) <= TOL


@pytest.mark.slow_for("sdxl_depths", "sdxl_text_time")
def test_to_diffusers_state_dict_loads_strictly(case: dict[str, Any]) -> None:
    ours = _quiet_load(UNet.from_diffusers, case["folder"])
    fresh = _build(case["name"])
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(ours.to_diffusers_state_dict(), strict=True)
    for key, value in case["model"].state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key


@pytest.mark.slow
def test_flax_from_live_module_and_back() -> None:
    model = _build("sd2_linear")
    module, params = _quiet_load(jax_io.from_diffusers, model)
    back = jax_io.to_diffusers_state_dict(params, module.spec)
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_upcast_attention_is_accepted_with_a_warning() -> None:
    with pytest.warns(UserWarning, match="upcast_attention"):
        from_diffusers_config({"_class_name": "UNet2DConditionModel", "upcast_attention": True})


def test_legacy_attention_names_bin_and_pipeline_folder(tmp_path: Path) -> None:
    """Pre-0.14 DDPM attention names, a pickled .bin, and a pipeline folder's unet/ all load."""
    model = _build("ddpm")
    model.save_pretrained(tmp_path / "new")
    legacy = {}
    for key, value in load_file(tmp_path / "new" / "diffusion_pytorch_model.safetensors").items():
        for new, old in (("to_q", "query"), ("to_k", "key"), ("to_v", "value"), (r"to_out\.0", "proj_attn")):
            key = re.sub(rf"(attentions\.\d+)\.{new}\.", rf"\1.{old}.", key)
        legacy[key] = value
    assert any(".proj_attn." in k for k in legacy)
    unet = tmp_path / "pipeline" / "unet"
    unet.mkdir(parents=True)
    (unet / "config.json").write_text((tmp_path / "new" / "config.json").read_text())
    save_file(legacy, unet / "diffusion_pytorch_model.safetensors")
    model.save_pretrained(tmp_path / "bin", safe_serialization=False)
    inputs = _inputs(model)
    ref = _diffusers_out(model, inputs)
    assert rel_err(_diffusers_out(UNet2DModel.from_pretrained(unet), inputs), ref) == 0  # diffusers agrees
    for source in (tmp_path / "pipeline", tmp_path / "bin"):
        ours = UNet.from_diffusers(source)
        assert rel_err(_torch_out(ours, {"inputs": inputs}), ref) <= TOL
    module, params = jax_io.from_diffusers(tmp_path / "pipeline")
    assert rel_err(_flax_out(module, params, {"inputs": inputs}), ref) <= TOL


PRESETS = [
    ("ddpm_cifar10", HUB_CONFIGS["ddpm_cifar10"], 35_746_307),
    ("sd15", HUB_CONFIGS["sd15"], 859_520_964),
    ("sd21", HUB_CONFIGS["sd21"], 865_910_724),
    ("sdxl", HUB_CONFIGS["sdxl"], 2_567_463_684),
]


@pytest.mark.parametrize(("preset", "config", "count"), PRESETS, ids=[p[0] for p in PRESETS])
def test_presets_are_the_hub_configs(preset: str, config: dict[str, Any], count: int) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "upcast_attention")
        spec = from_diffusers_config(config, name=preset)
    assert spec == load_spec(preset)
    assert spec.model_dump() == load_spec(preset).model_dump()
    with torch.device("meta"):  # full size, no memory: same names, shapes and count as diffusers
        ours = ours_to_diffusers({k: tuple(v.shape) for k, v in UNet(spec).state_dict().items()})
        theirs_model = CLASSES[config["_class_name"]](**public_options(config))
        theirs = {k: tuple(v.shape) for k, v in theirs_model.state_dict().items()}
    assert ours == theirs
    assert sum(int(np.prod(s)) for s in ours.values()) == count


def test_defaults_table_matches_installed_diffusers() -> None:
    for name, cls in CLASSES.items():
        signature = inspect.signature(cls.__init__).parameters
        expected = {k: p.default for k, p in signature.items() if k != "self"}
        assert CLASS_DEFAULTS[name] == expected, name


U2D, COND = {"_class_name": "UNet2DModel"}, {"_class_name": "UNet2DConditionModel"}
TWO_LEVELS = {"down_block_types": ["AttnDownBlock2D"] * 2, "up_block_types": ["AttnUpBlock2D"] * 2}
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({**COND, "addition_embed_type": "text", "encoder_hid_dim": None}, "addition_embed_type='text'"),
    (
        {**COND, "addition_embed_type": "text_time", "addition_time_embed_dim": 256},
        "projection_class_embeddings_input_dim: required by addition_embed_type='text_time'",
    ),
    (
        {**COND, "addition_embed_type": "text_time", "projection_class_embeddings_input_dim": 256},
        "addition_time_embed_dim: required by addition_embed_type='text_time'",
    ),
    (
        {
            **COND,
            "addition_embed_type": "text_time",
            "addition_time_embed_dim": 256,
            "projection_class_embeddings_input_dim": 256,
        },
        "projection_class_embeddings_input_dim: 256 leaves no",
    ),
    ({**COND, "class_embed_type": "projection"}, "projection_class_embeddings_input_dim: required by class_embed_type"),
    ({**COND, "class_embeddings_concat": True}, "class_embeddings_concat: True without a class embedding"),
    (
        {**COND, "encoder_hid_dim_type": "text_image_proj", "encoder_hid_dim": 32},
        "encoder_hid_dim_type='text_image_proj' (Kandinsky 2.1's",
    ),
    ({**COND, "encoder_hid_dim_type": "image_proj"}, "encoder_hid_dim: required by encoder_hid_dim_type='image_proj'"),
    ({**COND, "addition_embed_type": "image"}, "encoder_hid_dim: required by addition_embed_type='image'"),
    ({**COND, "addition_embed_type": "image_hint", "encoder_hid_dim": 8}, "addition_embed_type='image_hint'"),
    ({**COND, "dual_cross_attention": True}, "dual_cross_attention"),
    ({**COND, "only_cross_attention": [True, False, False, False]}, "only_cross_attention"),
    ({**COND, "conv_in_kernel": 1}, "conv_in_kernel"),
    ({**U2D, "center_input_sample": True}, "center_input_sample"),
    ({**U2D, "time_embedding_type": "fourier"}, "time_embedding_type='fourier'"),
    ({**U2D, "act_fn": "gelu"}, "act_fn='gelu'"),
    ({**COND, "attention_type": "gated"}, "attention_type"),
    ({**COND, "norm_num_groups": None}, "norm_num_groups"),
    ({**U2D, "downsample_type": "resnet"}, "downsample_type"),
    ({**COND, "transformer_layers_per_block": [1, 2]}, "transformer_layers_per_block: [1, 2] needs 4 integers"),
    ({**COND, "reverse_transformer_layers_per_block": [[1], [2]]}, "reverse_transformer_layers_per_block"),
    ({**COND, "layers_per_block": [1, 2, 2, 2]}, "layers_per_block"),
    ({**COND, "mid_block_type": None}, "mid_block_type"),
    ({**COND, "mid_block_type": "UNetMidBlock2D"}, "mid_block_type"),
    ({**U2D, "mid_block_type": None}, "mid_block_type"),
    ({**COND, "down_block_types": ["SimpleCrossAttnDownBlock2D"] + ["DownBlock2D"] * 3}, "down_block_types"),
    (
        {
            **COND,
            "down_block_types": ["SimpleCrossAttnDownBlock2D"] * 4,
            "up_block_types": ["ResnetUpsampleBlock2D"] * 4,
            "cross_attention_norm": "layer_norm",
        },
        "cross_attention_norm: 'layer_norm' unsupported",
    ),
    (
        {
            **COND,
            "down_block_types": ["SimpleCrossAttnDownBlock2D"] * 4,
            "up_block_types": ["ResnetUpsampleBlock2D"] * 4,
            "mid_block_type": "UNetMidBlock2DSimpleCrossAttn",
            "mid_block_only_cross_attention": True,
        },
        "mid_block_only_cross_attention",
    ),
    (
        {**U2D, "down_block_types": ["ResnetDownsampleBlock2D"] * 4, "up_block_types": ["ResnetUpsampleBlock2D"] * 4},
        "in a UNet2DConditionModel whose blocks are all of them",
    ),
    ({**COND, "up_block_types": ["UpBlock2D"] * 3 + ["KUpBlock2D"]}, "up_block_types"),
    ({**U2D, "down_block_types": ["CrossAttnDownBlock2D"] + ["DownBlock2D"] * 3}, "UNet2DConditionModel"),
    ({**COND, "resnet_time_scale_shift": "spatial"}, "resnet_time_scale_shift"),
    ({**U2D, **TINY, **TWO_LEVELS, "attn_norm_num_groups": 5}, "mid_attention_norm_groups: block_out_channels[-1]"),
    ({**COND, "num_attention_heads": 8}, "num_attention_heads"),
    ({**U2D, **TINY, **TWO_LEVELS, "attention_head_dim": 48}, "attention_head_dim: 48 exceeds the 32 channels"),
    ({**U2D, "downsample_padding": 2}, "downsample_padding"),
    ({**COND, "some_future_option": 1}, "some_future_option: unknown UNet2DConditionModel option"),
    ({"_class_name": "UNet3DConditionModel"}, "_class_name: unsupported diffusers model 'UNet3DConditionModel'"),
    ({"attention_head_dim": 8}, "_class_name"),
]


@pytest.mark.parametrize(("config", "message"), REFUSED, ids=[m.split("=")[0].split(":")[0] for _, m in REFUSED])
def test_unsupported_option_is_refused_by_name(config: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as info:
        from_diffusers_config(config)
    assert message in str(info.value)


def test_refused_before_reading_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"_class_name": "UNet2DModel", "act_fn": "mish"}')
    (tmp_path / "diffusion_pytorch_model.safetensors").write_bytes(b"not read")
    with pytest.raises(SpecError, match="act_fn='mish'"):
        UNet.from_diffusers(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"missing: no config\.json \(no such folder\)"):
        UNet.from_diffusers(tmp_path / "missing")


@pytest.mark.slow
def test_loading_a_folder_does_not_import_diffusers(tmp_path: Path) -> None:
    _build("sd").save_pretrained(tmp_path)
    code = (
        "import sys; import torch_impl, jax_impl.diffusers_io as j; "
        f"torch_impl.UNet.from_diffusers({str(tmp_path)!r}); j.from_diffusers({str(tmp_path)!r}); "
        "assert 'diffusers' not in sys.modules, 'diffusers was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
