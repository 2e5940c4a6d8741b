"""The new families (SDXL-, SD 2.1-style, class-conditional) under every checkpoint policy, and the
spec's own ``checkpoint`` policy honoured the same way by both U-Nets.

The reference is the un-checkpointed model: each policy must give its loss and gradients, with
dropout on (torch replays the RNG state; JAX takes dropout keys as inputs). Torch-vs-Flax parity of
these variants after weight conversion is in `test_parity.py` (they are in `tests.helpers.specs.VARIANTS`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import traverse_util

from jax_impl import UNet as FlaxUNet
from jax_impl.unet import abstract_inputs
from shared_configs import resolve_plan
from shared_configs.inputs import example_inputs
from tests.helpers.specs import FAST_COMPILE, variant
from tests.helpers.tensors import as_flax, as_torch, rel_err
from torch_impl import UNet as TorchUNet

FAMILIES = ("sdxl_style", "sd21_style", "class_cond", "class_timestep_concat")
TORCH_POLICIES = ("full", "balanced", "layers", "every:2", "save_convs")
# Flax: the block-level policy, on the two families whose embedding differs most (text_time, concat):
# the conditioning happens outside the blocks, and every policy is checked on `tiny` in test_jax_unet.
FLAX_CASES = ("sdxl_style", "class_timestep_concat")


def _torch_loss_and_grads(model: TorchUNet, inputs: dict[str, Any]) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same dropout masks for every policy
    out = model(**inputs)
    loss = (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).mean()
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_policies_give_the_plain_gradients(family: str) -> None:
    torch.manual_seed(0)
    model = TorchUNet(variant(family, dropout=0.2)).train()
    inputs = as_torch(example_inputs(model.spec, np.random.default_rng(1), batch=2, context_len=3))
    ref_loss, ref = _torch_loss_and_grads(model, inputs)
    for policy in TORCH_POLICIES:
        assert model.enable_gradient_checkpointing(policy).recompute
        loss, grads = _torch_loss_and_grads(model, inputs)
        model.disable_gradient_checkpointing()
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss), policy
        for name, g in grads.items():
            assert rel_err(g, ref[name]) <= 1e-5, (policy, name)


@pytest.mark.slow
@pytest.mark.parametrize("family", FLAX_CASES)
def test_flax_remat_gives_the_plain_gradients(family: str) -> None:
    """float64, as in test_jax_unet: float32 remat reorders reductions (~1e-6); a wrong mask or recompute is O(1)."""
    spec = variant(family, dropout=0.2)
    with jax.enable_x64(True):
        inputs = as_flax(example_inputs(spec, np.random.default_rng(1), batch=2, context_len=3))
        inputs = {k: v if v is None or v.dtype == jnp.int32 else v.astype(jnp.float64) for k, v in inputs.items()}
        shapes = jax.eval_shape(FlaxUNet(spec=spec).init, jax.random.key(0), **abstract_inputs(spec))["params"]
        rng = np.random.default_rng(2)
        params = jax.tree.map(lambda s: jnp.asarray(0.2 * rng.standard_normal(s.shape)), shapes)

        def grads(policy: str) -> Any:
            def loss(p: dict) -> jax.Array:
                out = FlaxUNet(spec=spec, policy=policy).apply(
                    {"params": p}, **inputs, train=True, rngs={"dropout": jax.random.key(5)}
                )
                return jnp.mean(out * jnp.linspace(-1, 1, out.size).reshape(out.shape))

            return jax.value_and_grad(loss)(params)

        step = jax.jit(lambda: (grads("none"), grads("full"))).lower().compile(FAST_COMPILE)
        (ref_loss, ref), (loss, got) = jax.tree.map(np.asarray, step())
    assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss)
    ref = traverse_util.flatten_dict(ref)
    for key, g in traverse_util.flatten_dict(got).items():
        assert np.linalg.norm(g - ref[key]) <= 1e-10 * max(np.linalg.norm(ref[key]), 1e-30) + 1e-14, key


def test_the_spec_checkpoint_policy_is_honoured_by_both() -> None:
    """A spec's ``checkpoint`` field: torch applies it at construction, as Flax's ``policy=None`` does."""
    spec = variant("sdxl_style", checkpoint="balanced")
    plan = resolve_plan(spec)
    assert plan.recompute == ("down.1", "mid", "up.0")
    model = TorchUNet(spec)
    assert model.plan == plan == FlaxUNet(spec=spec).plan
    calls = []  # the checkpoint runs mid's own forward again, which calls its first ResNet again
    model.mid.resnets[0].register_forward_hook(lambda *_: calls.append(1))
    inputs = as_torch(example_inputs(spec, np.random.default_rng(0), batch=2, context_len=3))
    model(**inputs).sum().backward()
    assert len(calls) == 2  # the forward, and the recompute in the backward pass
    model.disable_gradient_checkpointing()
    calls.clear()
    model(**inputs).sum().backward()
    assert len(calls) == 1
