"""Loading from the local Hugging Face cache (a repo id), variants and dtypes; one-line errors at the edge.

The cache is built in tmp the way huggingface_hub lays it out (``models--org--name/refs/main`` holds a
commit, ``snapshots/<commit>/...`` links into ``blobs/``), with ``HF_HOME`` / ``HF_HUB_CACHE`` pointed
at it. The reference is diffusers itself.
"""

from __future__ import annotations

import copy
import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers import UNet2DConditionModel

from jax_impl import diffusers_io as jax_io
from shared_configs.diffusers.folders import find_folder
from shared_configs.inputs import example_inputs
from tests.helpers.diffusers_ref import COMMIT, cache_repo, diffusers_forward
from tests.helpers.tensors import as_torch, randomize_, rel_err
from torch_impl import UNet

CONFIG = {  # a tiny SDXL-like U-Net: text_time conditioning
    "block_out_channels": (16, 32),
    "norm_num_groups": 8,
    "sample_size": 8,
    "layers_per_block": 1,
    "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D"),
    "up_block_types": ("CrossAttnUpBlock2D", "UpBlock2D"),
    "attention_head_dim": 2,
    "cross_attention_dim": 8,
    "addition_embed_type": "text_time",
    "addition_time_embed_dim": 4,
    "projection_class_embeddings_input_dim": 30,
}


@pytest.fixture(scope="module")
def model() -> UNet2DConditionModel:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unet = UNet2DConditionModel(**CONFIG).eval()
    randomize_(unet, seed=1)
    return unet


