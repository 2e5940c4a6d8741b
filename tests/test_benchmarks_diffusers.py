"""`benchmarks.compare` on a diffusers folder, and diffusers' own checkpointing beside ours.

The reference for the diffusers rows is our torch U-Net: same network, same weights, same
instruments, so without checkpointing the two must use the same memory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.test_benchmarks import _compare, _rows
from tests.utils import variant
from torch_impl import UNet


def test_diffusers_folder_in_every_framework(tmp_path: Path) -> None:
    torch.manual_seed(0)
    spec = variant("sd_linear_proj")
    UNet(spec).save_diffusers(tmp_path / "model" / "unet")  # a pipeline folder layout
    args = ["--diffusers", str(tmp_path / "model"), "--framework", "torch,diffusers", "--policies", "layers"]
    proc, doc = _compare([*args, "--batch-size", "1", "--steps", "1", "--device", "cpu"], tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    assert doc is not None and doc["config"]["spec"]["transformer_layers_per_block"] == [1, 2]
    ours, theirs = _rows(doc, "torch"), _rows(doc, "diffusers")
    assert set(theirs) == {"none", "enable_gradient_checkpointing"}
    assert doc["settings"]["policies"] == {"torch": ["none", "layers"], "diffusers": list(theirs)}
    count = sum(p.numel() for p in UNet(spec).parameters())
    assert ours["none"]["param_count"] == theirs["none"]["param_count"] == count
    assert ours["none"]["static_bytes"] == theirs["none"]["static_bytes"]
    # the same network: the same activation memory without checkpointing (diffusers' attention
    # processor may keep a few small extra tensors)
    assert abs(theirs["none"]["peak_bytes"] / ours["none"]["peak_bytes"] - 1) < 0.05
    gc = theirs["enable_gradient_checkpointing"]
    assert gc["peak_bytes"] < theirs["none"]["peak_bytes"] and gc["recompute_flops"] > 0
