"""PyTorch and Flax compute the same function: outputs and gradients after weight conversion."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import traverse_util

from jax_impl.convert import flax_to_torch, torch_to_flax
from shared_configs.arch import NormArgs, ResnetArgs, SelfAttentionArgs, SimpleCrossAttentionArgs, TransformerArgs
from tests.helpers.parity import flax_out, parity_inputs, parity_pair, torch_out
from tests.helpers.specs import VARIANTS
from tests.helpers.tensors import rel_err
from torch_impl import UNet as TorchUNet


@pytest.mark.slow_for("sd_linear_proj", "transformer_no_cross", "sdxl_style", "sd21_style")
@pytest.mark.parametrize("name", list(VARIANTS))
def test_outputs_match(name: str) -> None:
    tmodel, fmodel, params = parity_pair(name)
    inputs = parity_inputs(tmodel.spec)
    with torch.no_grad():
        ref = torch_out(tmodel, inputs).numpy()
    out = np.asarray(flax_out(fmodel, params, inputs))
    assert np.abs(ref).mean() > 1e-2  # a live signal, not a degenerate zero output
    assert rel_err(out, ref) <= 1e-5


@pytest.mark.slow_for("sd_linear_proj", "sd21_style")
@pytest.mark.parametrize("name", list(VARIANTS))
def test_round_trip_is_exact(name: str) -> None:
    tmodel, _, params = parity_pair(name)
    back = flax_to_torch(params, tmodel.spec)
    fresh = TorchUNet(tmodel.spec)
    fresh.load_state_dict(back, strict=True)
    for key, value in tmodel.state_dict().items():
        assert torch.equal(back[key], value), key


@pytest.mark.slow_for("tiny", "ddpm_style", "sd_linear_proj", "sdxl_style")
@pytest.mark.parametrize("name", ["tiny", "ddpm_style", "sd_linear_proj", "sdxl_style", "class_cond"])
def test_gradients_match(name: str) -> None:
    tmodel, fmodel, params = parity_pair(name)
    inputs = parity_inputs(tmodel.spec)
    x = inputs["x"]
    target = np.random.default_rng(3).standard_normal((*x.shape[:1], tmodel.spec.out_channels, *x.shape[2:]))
    target = target.astype(np.float32)

    loss = ((torch_out(tmodel, inputs) - torch.from_numpy(target)) ** 2).mean()
    loss.backward()
    torch_grads = torch_to_flax({n: p.grad for n, p in tmodel.named_parameters()}, tmodel.spec)

    def flax_loss(p: dict) -> jax.Array:
        return jnp.mean((flax_out(fmodel, p, inputs) - target) ** 2)

    flax_value, flax_grads = jax.value_and_grad(flax_loss)(params)
    assert rel_err(flax_value, loss.item()) <= 1e-5
    want = traverse_util.flatten_dict(torch_grads)
    got = traverse_util.flatten_dict(flax_grads)
    assert want.keys() == got.keys()
    scale = np.sqrt(sum(np.sum(np.square(g)) for g in want.values()))
    for key, g in want.items():
        if key[-2:] == ("to_k", "bias"):
            # softmax is invariant to a bias added to every key: this gradient is 0 in exact
            # arithmetic, so both frameworks hold rounding noise; check that it is noise.
            assert max(np.linalg.norm(g), np.linalg.norm(got[key])) <= 1e-6 * scale
        else:
            assert rel_err(got[key], g) <= 1e-4, "/".join(key)


def test_conversion_rejects_mismatched_weights() -> None:
    tmodel, _, _ = parity_pair("tiny")
    state = dict(tmodel.state_dict())
    state.pop("conv_out.bias")
    with pytest.raises(ValueError, match="missing conv_out/bias"):
        torch_to_flax(state, tmodel.spec)
    state = dict(tmodel.state_dict())
    state["conv_in.weight"] = state["conv_in.weight"][:, :2]
    with pytest.raises(ValueError, match=r"conv_in/kernel has shape"):
        torch_to_flax(state, tmodel.spec)


def test_layer_arguments_are_both_constructors_parameters() -> None:
    """Each layer of either framework takes, after its channels, the one typed arguments object of
    `shared_configs.arch` (and Flax its own switches), so that both read the spec's numbers alike."""
    from jax_impl import added_layers as flax_added
    from jax_impl import layers as flax_layers
    from torch_impl import added_layers as torch_added
    from torch_impl import layers as torch_layers

    channels = {"ch", "in_ch", "out_ch", "resample"}  # what a block passes per layer (a resampler's direction)
    # Flax: the chunked attention switch, the LoRA adapters (torch adds peft's from the outside:
    # torch_impl.regime.add_lora), linen's own fields
    flax_only = {"query_chunk", "lora_rank", "parent", "name"}
    pairs = [(NormArgs, "norm_layer"), (ResnetArgs, "ResnetBlock"), (SelfAttentionArgs, "SelfAttention")]
    for args, layer in [*pairs, (TransformerArgs, "Transformer2D"), (SimpleCrossAttentionArgs, "SimpleCrossAttention")]:
        added = hasattr(torch_added, layer)
        torch_module, flax_module = (torch_added, flax_added) if added else (torch_layers, flax_layers)
        torch_params = inspect.signature(getattr(torch_module, layer)).parameters
        flax_params = inspect.signature(getattr(flax_module, layer)).parameters
        assert set(torch_params) - channels == set(flax_params) - channels - flax_only == {"args"}, layer
        assert torch_params["args"].annotation == flax_params["args"].annotation == args.__name__, layer
