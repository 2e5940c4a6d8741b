"""The new families (SDXL-, SD 2.1-style, class-conditional) under every checkpoint policy, and the
spec's own ``checkpoint`` policy honoured the same way by both U-Nets.

The reference is the un-checkpointed model: each policy must give its loss and gradients, with
dropout on (torch replays the RNG state; JAX takes dropout keys as inputs). Torch-vs-Flax parity of
these variants after weight conversion is in `test_parity.py` (they are in `tests.helpers.specs.VARIANTS`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_impl import UNet as FlaxUNet
from jax_impl.unet import abstract_inputs
from shared_configs import resolve_plan
from shared_configs.inputs import example_inputs
from tests.helpers.policies import (
    LossAndGrads,
    assert_plans_keep_loss_and_grads,
    jax_loss_and_grads,
    torch_loss_and_grads,
)
from tests.helpers.specs import variant
from tests.helpers.tensors import as_flax, as_torch
from torch_impl import UNet as TorchUNet

FAMILIES = ("sdxl_style", "sd21_style", "class_cond", "class_timestep_concat")
TORCH_POLICIES = ("full", "balanced", "layers", "every:2", "save_convs")
# Flax: the block-level policy, on the two families whose embedding differs most (text_time, concat):
# the conditioning happens outside the blocks, and every policy is checked on `tiny` in test_jax_unet.
FLAX_CASES = ("sdxl_style", "class_timestep_concat")


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_policies_give_the_plain_gradients(family: str) -> None:
    torch.manual_seed(0)
    model = TorchUNet(variant(family, dropout=0.2)).train()
    inputs = as_torch(example_inputs(model.spec, np.random.default_rng(1), batch=2, context_len=3))

    def step(policy: str) -> LossAndGrads:
        assert bool(model.enable_gradient_checkpointing(policy).recompute) == (policy != "none")
        return torch_loss_and_grads(model, inputs, seed=0)  # the same dropout masks for every policy

    assert_plans_keep_loss_and_grads(step, TORCH_POLICIES)  # bit for bit


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

        def step(policy: str) -> LossAndGrads:
            def loss(p: dict) -> jax.Array:
                out = FlaxUNet(spec=spec, policy=policy).apply(
                    {"params": p}, **inputs, train=True, rngs={"dropout": jax.random.key(5)}
                )
                return jnp.mean(out * jnp.linspace(-1, 1, out.size).reshape(out.shape))

            return jax_loss_and_grads(loss, params)

        assert_plans_keep_loss_and_grads(step, ["full"], tol=1e-10, atol=1e-14, loss_tol=1e-12)


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
