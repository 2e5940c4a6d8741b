"""The drop-ins for diffusers' removed Flax classes (`jax_impl.FlaxUNet2DConditionModel`, `FlaxControlNetModel`)
against diffusers' current PyTorch classes. A Flax folder in diffusers 0.39's format (config.json of the Flax
class's keys, ``diffusion_flax_model.msgpack`` of its parameter names) is written here with diffusers 0.39's own
PyTorch -> Flax rule (`_flax_tree`), so diffusers 0.39 need not be installed: the drop-in loads it with those
names, matches diffusers' PyTorch outputs (1e-5), saves a folder PyTorch loads; the calls the scripts make work;
remat plans keep the gradients. Running diffusers 0.39's own scripts: tests/test_flax_scripts.py (heavy).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import serialization, traverse_util
from jax.flatten_util import ravel_pytree

import jax_impl
from tests.helpers.specs import fast_xla_flags
from tests.helpers.tensors import randomize_, rel_err

UNET = {  # SD-shaped, tiny; widths multiples of 32 (diffusers' Flax GroupNorms have 32 groups, fixed)
    "sample_size": 8,
    "block_out_channels": [32, 64],
    "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
    "layers_per_block": 1,
    "attention_head_dim": 2,
    "cross_attention_dim": 16,
}
# diffusers 0.39's FlaxUNet2DConditionModel / FlaxControlNetModel config keys (their signatures)
FLAX_UNET_KEYS = (
    *("sample_size", "in_channels", "out_channels", "down_block_types", "up_block_types", "mid_block_type"),
    *("only_cross_attention", "block_out_channels", "layers_per_block", "attention_head_dim", "num_attention_heads"),
    *("cross_attention_dim", "dropout", "use_linear_projection", "flip_sin_to_cos", "freq_shift"),
    *("use_memory_efficient_attention", "split_head_dim", "transformer_layers_per_block", "addition_embed_type"),
    *("addition_time_embed_dim", "addition_embed_type_num_heads", "projection_class_embeddings_input_dim"),
)
FLAX_CONTROLNET_KEYS = (
    *("sample_size", "in_channels", "down_block_types", "only_cross_attention", "block_out_channels"),
    *("layers_per_block", "attention_head_dim", "num_attention_heads", "cross_attention_dim", "dropout"),
    *("use_linear_projection", "flip_sin_to_cos", "freq_shift", "controlnet_conditioning_channel_order"),
    "conditioning_embedding_out_channels",
)


def _flax_tree(state_dict: dict[str, torch.Tensor]) -> dict:
    """diffusers 0.39's ``convert_pytorch_state_dict_to_flax``: ``name.N`` -> ``name_N``, a 1-D weight is a
    ``scale``, a 4-D one an HWIO ``kernel``, a 2-D one a transposed ``kernel``."""
    flat = {}
    for key, tensor in state_dict.items():
        *path, leaf = re.sub(r"(\w+)\.(\d+)", r"\1_\2", key).split(".")
        w = tensor.detach().numpy()
        if leaf == "weight":
            leaf, w = ("scale", w) if w.ndim == 1 else ("kernel", w.transpose(2, 3, 1, 0) if w.ndim == 4 else w.T)
        flat[(*path, leaf)] = np.ascontiguousarray(w)
    return traverse_util.unflatten_dict(flat)


def _flax_folder(folder: Path, model: torch.nn.Module, cls: str, keys: tuple[str, ...]) -> dict:
    """``model`` saved as diffusers 0.39's Flax class ``cls`` saves: config.json and the msgpack. Its tree."""
    folder.mkdir(parents=True)
    config = {k: v for k, v in dict(model.config).items() if k in keys} | {"_class_name": cls}
    config.setdefault("sample_size", 8)
    (folder / "config.json").write_text(json.dumps(config))
    tree = _flax_tree(model.state_dict())
    (folder / "diffusion_flax_model.msgpack").write_bytes(serialization.to_bytes(tree))
    return tree


@pytest.fixture(scope="module")
def torch_unet() -> torch.nn.Module:
    import diffusers

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unet = diffusers.UNet2DConditionModel(**UNET)
    randomize_(unet, seed=3)  # biases and norms too
    return unet.eval()


@pytest.fixture(scope="module")
def torch_controlnet(torch_unet: torch.nn.Module) -> torch.nn.Module:
    import diffusers

    net = diffusers.ControlNetModel.from_unet(torch_unet, conditioning_embedding_out_channels=(16, 32))
    randomize_(net, seed=4)  # the zero convolutions too: a zero residual would hide every mistake
    return net.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, torch_unet: Any, torch_controlnet: Any) -> tuple[Path, dict]:
    """A pipeline folder holding both models as diffusers 0.39's Flax classes save them; the U-Net's tree."""
    root = tmp_path_factory.mktemp("flax")
    _flax_folder(root / "controlnet", torch_controlnet, "FlaxControlNetModel", FLAX_CONTROLNET_KEYS)
    return root, _flax_folder(root / "unet", torch_unet, "FlaxUNet2DConditionModel", FLAX_UNET_KEYS)


