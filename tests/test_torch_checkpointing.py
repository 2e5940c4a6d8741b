"""PyTorch: checkpointing changes nothing but memory and time, and is really applied."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from shared_configs import resolve_plan
from tests.helpers.policies import LossAndGrads, assert_plans_keep_loss_and_grads, torch_loss_and_grads
from tests.helpers.specs import variant
from torch_impl import UNet
from torch_impl.flops import register_cpu_attention_flops

register_cpu_attention_flops()

POLICIES = ["full", "balanced", "layers", "every:2", ["down.1.attentions.0", "mid", "up.0.resnets.1"]]


def _inputs(model: UNet, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    s = model.spec
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, s.in_channels, s.sample_size, s.sample_size, generator=gen)
    t = torch.tensor([3.0, 700.0])[:batch]
    ctx = torch.randn(batch, 5, s.cross_attention_dim, generator=gen) if s.cross_attention_dim else None
    return x, t, ctx


def _step(model: UNet, policy: object, seed: int = 0) -> LossAndGrads:
    """Loss and gradients under ``policy``, the dropout masks drawn from ``seed``."""
    if policy == "none":
        model.disable_gradient_checkpointing()
    else:
        assert model.enable_gradient_checkpointing(policy).recompute
    return torch_loss_and_grads(model, _inputs(model), seed=seed)


@pytest.fixture(scope="module")
def model() -> UNet:
    torch.manual_seed(0)
    m = UNet(variant("tiny", dropout=0.3))
    m.train()
    return m


@pytest.mark.parametrize("policy", POLICIES, ids=str)
def test_gradients_equal_plain_with_dropout(model: UNet, policy: object) -> None:
    ref_loss, _ = assert_plans_keep_loss_and_grads(lambda p: _step(model, p), [policy])  # bit for bit
    model.disable_gradient_checkpointing()
    assert _step(model, "none", seed=1)[0] != ref_loss  # dropout is really on: another seed gives another loss


def test_state_dict_keys_unchanged(model: UNet) -> None:
    keys = list(model.state_dict())
    for policy in ["full", "layers", "balanced"]:
        model.enable_gradient_checkpointing(policy)
        assert list(model.state_dict()) == keys
        fresh = UNet(model.spec)
        fresh.load_state_dict(model.state_dict(), strict=True)
    model.disable_gradient_checkpointing()


def _flops(model: UNet, backward: bool) -> tuple[int, dict[str, int]]:
    """Total FLOPs of a forward (and backward) pass, and the per-module breakdown."""
    x, t, ctx = _inputs(model)
    with FlopCounterMode(display=False) as counter:
        out = model(x, t, ctx)
        if backward:
            out.sum().backward()
    per_module = {k.removeprefix("UNet."): sum(v.values()) for k, v in counter.get_flop_counts().items()}
    return counter.get_total_flops(), per_module


@pytest.mark.parametrize("policy", ["full", "balanced", "layers", "every:3"])
def test_backward_recomputes_exactly_the_planned_blocks(model: UNet, policy: str) -> None:
    model.eval()  # FLOPs do not depend on dropout; keep it simple
    model.disable_gradient_checkpointing()
    _, forward_per_module = _flops(model, backward=False)
    plain_total, _ = _flops(model, backward=True)
    plan = model.enable_gradient_checkpointing(policy)
    # Early stop (the default) ends each recompute once the last needed tensor is rebuilt, so a
    # block's final op is skipped; without it the recompute is exactly the block's forward.
    with set_checkpoint_early_stop(False):
        total, _ = _flops(model, backward=True)
    with_early_stop, _ = _flops(model, backward=True)
    model.disable_gradient_checkpointing()
    model.train()
    recomputed_forward = sum(forward_per_module[name] for name in plan.recompute)
    assert recomputed_forward > 0
    assert total - plain_total == recomputed_forward
    assert plain_total < with_early_stop < total


def test_disable_restores_plain(model: UNet) -> None:
    model.enable_gradient_checkpointing("full")
    model.disable_gradient_checkpointing()
    assert model.plan == resolve_plan(model.spec, "none")
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_missing_context_is_a_clear_error(model: UNet) -> None:
    x, t, _ = _inputs(model)
    with pytest.raises(ValueError, match=r"context: spec 'tiny' has cross-attention"):
        model(x, t)


def test_cpu_attention_flops_are_counted(model: UNet) -> None:
    model.eval()
    _, per_module = _flops(model, backward=False)
    model.train()
    b, t, c = 2, model.spec.sample_size**2, model.spec.block_out_channels[0]  # down.0: self-attention
    linears = 4 * 2 * b * t * c * c  # q, k, v, out projections
    scores_and_mix = 2 * 2 * b * t * t * c  # q @ k^T and softmax @ v, summed over heads
    assert per_module["down.0.attentions.0"] == linears + scores_and_mix
