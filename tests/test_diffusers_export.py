"""Our spec and weights -> diffusers: `to_diffusers_config` and `UNet.save_diffusers`.

The reference is diffusers itself: the model it builds from our config, with our weights
loaded strictly, must give our outputs; `from_pretrained` must read the folder we write.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import UNet2DConditionModel, UNet2DModel

from shared_configs import SpecError, from_diffusers_config, load_spec, to_diffusers_config
from tests.helpers.diffusers_ref import outputs, seeded_variant
from tests.helpers.specs import HUB_CONFIGS, public_options, variant
from tests.helpers.tensors import rel_err
from torch_impl import UNet

CLASSES = {"UNet2DModel": UNet2DModel, "UNet2DConditionModel": UNet2DConditionModel}
EXPORTABLE = ("ddpm_style", "sd_linear_proj", "sdxl_style", "sd21_style", "class_cond")


@pytest.mark.parametrize("name", EXPORTABLE)
def test_diffusers_builds_the_same_network_from_our_config(name: str) -> None:
    ours = seeded_variant(name)
    config = to_diffusers_config(ours.spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' deprecation notes about defaults
        theirs = CLASSES[config["_class_name"]].from_config(config).eval()
    theirs.load_state_dict(ours.to_diffusers_state_dict(), strict=True)
    assert rel_err(outputs(theirs, ours.spec, diffusers=True), outputs(ours, ours.spec)) <= 1e-5


@pytest.mark.parametrize("preset", list(HUB_CONFIGS))
def test_presets_export_to_their_hub_configs(preset: str) -> None:
    hub = HUB_CONFIGS[preset]
    config = to_diffusers_config(load_spec(preset))
    assert from_diffusers_config(config, name=preset) == load_spec(preset)
    with torch.device("meta"):  # full size, no memory
        hub_config = CLASSES[hub["_class_name"]](**public_options(hub)).config
    # every option we write has the value diffusers gives the hub's config.json
    expected = {k: list(v) if isinstance(v, tuple) else v for k, v in hub_config.items() if k in config}
    assert public_options(config) == expected


def test_save_diffusers_folder_loads_in_diffusers_and_back(tmp_path: Path) -> None:
    ours = seeded_variant("sd_linear_proj")
    folder = ours.save_diffusers(tmp_path / "unet")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "diffusion_pytorch_model.safetensors"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = UNet2DConditionModel.from_pretrained(folder).eval()
    reference = outputs(ours, ours.spec)
    assert rel_err(outputs(theirs, ours.spec, diffusers=True), reference) <= 1e-5
    assert torch.equal(outputs(UNet.from_diffusers(folder), ours.spec), reference)
    assert json.loads((folder / "config.json").read_text())["_class_name"] == "UNet2DConditionModel"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (variant("ddpm_style", norm_kind="batch"), "spec 'ddpm_style' has no diffusers equivalent: norm_kind='batch'"),
        (variant("ddpm_style", attention_scale=0.5), "attention_scale=0.5"),
        (variant("sd_linear_proj", layer_norm_eps=1e-6), "layer_norm_eps=1e-06"),
        (variant("transformer_no_cross"), "mid_attention: 'none'"),
        # Attn*Block2D reads attention_head_dim un-reversed on the way up (see test_diffusers)
        (variant("tiny"), "spec 'tiny' has no diffusers equivalent: heads={"),
    ],
    ids=["batch_norm", "attention_scale", "layer_norm_eps", "mid_none", "heads_quirk"],
)
def test_specs_without_a_diffusers_twin_are_refused_by_field(spec: Any, message: str) -> None:
    with pytest.raises(SpecError) as info:
        to_diffusers_config(spec)
    assert message in str(info.value)
    assert "\n" not in str(info.value)