def _inputs(seed: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(2, 4, 8, 8)).astype(np.float32)
    context = rng.normal(size=(2, 5, 16)).astype(np.float32)
    cond = rng.uniform(size=(2, 3, 16, 16)).astype(np.float32)
    return x, np.array([3, 517], np.int32), context, cond


def _torch_unet_out(unet: torch.nn.Module, x: Any, t: Any, context: Any, **residuals: Any) -> np.ndarray:
    with torch.no_grad():
        return unet(torch.from_numpy(x), torch.from_numpy(t), torch.from_numpy(context), **residuals).sample.numpy()


def test_flax_folder_loads_under_diffusers_names_and_matches_pytorch(
    tmp_path: Path, folders: tuple[Path, dict], torch_unet: Any
) -> None:
    root, tree = folders
    model, params = jax_impl.FlaxUNet2DConditionModel.from_pretrained(root, subfolder="unet")
    flat, expected = traverse_util.flatten_dict(params), traverse_util.flatten_dict(tree)
    assert flat.keys() == expected.keys() and len(flat) == len(torch_unet.state_dict())
    assert all(np.array_equal(flat[k], expected[k]) for k in flat)
    x, t, context, _ = _inputs()
    out = jax.jit(model.apply)({"params": params}, x, t, context).sample  # NCHW in and out
    assert out.shape == x.shape
    assert rel_err(out, _torch_unet_out(torch_unet, x, t, context)) < 1e-5
    # its own save: diffusers' Flax names again, and a PyTorch file the current PyTorch class loads
    model.save_pretrained(tmp_path / "saved", params=params)
    again = serialization.msgpack_restore((tmp_path / "saved/diffusion_flax_model.msgpack").read_bytes())
    assert all(np.array_equal(traverse_util.flatten_dict(again)[k], flat[k]) for k in flat)
    import diffusers

    reloaded = diffusers.UNet2DConditionModel.from_pretrained(tmp_path / "saved").eval()
    assert rel_err(out, _torch_unet_out(reloaded, x, t, context)) < 1e-5
    # and that folder back through the PyTorch file (from_pt), as the Flax class read PyTorch folders
    _, from_pt = jax_impl.FlaxUNet2DConditionModel.from_pretrained(tmp_path / "saved", from_pt=True)
    assert all(np.allclose(traverse_util.flatten_dict(from_pt)[k], flat[k], rtol=0, atol=0) for k in flat)


def test_controlnet_residuals_match_pytorch(
    tmp_path: Path, folders: tuple[Path, dict], torch_unet: Any, torch_controlnet: Any
) -> None:
    root, _ = folders
    net, params = jax_impl.FlaxControlNetModel.from_pretrained(root, subfolder="controlnet")
    unet, unet_params = jax_impl.FlaxUNet2DConditionModel.from_pretrained(root)  # a pipeline folder: its unet/
    x, t, context, cond = _inputs()
    apply = jax.jit(net.apply, static_argnames="return_dict")
    down, mid = apply({"params": params}, x, t, context, cond, 0.8, return_dict=False)  # NHWC residuals
    with torch.no_grad():
        t_down, t_mid = torch_controlnet(
            *map(torch.from_numpy, (x, t, context, cond)), conditioning_scale=0.8, return_dict=False
        )
    assert len(down) == len(t_down)
    for ours, theirs in zip([*down, mid], [*t_down, t_mid], strict=True):
        assert rel_err(jnp.transpose(ours, (0, 3, 1, 2)), theirs.numpy()) < 1e-5
    residuals = {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}
    out = jax.jit(unet.apply)({"params": unet_params}, x, t, context, **residuals).sample
    expected = _torch_unet_out(
        torch_unet, x, t, context, down_block_additional_residuals=t_down, mid_block_additional_residual=t_mid
    )
    assert rel_err(out, expected) < 1e-5
    net.save_pretrained(tmp_path / "saved", params=params)
    import diffusers

    reloaded = diffusers.ControlNetModel.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        r_down, _ = reloaded(*map(torch.from_numpy, (x, t, context, cond)), conditioning_scale=0.8, return_dict=False)
    assert rel_err(r_down[-1].numpy(), t_down[-1].numpy()) < 1e-6


