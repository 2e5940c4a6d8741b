"""LoRA in Flax against peft's in PyTorch: the same adapters (converted from peft's names and back), the same
outputs and adapter gradients, with and without a plan; only the adapters train (optax mask), the
frozen weights get no optimizer state; the JAX training CLI trains ``--trainable lora:R``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import traverse_util

from jax_impl import UNet as FlaxUNet
from jax_impl import regime as jregime
from jax_impl import step as jstep
from jax_impl import train as jt
from jax_impl.convert import _split, flax_to_torch, torch_to_flax
from jax_impl.lora import LORA_LEAVES
from shared_configs.regime import Regime
from tests.helpers.parity import parity_inputs
from tests.helpers.specs import FAST_COMPILE, variant
from tests.helpers.tensors import as_flax, as_torch, randomize_, rel_err
from torch_impl import UNet as TorchUNet
from torch_impl.regime import add_lora

RANK = 4
SPEC = variant("tiny", dropout=0.0)


@pytest.fixture(scope="module")
def pair() -> tuple[torch.nn.Module, dict]:
    """peft's adapters on our torch U-Net, every weight (the adapters' B too) randomised, and the Flax params."""
    torch.manual_seed(0)
    model = add_lora(TorchUNet(SPEC), RANK)
    randomize_(model, seed=3)
    return model, torch_to_flax(model.state_dict(), SPEC, lora_rank=RANK)


def _torch_loss_and_grads(model: torch.nn.Module, inputs: dict, policy: str) -> tuple[float, dict]:
    model.enable_gradient_checkpointing(policy)
    model.zero_grad(set_to_none=True)
    out = model(**as_torch(inputs))
    loss = (out.double() ** 2).mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return float(loss), {k: v for k, v in _split(grads)[0].items()}


@pytest.mark.slow  # a whole-gradient compile each (the inner loop keeps the outputs, back in peft)
@pytest.mark.parametrize("policy", ["none", "layers"])
def test_flax_lora_matches_peft(pair: tuple, policy: str) -> None:
    model, params = pair
    inputs = parity_inputs(SPEC)
    loss_t, grads_t = _torch_loss_and_grads(model, inputs, policy)
    assert grads_t and all(any(k in ("lora_A", "lora_B") for k in path) for path in grads_t)
    flax_model = FlaxUNet(spec=SPEC, policy=policy, lora_rank=RANK)

    def loss_fn(p: dict) -> jax.Array:
        out = flax_model.apply({"params": p}, **as_flax(inputs))
        return jnp.mean(out.astype(jnp.float32) ** 2)

    loss_j, grads_j = jax.jit(jax.value_and_grad(loss_fn)).lower(params).compile(FAST_COMPILE)(params)  # one compile
    assert abs(float(loss_j) / loss_t - 1) < 1e-5
    flat = traverse_util.flatten_dict(grads_j)
    for path, g in grads_t.items():
        assert rel_err(flat[path], g) < 1e-5, path


def test_flax_lora_params_load_into_peft_model(pair: tuple) -> None:
    """Back to torch: Flax adapters changed on the JAX side load strictly into a fresh peft-adapted
    U-Net under peft's names, which then gives the Flax model's outputs."""
    _, params = pair
    flat = traverse_util.flatten_dict(params)
    changed = traverse_util.unflatten_dict({k: v * 1.5 if k[-2] in LORA_LEAVES else v for k, v in flat.items()})
    state = flax_to_torch(changed, SPEC, lora_rank=RANK)
    torch.manual_seed(1)
    model = add_lora(TorchUNet(SPEC), RANK)
    model.load_state_dict(state, strict=True)
    assert any(".lora_A.default." in k for k in state) and any(".base_layer." in k for k in state)
    inputs = parity_inputs(SPEC)
    with torch.no_grad():
        out_t = model.eval()(**as_torch(inputs)).numpy()
    out_j = jax.jit(FlaxUNet(spec=SPEC, lora_rank=RANK).apply)({"params": changed}, **as_flax(inputs))
    assert np.abs(out_t).mean() > 1e-2
    assert rel_err(np.asarray(out_j).transpose(0, 3, 1, 2), out_t) < 1e-5


def test_only_the_adapters_train_and_hold_state(pair: tuple) -> None:
    _, params = pair
    regime = Regime(trainable=f"lora:{RANK}", ema=True)
    tx = jregime.make_optimizer(1e-2, 0.01, regime)
    state = jstep.TrainState.create({"params": params}, tx, regime)
    mask = traverse_util.flatten_dict(jregime.trained_mask(params, regime))
    adapters = {k for k, trained in mask.items() if trained}
    assert adapters and all(k[-2] in LORA_LEAVES for k in adapters)
    adapter_bytes = sum(traverse_util.flatten_dict(params)[k].nbytes for k in adapters)
    moments = sum(x.nbytes for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0)
    assert moments == 2 * adapter_bytes  # AdamW's two moments, of the adapters only
    assert sum(x.nbytes for x in jax.tree.leaves(state.ema)) == adapter_bytes
    grads = jax.tree.map(jnp.ones_like, params)
    updates, _ = jax.jit(tx.update)(grads, state.opt_state, params)  # one compile, not one per leaf and op
    new = traverse_util.flatten_dict(jax.jit(optax.apply_updates)(params, updates))
    old = traverse_util.flatten_dict(params)
    for key in old:
        assert np.array_equal(new[key], old[key]) != (key in adapters), key


@pytest.mark.heavy  # the adapters' training stays in the default run: test_only_the_adapters_train_and_hold_state
def test_jax_training_cli_trains_lora(tmp_path) -> None:
    cfg = jt.parse_args(
        [
            "--config",
            "tiny",
            "--steps",
            "3",
            "--batch-size",
            "2",
            "--trainable",
            f"lora:{RANK}",
            "--policy",
            "full",
            "--sample-steps",
            "0",
            "--out",
            str(tmp_path),
        ]
    )
    losses = jt.train(cfg)
    assert len(losses) == 3 and all(np.isfinite(losses))
