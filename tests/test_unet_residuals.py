"""Our U-Nets take a ControlNet's residuals (``down_block_additional_residuals``,
``mid_block_additional_residual``) as diffusers' ``UNet2DConditionModel`` does: same outputs given
the same residuals (torch and Flax), gradients unchanged under every checkpoint policy.

Reference: diffusers' U-Net with our weights (`tests.helpers.diffusers_ref.diffusers_pair`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_impl import UNet as FlaxUNet
from jax_impl.convert import torch_to_flax
from shared_configs.controlnet import residual_shapes
from shared_configs.inputs import example_inputs
from tests.helpers.diffusers_ref import diffusers_pair
from tests.helpers.policies import (
    LossAndGrads,
    assert_plans_keep_loss_and_grads,
    jax_loss_and_grads,
    torch_loss_and_grads,
)
from tests.helpers.specs import variant
from tests.helpers.tensors import as_flax, as_torch, randomize_, rel_err
from torch_impl import UNet

SIZE = 8


def _case(name: str) -> tuple[Any, dict[str, Any], list[np.ndarray], np.ndarray]:
    spec = variant(name, dropout=0.0)
    inputs = example_inputs(spec, np.random.default_rng(2), batch=2, context_len=3)
    inputs["t"] = np.array([11.0, 860.0], dtype=np.float32)
    rng = np.random.default_rng(5)
    down_shapes, mid_shape = residual_shapes(spec, 2, SIZE)
    down = [rng.standard_normal(s).astype(np.float32) for s in down_shapes]
    return spec, inputs, down, rng.standard_normal(mid_shape).astype(np.float32)


@pytest.mark.slow  # both frameworks and diffusers' ControlNet: the torch plans' gradients stay
@pytest.mark.parametrize("name", ["sd_linear_proj", "sdxl_style"])
def test_residuals_match_diffusers_in_both_frameworks(name: str) -> None:
    spec, inputs, down, mid = _case(name)
    ours, theirs = diffusers_pair(spec)
    randomize_(ours, seed=4)
    theirs.load_state_dict(ours.to_diffusers_state_dict(), strict=True)
    named = as_torch(inputs)
    down_t, mid_t = [torch.from_numpy(r) for r in down], torch.from_numpy(mid)
    extra: dict[str, Any] = {}
    if named.get("text_embeds") is not None:
        extra["added_cond_kwargs"] = {"text_embeds": named["text_embeds"], "time_ids": named["time_ids"]}
    with torch.no_grad():
        ref = theirs(
            named["x"],
            named["t"],
            named["context"],
            down_block_additional_residuals=tuple(down_t),
            mid_block_additional_residual=mid_t,
            **extra,
        ).sample
        plain = theirs(named["x"], named["t"], named["context"], **extra).sample
        out = ours.eval()(**named, down_block_additional_residuals=down_t, mid_block_additional_residual=mid_t)
    assert rel_err(ref, plain) > 1e-2  # the residuals change the output
    assert rel_err(out, ref) <= 1e-5
    params = torch_to_flax(ours.state_dict(), spec)
    flax_out = FlaxUNet(spec=spec).apply(
        {"params": params},
        **as_flax(inputs),
        down_block_additional_residuals=[r.transpose(0, 2, 3, 1) for r in down],
        mid_block_additional_residual=mid.transpose(0, 2, 3, 1),
    )
    assert rel_err(np.asarray(flax_out).transpose(0, 3, 1, 2), ref) <= 1e-5


def _torch_step(spec: Any, inputs: dict[str, Any], down: list, mid: np.ndarray, policy: str) -> LossAndGrads:
    """Loss and gradients of the parameters and of the residuals given, under ``policy``."""
    torch.manual_seed(0)
    model = UNet(spec, policy=policy).train()
    randomize_(model, seed=4)
    res = {f"down.{i}": torch.from_numpy(r).requires_grad_() for i, r in enumerate(down)}
    res["mid"] = torch.from_numpy(mid).requires_grad_()
    named = {**as_torch(inputs), "mid_block_additional_residual": res["mid"]}
    named["down_block_additional_residuals"] = [res[f"down.{i}"] for i in range(len(down))]
    wrt = {**dict(model.named_parameters()), **res}
    return torch_loss_and_grads(model, named, loss=lambda out: out.square().mean(), wrt=wrt)


@pytest.mark.parametrize("policy", ["full", "layers", "down.1,mid/save=conv"])
def test_torch_gradients_unchanged_under_plans(policy: str) -> None:
    spec, inputs, down, mid = _case("sd_linear_proj")
    _, plain = assert_plans_keep_loss_and_grads(lambda p: _torch_step(spec, inputs, down, mid, p), [policy])
    assert all(g.abs().sum() > 0 for name, g in plain.items() if name.startswith(("down.", "mid")))


@pytest.mark.heavy  # minutes of CPU: left out of the default run
def test_flax_gradients_unchanged_under_plans() -> None:
    spec, inputs, down, mid = _case("sd_linear_proj")
    named = as_flax(inputs)
    res = ([jnp.asarray(r.transpose(0, 2, 3, 1)) for r in down], jnp.asarray(mid.transpose(0, 2, 3, 1)))
    params = FlaxUNet(spec=spec).init(jax.random.key(0), **named)["params"]

    def step(policy: str) -> LossAndGrads:
        model = FlaxUNet(spec=spec, policy=policy)

        def loss(pr: tuple) -> jax.Array:
            (p, (down, mid)) = pr
            out = model.apply(
                {"params": p}, **named, down_block_additional_residuals=down, mid_block_additional_residual=mid
            )
            return jnp.mean(out**2)

        return jax_loss_and_grads(loss, (params, res))  # the residuals' gradients too

    # whole blocks; each layer alone
    assert_plans_keep_loss_and_grads(step, ("full", "layers"), tol=1e-5, atol=1e-6, loss_tol=1e-6)


def test_wrong_number_of_residuals_is_one_line() -> None:
    spec, inputs, down, _ = _case("sd_linear_proj")
    wanted = rf"down_block_additional_residuals: expected {len(down)} tensors .* got {len(down) - 1}"
    with pytest.raises(ValueError, match=wanted):
        UNet(spec)(**as_torch(inputs), down_block_additional_residuals=[torch.from_numpy(r) for r in down[:-1]])
