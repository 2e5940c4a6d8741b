"""LoRA weights in diffusers' format: diffusers loads ours and computes what our adapted U-Net does,
and ours load back (the reference: diffusers' own ``load_lora_adapter`` on its own U-Net)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from diffusers import UNet2DConditionModel

from shared_configs import SpecError, to_diffusers_config
from tests.helpers.diffusers_ref import outputs, seeded_variant
from tests.helpers.tensors import rel_err
from torch_impl.lora_io import LORA_WEIGHTS, load_lora_weights, lora_state_dict, save_lora_weights
from torch_impl.regime import add_lora


@pytest.mark.slow_for("sd_linear_proj")
@pytest.mark.parametrize("name", ["sd_linear_proj", "sdxl_style"])
def test_diffusers_loads_our_lora_and_computes_the_same(name: str, tmp_path: Path) -> None:
    ours, gen = add_lora(seeded_variant(name), 4), torch.Generator().manual_seed(5)
    with torch.no_grad():
        for key, param in ours.named_parameters():
            if "lora_B" in key:  # B starts at zero (no change); random, the adapters count
                param.normal_(std=0.05, generator=gen)
    path = save_lora_weights(ours, tmp_path)
    assert path.name == LORA_WEIGHTS and all(k.startswith("unet.") for k in lora_state_dict(ours))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = UNet2DConditionModel.from_config(to_diffusers_config(ours.spec)).eval()
        theirs.load_state_dict(seeded_variant(name).to_diffusers_state_dict(), strict=True)
        theirs.load_lora_adapter(str(tmp_path), weight_name=LORA_WEIGHTS, prefix="unet")
    expected = outputs(ours, ours.spec)
    assert rel_err(outputs(theirs, ours.spec, diffusers=True), expected) <= 1e-5
    assert rel_err(outputs(seeded_variant(name), ours.spec), expected) > 1e-3  # the adapters change the outputs
    again = load_lora_weights(seeded_variant(name), path)  # adapters added from the file's rank
    assert rel_err(outputs(again, ours.spec), expected) <= 1e-6


def test_bad_lora_files_are_one_line(tmp_path: Path) -> None:
    (tmp_path / LORA_WEIGHTS).write_bytes(b"not safetensors")
    with pytest.raises(SpecError, match="unreadable LoRA weights"):
        load_lora_weights(seeded_variant("sd_linear_proj"), tmp_path)
    with pytest.raises(SpecError, match="no LoRA adapters"):
        lora_state_dict(seeded_variant("sd_linear_proj"))