def test_what_the_scripts_call(folders: tuple[Path, dict]) -> None:
    """The constructor keywords, ``config``, ``init_weights`` (diffusers' names), ``return_dict``, ``train=`` with
    dropout, and the ControlNet script's own construction from ``unet.config``, its parameters the U-Net's."""
    unet = jax_impl.FlaxUNet2DConditionModel(**UNET, dropout=0.1, dtype=jnp.float32)
    assert unet.config.cross_attention_dim == 16 and dict(unet.config)["_class_name"] == "FlaxUNet2DConditionModel"
    shapes = traverse_util.flatten_dict(jax.eval_shape(unet.init_weights, jax.random.key(0)))
    assert shapes.keys() == traverse_util.flatten_dict(folders[1]).keys()
    params = folders[1]
    x, t, context, cond = _inputs()

    @jax.jit
    def eval_and_train(params: Any) -> tuple[jax.Array, jax.Array]:
        (out,) = unet.apply({"params": params}, x, t, context, return_dict=False)
        rngs = {"dropout": jax.random.key(1)}
        return out, unet.apply({"params": params}, x, t, context, train=True, rngs=rngs).sample

    eval_out, train_out = eval_and_train(params)
    assert rel_err(train_out, eval_out) > 1e-3  # dropout is on in training, off otherwise
    c = unet.config
    names = ("in_channels", "down_block_types", "only_cross_attention", "block_out_channels", "layers_per_block")
    more = ("attention_head_dim", "cross_attention_dim", "use_linear_projection", "flip_sin_to_cos", "freq_shift")
    net = jax_impl.FlaxControlNetModel(
        **{k: c[k] for k in (*names, *more)}, conditioning_embedding_out_channels=(16, 32)
    )
    cn_params = net.init_weights(jax.random.key(2))
    for key in ("conv_in", "time_embedding", "down_blocks_0", "down_blocks_1", "mid_block"):
        cn_params[key] = params[key]
    apply = jax.jit(net.apply, static_argnames="return_dict")
    down, mid = apply({"params": cn_params}, x, t, context, cond, return_dict=False)
    assert all(float(jnp.abs(r).max()) == 0.0 for r in [*down, mid])  # zero convolutions: nothing changes yet


@pytest.mark.slow
def test_remat_plans_keep_the_gradients(folders: tuple[Path, dict]) -> None:
    """Under ``policy=full`` and ``layers`` the gradients in diffusers' layout equal the plain model's, and the
    recompute is there (more ``remat`` in the jaxpr of the gradient)."""
    plain, params = jax_impl.FlaxUNet2DConditionModel.from_pretrained(folders[0])
    x, t, context, _ = _inputs()

    def grads(model: Any) -> tuple[np.ndarray, str]:
        loss = lambda p: jnp.mean(model.apply({"params": p}, x, t, context, train=True).sample ** 2)  # noqa: E731
        return ravel_pytree(jax.jit(jax.grad(loss))(params))[0], str(jax.make_jaxpr(jax.grad(loss))(params))

    reference, jaxpr = grads(plain)
    for policy in ("full", "layers"):
        got, planned = grads(plain.clone(policy=policy))
        assert planned.count("remat") > jaxpr.count("remat")
        assert rel_err(got, reference) < 1e-5, policy


def test_bad_input_is_one_line(tmp_path: Path, torch_unet: Any) -> None:
    tree = _flax_folder(tmp_path / "unet", torch_unet, "FlaxUNet2DConditionModel", FLAX_UNET_KEYS)
    with pytest.raises(ValueError, match=r"unexpected .*down_0"):
        jax_impl.FlaxUNet2DConditionModel(**UNET).apply(
            {"params": {**tree, "down_0": tree["down_blocks_0"]}}, *_inputs()[:3]
        )
    config = json.loads((tmp_path / "unet/config.json").read_text())
    (tmp_path / "unet/config.json").write_text(json.dumps({**config, "norm_num_groups": 16}))
    with pytest.raises(ValueError, match="options the Flax class does not take change the network"):
        jax_impl.FlaxUNet2DConditionModel.from_pretrained(tmp_path / "unet")
    with pytest.raises(ValueError, match="policy"):
        jax_impl.FlaxUNet2DConditionModel(**UNET, policy="sometimes").init_weights(jax.random.key(0))


@pytest.mark.slow
def test_remat_survives_the_users_own_jit() -> None:
    """Imported before JAX starts, the drop-in turns XLA:CPU's cse_barrier_expander off for the process: a plain
    ``jax.jit`` of the user's gradient then compiles ``full`` below ``none``; without it, CSE undoes the recompute."""
    script = """
import sys, jax, jax.numpy as jnp
if sys.argv[1] == "dropin":
    import jax_impl.diffusers_flax
from jax_impl.diffusers_flax import FlaxUNet2DConditionModel
unet = FlaxUNet2DConditionModel(**{config})
params = unet.init_weights(jax.random.key(0))
x, c = jnp.ones((8, 4, 16, 16)), jnp.ones((8, 5, 16))
def temp(policy):
    model = unet.clone(policy=policy)
    loss = lambda p: jnp.mean(model.apply({{"params": p}}, x, 3, c, train=True).sample ** 2)
    return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes
print(temp("none"), temp("full"))
"""
    peaks = {}
    for mode in ("dropin", "late"):
        code = script.format(config=UNET)
        if mode == "late":  # JAX started before the drop-in was imported: XLA_FLAGS is read too late
            code = code.replace('if sys.argv[1] == "dropin":', "jax.devices()\nif False:")
        env = {**os.environ, "XLA_FLAGS": fast_xla_flags()}  # whatever this process was given
        done = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, env=env, check=True)
        peaks[mode] = tuple(map(int, done.stdout.split()))
        if mode == "late":
            assert "imported after JAX started" in done.stderr
    none, full = peaks["dropin"]
    assert full < 0.8 * none, peaks
    assert peaks["late"][1] >= 0.95 * peaks["late"][0], peaks  # the recompute CSE'd away: no saving
