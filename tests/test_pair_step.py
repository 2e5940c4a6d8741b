"""The ControlNet training step in both frameworks (`torch_impl.pair`, `jax_impl.pair`): the U-Net
frozen (no gradients, eval mode), the ControlNet's gradients unchanged by a mixed pair plan, XLA's
op names filed by network, and ``benchmarks.plan --controlnet --verify`` end to end (torch, tiny)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from shared_configs.pair import controlnet_pair, example_pair_batch
from tests.helpers.policies import LossAndGrads, assert_plans_keep_loss_and_grads, jax_loss_and_grads
from tests.helpers.tensors import randomize_

PAIR = controlnet_pair("tiny", conditioning_embedding_out_channels=(8, 16))  # the image at 2x the sample
MIXED = "controlnet.down.0,up.1;controlnet.mid.resnets.1,controlnet.down.1.attentions.0,up.0/save=conv,matmul"


def _torch_step(pair: torch.nn.Module, policy: str) -> LossAndGrads:
    """The training step's loss and the ControlNet's gradients under ``policy``; the U-Net frozen."""
    from torch_impl.step import step_loss

    pair.enable_gradient_checkpointing(policy)
    assert (pair.plan.policy == "none") == (policy == "none")
    assert bool(pair.plan.controlnet.recompute) == bool(pair.plan.unet.recompute) == (policy != "none")
    opt = torch.optim.SGD([p for p in pair.parameters() if p.requires_grad], lr=0.0)  # steps nothing
    torch.manual_seed(0)  # the ControlNet's dropout: the same masks under every plan
    loss = step_loss(pair, opt, example_pair_batch(PAIR, 2, 3))
    assert all(p.grad is None for p in pair.unet.parameters()) and not pair.unet.training
    return loss.item(), {n: p.grad.clone() for n, p in pair.controlnet.named_parameters()}


def test_torch_pair_gradients_are_unchanged_by_a_mixed_plan() -> None:
    from torch_impl.pair import ControlNetPair

    torch.manual_seed(0)
    pair = ControlNetPair(PAIR)
    randomize_(pair.controlnet, seed=6)  # the zero convolutions too: zero residuals would pass no gradient
    _, grads = assert_plans_keep_loss_and_grads(lambda policy: _torch_step(pair, policy), [MIXED])  # bit for bit
    assert all(g.abs().sum() > 0 for g in list(grads.values())[:3])


@pytest.mark.slow
def test_jax_pair_gradients_are_unchanged_by_a_mixed_plan() -> None:
    import jax

    from jax_impl.pair import ControlNetPair, init_pair, loss_fn
    from jax_impl.regime import make_optimizer
    from jax_impl.step import arrays

    state, unet_params = init_pair(ControlNetPair(spec=PAIR), make_optimizer(1e-4, 0.0), 0)
    keys = iter(jax.random.split(jax.random.key(6), len(jax.tree.leaves(state.params))))
    params = jax.tree.map(lambda p: p + 0.2 * jax.random.normal(next(keys), p.shape), state.params)
    batch = arrays(example_pair_batch(PAIR, 2, 3))

    def step(policy: str) -> LossAndGrads:
        pair = ControlNetPair(spec=PAIR, policy=policy)
        return jax_loss_and_grads(lambda p: loss_fn(p, unet_params, pair, batch, jax.random.key(1)), params)

    _, plain = assert_plans_keep_loss_and_grads(step, [MIXED], tol=1e-5, atol=1e-6, loss_tol=1e-6)
    assert sum(float(np.abs(g).sum()) > 0 for g in plain.values()) > len(plain) // 2


@pytest.mark.slow
def test_plan_controlnet_verify_fits_when_measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end on torch (profile, check and measurement in worker processes): the plan fits."""
    from benchmarks import plan as cli
    from shared_configs.planning.pipeline import CACHE_ENV
    from shared_configs.sizes import MIB

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    out = tmp_path / "plan.json"
    argv = [
        "--config",
        "tiny",
        "--batch-size",
        "2",
        "--context-length",
        "3",
        "--controlnet",
        "--budget-mib",
        "14",
        "--verify",
        "--candidates",
        "0",
        "--steps",
        "1",
        "--json",
        str(out),
    ]
    assert cli.main(argv) == 0
    doc = json.loads(out.read_text())
    torch_doc = doc["frameworks"]["torch"]
    assert torch_doc["measured_peak_bytes"] <= 14 * MIB
    assert abs(torch_doc["predicted_peak_bytes"] / torch_doc["measured_peak_bytes"] - 1) <= 0.05


def test_xla_op_names_are_filed_under_each_networks_units() -> None:
    from jax_impl.xla_dump import unit_of

    units = {"controlnet.stem", "controlnet.down.1", "controlnet.head", "stem", "down.1.resnets.0", "up.0", "head"}
    base = "jit(train_step)/jvp(ControlNetPair)"
    assert unit_of(f"{base}/controlnet/controlnet._encode/down_1/resnets_0/conv1/add", units) == "controlnet.down.1"
    assert unit_of(f"{base}/unet/unet._encode/down_1/resnets_0/conv1/add", units) == "down.1.resnets.0"
    assert unit_of(f"{base}/controlnet/controlnet_cond_embedding/blocks_0/conv", units) == "controlnet.stem"
    assert unit_of(f"{base}/controlnet/controlnet_down_blocks_3/conv", units) == "controlnet.head"
    assert unit_of(f"{base}/controlnet/time_embedding/linear_1/dot", units) == "controlnet.stem"
    back = "jit(train_step)/transpose(jvp(ControlNetPair))/unet/up_0/jvp(ControlNetPair)/unet/up_0/checkpoint/x"
    assert unit_of(back, units) == "up.0"


def test_plan_for_budget_takes_the_pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_impl.plan_for_budget on a `ControlNetPair` (or a spec with controlnet=True) plans its step:
    a random profile of the pair cached, the peak check stood in for by the profile's prediction."""
    import torch_impl
    from shared_configs.planning import pipeline
    from shared_configs.planning.budget import predict
    from shared_configs.planning.units import assignment_of
    from tests.helpers.specs import random_profile

    monkeypatch.setenv(pipeline.CACHE_ENV, str(tmp_path))
    work = pipeline.Workload.of(PAIR, batch_size=2)
    profile = random_profile(PAIR, 4, framework="torch")
    profile.save(pipeline.profile_path("torch", work))

    def run_worker(request: dict) -> dict:
        (policy,) = request["policies"]
        return {"peaks": {policy: predict(profile, PAIR, assignment_of(PAIR, policy)).peak_bytes}}

    monkeypatch.setattr(pipeline, "run_worker", run_worker)
    budget = predict(profile, PAIR, {}).peak_bytes * 9 // 10
    pair = torch_impl.ControlNetPair(PAIR)
    policy = torch_impl.plan_for_budget(pair, 2, budget)
    assert pair.enable_gradient_checkpointing(policy).recompute  # a pair policy, something recomputed
    assert predict(profile, PAIR, assignment_of(PAIR, policy)).peak_bytes <= budget