@pytest.fixture(scope="module")
def hf_home(model: UNet2DConditionModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF_HOME whose hub cache holds org/tiny-xl: a pipeline repo with unet/ in fp16 and fp32 variants."""
    home = tmp_path_factory.mktemp("hf_home")
    files = tmp_path_factory.mktemp("unet_files")
    model.save_pretrained(files)  # fp32, the default variant
    half = tmp_path_factory.mktemp("half")
    copy.deepcopy(model).half().save_pretrained(half, variant="fp16")
    shutil.copy(half / "diffusion_pytorch_model.fp16.safetensors", files)
    cache_repo(home / "hub", "org/tiny-xl", files)
    return home


@pytest.fixture
def env(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # belt and braces: nothing here may reach the network
    return hf_home


def _inputs(spec: Any) -> dict[str, torch.Tensor | None]:
    return as_torch(example_inputs(spec, np.random.default_rng(0), batch=2, context_len=3))


def test_repo_id_from_the_cache_matches_diffusers(env: Path, model: UNet2DConditionModel) -> None:
    ours = UNet.from_diffusers("org/tiny-xl", subfolder="unet")
    inputs = _inputs(ours.spec)
    with torch.no_grad():
        assert rel_err(ours(**inputs), diffusers_forward(model, inputs)) <= 1e-5
    assert ours.spec.name == "tiny-xl"
    assert find_folder("org/tiny-xl").root == env / "hub/models--org--tiny-xl/snapshots" / COMMIT / "unet"


def test_fp16_variant_and_dtype(env: Path, model: UNet2DConditionModel) -> None:
    """The fp16 file is read (its rounding shows), and dtype= casts in both frameworks."""
    fp32 = UNet.from_diffusers("org/tiny-xl", subfolder="unet")
    fp16 = UNet.from_diffusers("org/tiny-xl", variant="fp16", subfolder="unet")
    half = UNet.from_diffusers("org/tiny-xl", variant="fp16", dtype=torch.float16)
    rounded = {k: v.half().float() for k, v in fp32.state_dict().items()}
    assert all(torch.equal(v, rounded[k]) for k, v in fp16.state_dict().items())
    assert not all(torch.equal(v, fp32.state_dict()[k]) for k, v in fp16.state_dict().items())
    assert {p.dtype for p in half.parameters()} == {torch.float16}
    assert {p.dtype for p in fp16.parameters()} == {torch.float32}
    _, params = jax_io.from_diffusers("org/tiny-xl", variant="fp16", subfolder="unet", dtype=jnp.bfloat16)
    leaves = [leaf for block in params.values() for leaf in _leaves(block)]
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.bfloat16)}


def _leaves(tree: Any) -> list[Any]:
    return [x for v in tree.values() for x in _leaves(v)] if isinstance(tree, dict) else [tree]


@pytest.mark.slow
def test_flax_from_the_cache_matches_torch(env: Path) -> None:
    ours = UNet.from_diffusers("org/tiny-xl")  # no subfolder: the pipeline's unet/ is found
    module, params = jax_io.from_diffusers("org/tiny-xl")
    inputs = _inputs(ours.spec)
    flax_inputs = {k: None if v is None else jnp.asarray(v.numpy()) for k, v in inputs.items()}
    flax_inputs["x"] = flax_inputs["x"].transpose(0, 2, 3, 1)
    out = np.asarray(module.apply({"params": params}, **flax_inputs)).transpose(0, 3, 1, 2)
    with torch.no_grad():
        assert rel_err(out, ours(**inputs)) <= 1e-5


def test_hf_hub_cache_wins_over_hf_home(hf_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HOME", str(hf_home / "elsewhere"))
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_home / "hub"))
    assert find_folder("org/tiny-xl", subfolder="unet").root.parent.name == COMMIT


def test_a_repo_id_not_in_the_cache_is_one_line(env: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        UNet.from_diffusers("org/missing", subfolder="unet")
    message = str(info.value)
    assert "org/missing: not a local folder, nor in the local Hugging Face cache" in message
    assert str(env / "hub" / "models--org--missing") in message and "\n" not in message
    with pytest.raises(FileNotFoundError, match="at revision v2"):
        jax_io.from_diffusers("org/tiny-xl", revision="v2")


def test_sharded_variant_index_as_diffusers_names_it(model: UNet2DConditionModel, tmp_path: Path) -> None:
    model.save_pretrained(tmp_path, variant="fp16", max_shard_size="40KB")
    assert (tmp_path / "diffusion_pytorch_model.safetensors.index.fp16.json").is_file()
    assert len(find_folder(tmp_path, variant="fp16").weight_files) > 1
    ours = UNet.from_diffusers(tmp_path, variant="fp16")
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in ours.to_diffusers_state_dict().items())


# ---- broken folders: one line naming the file (and every mismatched key) --------------------------


@pytest.fixture
def folder(model: UNet2DConditionModel, tmp_path: Path) -> Path:
    model.save_pretrained(tmp_path)
    return tmp_path


LOADERS = {"torch": UNet.from_diffusers, "flax": jax_io.from_diffusers}


@pytest.mark.parametrize("framework", list(LOADERS))
def test_broken_config_json(folder: Path, framework: str) -> None:
    (folder / "config.json").write_text('{"_class_name": "UNet2DConditionModel",\n "in_channels": 4,,}')
    with pytest.raises(ValueError) as info:
        LOADERS[framework](folder)
    where = "line 2, column 19: Expecting property name enclosed in double quotes"
    assert str(info.value) == f"{folder / 'config.json'}: not valid JSON ({where})"


@pytest.mark.parametrize("framework", list(LOADERS))
def test_truncated_safetensors_names_the_file(folder: Path, framework: str) -> None:
    weights = folder / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError) as info:
        LOADERS[framework](folder)
    assert str(info.value).startswith(f"{weights}: unreadable weights (SafetensorError: ")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("framework", list(LOADERS))
def test_mismatched_weights_list_every_key(folder: Path, framework: str, model: UNet2DConditionModel) -> None:
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    missing = sorted(k for k in state if k.startswith("add_embedding."))
    for key in missing:
        del state[key]
    state["extra.weight"] = torch.zeros(2)
    state["conv_in.weight"] = torch.zeros(16, 3, 3, 3)
    save_file(state, folder / "diffusion_pytorch_model.safetensors")
    with pytest.raises(ValueError) as info:
        LOADERS[framework](folder)
    message = str(info.value)
    assert f"{len(missing)} missing: {', '.join(missing)}" in message
    assert "1 unexpected: extra.weight" in message
    assert "1 mis-shaped: conv_in.weight (16, 3, 3, 3) (expected (16, 4, 3, 3))" in message
    assert "\n" not in message


def test_weight_index_without_a_map(folder: Path) -> None:
    (folder / "diffusion_pytorch_model.safetensors").unlink()
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(ValueError, match=r"index\.json: no weight_map of keys to shard files"):
        UNet.from_diffusers(folder)
