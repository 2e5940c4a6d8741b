"""`benchmarks.compare` on a diffusers folder, and diffusers' own checkpointing and our plans on its model beside ours.

The reference for the diffusers rows is our torch U-Net: same network, same weights, same
instruments, so without checkpointing the two must use the same memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.processes import rows_of, run_compare
from tests.helpers.specs import variant
from torch_impl import UNet


@pytest.mark.heavy
def test_diffusers_folder_in_every_framework(tmp_path: Path) -> None:
    torch.manual_seed(0)
    spec = variant("sd_linear_proj")
    UNet(spec).save_diffusers(tmp_path / "model" / "unet")  # a pipeline folder layout
    args = ["--diffusers", str(tmp_path / "model"), "--framework", "torch,diffusers", "--policies", "layers"]
    proc, doc = run_compare([*args, "--batch-size", "1", "--steps", "1", "--device", "cpu"], tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert doc is not None and doc["config"]["spec"]["transformer_layers_per_block"] == [1, 2]
    ours, theirs = rows_of(doc, "torch"), rows_of(doc, "diffusers")
    assert set(theirs) == {"none", "enable_gradient_checkpointing", "layers"}  # our plan too, by apply_plan
    assert doc["settings"]["policies"] == {"torch": ["none", "layers"], "diffusers": list(theirs)}
    count = sum(p.numel() for p in UNet(spec).parameters())
    assert ours["none"]["param_count"] == theirs["none"]["param_count"] == count
    assert ours["none"]["static_bytes"] == theirs["none"]["static_bytes"]
    # the same network: the same activation memory without checkpointing (diffusers' attention
    # processor may keep a few small extra tensors)
    assert abs(theirs["none"]["peak_bytes"] / ours["none"]["peak_bytes"] - 1) < 0.05
    gc = theirs["enable_gradient_checkpointing"]
    assert gc["peak_bytes"] < theirs["none"]["peak_bytes"] and gc["recompute_flops"] > 0
    # our plan on diffusers' model: the peak and the recomputed FLOPs of our U-Net under it
    assert abs(theirs["layers"]["peak_bytes"] / ours["layers"]["peak_bytes"] - 1) <= 0.03
    assert theirs["layers"]["recompute_flops"] == ours["layers"]["recompute_flops"] > 0


@pytest.mark.slow
def test_weights_that_do_not_fit_the_config_are_one_line_naming_the_keys(tmp_path: Path) -> None:
    """Refused before any row runs, every mismatched key in the one line (torch lists them all)."""
    torch.manual_seed(0)
    UNet(variant("sd_linear_proj")).save_diffusers(tmp_path / "unet")
    config = json.loads((tmp_path / "unet" / "config.json").read_text())
    (tmp_path / "unet" / "config.json").write_text(json.dumps({**config, "cross_attention_dim": 24}))
    args = ["--diffusers", str(tmp_path / "unet"), "--framework", "torch", "--batch-size", "1", "--steps", "1"]
    proc, doc = run_compare(args, tmp_path / "out")
    assert proc.returncode == 1 and doc is None
    lines = proc.stderr.strip().splitlines()
    head = "python -m benchmarks.compare: error: ValueError: diffusers weights do not match spec"
    assert len(lines) == 1 and lines[0].startswith(head)
    assert "34 mis-shaped" in lines[0]  # 2 down + 1 mid + 3 up levels' cross-attention K and V, every block
    for block in ("down_blocks.0.attentions.0", "down_blocks.0.attentions.1", "mid_block.attentions.0"):
        assert f"{block}.transformer_blocks.0.attn2.to_k.weight" in lines[0], block
