"""`torch_impl.apply_plan` on diffusers' own ``ControlNetModel``: its units are named as the U-Net's
(``down.1`` is ``down_blocks.1``, ``mid`` is ``mid_block``), exactly those recompute, and the
gradients equal the same model's without a plan (the reference), under ``full``, ``layers`` and
mixed plans; `remove_plan` undoes it.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

from shared_configs import SpecError, to_diffusers_config
from tests.helpers.policies import LossAndGrads, assert_same_loss_and_grads, checkpointed_names, torch_loss_and_grads
from tests.helpers.specs import variant
from tests.helpers.tensors import count_flops, randomize_
from torch_impl import apply_plan, remove_plan

MIXED = "down.0;down.1.resnets.0,mid/save=conv,matmul"


class _Loss(torch.nn.Module):
    """diffusers' ControlNetModel on fixed inputs -> one weighted sum of its residuals."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        down, mid = self.net(x, t, ctx, cond, conditioning_scale=0.9, return_dict=False)
        return sum((r * torch.linspace(-1, 1, r.numel()).reshape(r.shape)).sum() for r in [*down, mid])


@pytest.fixture(scope="module")
def case() -> dict[str, Any]:
    import diffusers

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unet = diffusers.UNet2DConditionModel.from_config(to_diffusers_config(variant("sd_linear_proj", dropout=0.0)))
        net = diffusers.ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 16))
    randomize_(net, seed=3)
    gen = torch.Generator().manual_seed(1)
    inputs = (
        torch.randn(2, 4, 8, 8, generator=gen),
        torch.tensor([5.0, 700.0]),
        torch.randn(2, 3, 12, generator=gen),
        torch.randn(2, 3, 16, 16, generator=gen),
    )
    model = _Loss(net.train())
    return {"net": net, "model": model, "inputs": inputs, "plain": _step(model, inputs)}


def _step(model: torch.nn.Module, inputs: tuple) -> LossAndGrads:
    return torch_loss_and_grads(model, inputs, loss=lambda out: out)  # `_Loss` gives the loss


@pytest.mark.parametrize("policy", ["full", "layers", MIXED])
def test_gradients_unchanged_under_a_plan(case: dict[str, Any], policy: str) -> None:
    net, model = case["net"], case["model"]
    plan = apply_plan(net, policy)
    try:
        assert checkpointed_names(net) and all(not n.startswith("up_blocks") for n in checkpointed_names(net))
        got = _step(model, case["inputs"])
    finally:
        remove_plan(net)
    assert checkpointed_names(net) == []
    assert plan.recompute
    assert_same_loss_and_grads(got, case["plain"])  # bit for bit


@pytest.mark.slow
def test_units_are_diffusers_modules_and_really_recompute(case: dict[str, Any]) -> None:
    net, model, inputs = case["net"], case["model"], case["inputs"]
    with set_checkpoint_early_stop(False):  # recompute whole units, so the FLOPs add up exactly
        plain, _ = count_flops(model, inputs, backward=True)
        apply_plan(net, "full")
        try:
            assert checkpointed_names(net) == ["down_blocks.0", "down_blocks.1", "mid_block"]
            planned, _ = count_flops(model, inputs, backward=True)
        finally:
            remove_plan(net)
    assert planned > plain  # the recompute is counted in the backward pass


def test_refusals_are_one_line(case: dict[str, Any]) -> None:
    net = case["net"]
    with pytest.raises(SpecError, match=r"^policy: a ControlNet has no unit 'up\.0'"):
        apply_plan(net, "down.0,up.0")
    net.enable_gradient_checkpointing()
    try:
        with pytest.raises(ValueError, match=r"^gradient_checkpointing: diffusers' own checkpointing is on"):
            apply_plan(net, "full")
    finally:
        net.disable_gradient_checkpointing()
