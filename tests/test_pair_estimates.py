"""The ControlNet step at the size people train it: its shapes-only time model (the step's FLOPs
against `FlopCounterMode` on the torch pair's real step), the one-network short forms of the pair
grammar (``controlnet:layers``, diffusers' ``train_controlnet.py``), and the GPU flavour's terms
on the pair (the ControlNet's units as the U-Net's encoder; the frozen encoder keeps nothing)."""

from __future__ import annotations

import pytest

from shared_configs.pair import CONTROLNET, controlnet_pair, split_pair_plan
from shared_configs.planning import gpu
from shared_configs.planning.recompute_time import step_seconds
from shared_configs.planning.unit_flops import pair_step_flops, pair_weights
from shared_configs.regime import Regime

PAIR = controlnet_pair("tiny")
BATCH, CONTEXT = 2, 5


@pytest.mark.slow  # the torch pair's real step under FlopCounterMode
def test_the_pair_steps_flops_equal_flop_counter() -> None:
    from torch.utils.flop_counter import FlopCounterMode

    from torch_impl.flops import register_cpu_attention_flops
    from torch_impl.profile import setup

    register_cpu_attention_flops()
    s = setup(PAIR, BATCH, CONTEXT)
    with FlopCounterMode(display=False) as counter:
        s["step"]()
    assert counter.get_total_flops() == pytest.approx(pair_step_flops(PAIR, BATCH, CONTEXT), rel=1e-9)
    trained = sum(p.numel() for p in s["model"].parameters() if p.requires_grad and p.dim() > 1)
    assert pair_weights(PAIR)[0] == trained  # the ControlNet's conv/matmul weights, as the optimizer updates them


def test_the_pair_step_is_priced_in_its_regime() -> None:
    trained, weights = pair_weights(PAIR)
    assert 0 < trained < weights
    plain = step_seconds(PAIR, BATCH, CONTEXT, Regime(), 0, 1e12, 1e12)
    assert plain == pytest.approx(pair_step_flops(PAIR, BATCH, CONTEXT) / 1e12 + 28 * trained / 1e12)  # AdamW's 7p
    mixed = step_seconds(PAIR, BATCH, CONTEXT, Regime("bf16-mixed"), 0, 1e12, 1e12)
    assert mixed - plain == pytest.approx(6 * weights / 1e12)  # both networks' weights cast once


@pytest.mark.parametrize(
    ("policy", "unet", "controlnet"),
    [("controlnet:layers", False, True), ("unet:full", True, False), ("layers", True, True)],
)
def test_one_network_short_forms(policy: str, unet: bool, controlnet: bool) -> None:
    plan = split_pair_plan(PAIR, policy)
    assert bool(plan.unet.recompute) == unet and bool(plan.controlnet.recompute) == controlnet
    assert plan.policy == policy  # written back in the short form
    if policy == "controlnet:layers":  # diffusers' enable_gradient_checkpointing() on the ControlNet alone
        assert plan.controlnet == split_pair_plan(PAIR, "layers").controlnet
    again = split_pair_plan(PAIR, plan.policy)
    assert (again.unet, again.controlnet) == (plan.unet, plan.controlnet)


def test_the_flavour_on_the_pair() -> None:
    regime = Regime("bf16-mixed")
    unet = gpu.kept_bytes(PAIR.unet, BATCH, regime)
    pair = gpu.kept_bytes(PAIR, BATCH, regime)
    for unit, extra in unet.items():
        encoder = not unit.startswith("up.") and unit != "head"
        # the ControlNet's copy of the encoder keeps what the U-Net's would; the frozen U-Net's keeps nothing
        assert pair.get(CONTROLNET + unit if encoder else unit) == extra
        assert not encoder or unit not in pair
    assert gpu.rounding_bound(PAIR, regime) == 2 * gpu.rounding_bound(PAIR.unet, regime)
