"""The time model follows the regime: a step's FLOPs counted from the spec equal what
`FlopCounterMode` counts on the torch model's real training step, with every weight trained and
with LoRA on a frozen base (whose backward runs no weight gradients, only the adapters' small
matmuls), and a plan's recompute costs more of a LoRA step than of a full one."""

from __future__ import annotations

import pytest

from shared_configs.planning.budget import Cost, Profile, predict
from shared_configs.planning.recompute_time import (
    at_stated_rates,
    cast_bytes,
    step_flops,
    update_bytes,
)
from shared_configs.planning.unit_flops import recompute_flops, unit_flops, unit_ops
from shared_configs.planning.unit_flops import step_flops as counted
from shared_configs.planning.units import PLAIN, assignment_of, leaf_units
from shared_configs.regime import Regime
from shared_configs.spec import UNetSpec
from tests.helpers.specs import variant

BATCH, CONTEXT = 2, 5


def _counted_step(name: str, regime: Regime) -> tuple[int, int]:
    """`FlopCounterMode`'s (forward, forward + backward) FLOPs of ``name`` trained in ``regime``."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from torch_impl.flops import register_cpu_attention_flops
    from torch_impl.regime import apply_regime
    from torch_impl.unet import UNet

    register_cpu_attention_flops()
    torch.manual_seed(0)
    spec = variant(name)
    model = apply_regime(UNet(spec), regime)
    ctx = None if spec.cross_attention_dim is None else torch.randn(BATCH, CONTEXT, spec.cross_attention_dim)
    with FlopCounterMode(display=False) as forward:
        out = model(torch.randn(BATCH, spec.in_channels, 8, 8), torch.tensor([1.0, 2.0]), ctx)
    with FlopCounterMode(display=False) as backward:
        out.sum().backward()
    return forward.get_total_flops(), forward.get_total_flops() + backward.get_total_flops()


@pytest.mark.slow  # a real training step per regime under FlopCounterMode: seconds each on 2 shared cores
@pytest.mark.parametrize("name", ["tiny", "sd_linear_proj", "transformer_no_cross"])
@pytest.mark.parametrize("trainable", ["all", "lora:4"])
def test_step_flops_equal_flop_counter(name: str, trainable: str) -> None:
    """Forward, and forward + backward, as the spec counts them equal torch's count of the real
    step: all trained, the backward is input gradients (attention's 2.5x) plus weight gradients;
    under LoRA no weight gradient of the base, nothing before the first adapter, and the adapters."""
    regime = Regime("fp32", trainable)
    spec = variant(name, sample_size=8)
    forward, total = _counted_step(name, regime)
    mine = counted(spec, BATCH, CONTEXT, regime.lora_rank)
    with_adapters = unit_flops(spec, BATCH, CONTEXT, regime.lora_rank)
    adapters_forward = sum(sum(with_adapters[u].values()) for u in unit_ops(spec, BATCH, CONTEXT)) - mine.forward
    assert forward == pytest.approx(mine.forward + adapters_forward, rel=1e-9)
    assert total == pytest.approx(mine.total, rel=1e-9)
    assert step_flops(spec, BATCH, CONTEXT, regime) == mine.total
    if regime.lora_rank is None:
        assert mine.adapters == 0 and mine.trained_weights == mine.weights
        assert 2.6 < mine.total / mine.forward < 3.6  # about three forwards
    else:
        assert mine.weight_grads == 0 and 0 < mine.adapters < 0.2 * mine.forward
        assert 1.4 < mine.total / mine.forward < 2.6  # about two: the backward ~ one forward + adapters
        # backward FLOPs ~ forward FLOPs (input gradients, attention's 2.5x) + the adapters'
        backward = total - forward
        assert backward == pytest.approx(mine.input_grads + mine.adapters - adapters_forward, rel=1e-9)


@pytest.mark.slow
def test_trained_weights_match_the_model() -> None:
    """The conv/matmul weights the spec counts are the model's (biases and norms aside), and under
    LoRA the adapters' parameters exactly."""
    from torch_impl.regime import apply_regime, trained_parameters
    from torch_impl.unet import UNet

    spec = variant("tiny")
    model = UNet(spec)
    weights = sum(p.numel() for p in model.parameters() if p.dim() > 1)
    assert counted(spec, 1, CONTEXT).weights == weights
    lora = apply_regime(UNet(spec), Regime("fp32", "lora:4"))
    assert counted(spec, 1, CONTEXT, 4).trained_weights == sum(p.numel() for p in trained_parameters(lora))


def test_sd15_step_counts() -> None:
    """SD 1.5 at 64x64, batch 1: its U-Net's 859.1M conv/matmul weights (diffusers counts 859.5M
    parameters, norms and biases included); every weight trained, a step is about three forwards,
    with rank-16 LoRA about two and 3.19M adapter weights."""
    from shared_configs.loader import load_spec, spec_from_dict

    spec = spec_from_dict({**load_spec("sd15").model_dump(), "sample_size": 64})
    full, lora = counted(spec, 1), counted(spec, 1, lora_rank=16)
    assert full.weights == full.trained_weights == 859_077_120 and lora.trained_weights == 3_188_736
    assert full.forward == lora.forward and lora.weight_grads == 0 and lora.adapters < 0.02 * lora.forward
    assert 3.0 < full.total / full.forward < 3.1 and 2.2 < lora.total / lora.forward < 2.25
    assert lora.input_grads < full.input_grads  # no backward before the first adapter


def test_update_and_cast_bytes() -> None:
    n = 1000
    assert update_bytes(Regime(), n) == 28 * n  # AdamW fp32: read w, g, m, v; write w, m, v
    assert update_bytes(Regime("bf16"), n) == 14 * n
    assert update_bytes(Regime(optimizer="adamw8bit"), n) == pytest.approx((12 + 4 + 16 / 256) * n)
    assert update_bytes(Regime(optimizer="adafactor"), n) == 12 * n
    assert update_bytes(Regime(ema=True), n) == (28 + 12) * n
    assert cast_bytes(Regime(), n) == 0 and cast_bytes(Regime("bf16"), n) == 0
    assert cast_bytes(Regime("bf16-mixed"), n) == 6 * n


def _profile(spec: UNetSpec, regime: str, keep: int = 1 << 10) -> Profile:
    """A profile of ``spec`` whose every unit keeps ``keep`` bytes plain and none recomputed."""
    flops = unit_flops(spec, BATCH, CONTEXT)
    units = {}
    for unit in flops:
        units[unit] = {PLAIN: Cost(keep=keep, fwd_peak=keep, bwd_peak=keep)}
        units[unit]["full"] = Cost(keep=0, fwd_peak=keep, bwd_peak=keep, flops=recompute_flops(flops[unit], "full"))
    return Profile(
        "torch",
        spec.name,
        spec.sample_size,
        BATCH,
        units,
        opt_peak=0,
        step_time_s=0.0,
        mode="shapes",
        context_length=CONTEXT,
        regime=regime,
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_lora_recompute_costs_more_of_its_step(precision: str) -> None:
    """The same plan (every layer recomputed), the same recompute: under LoRA the step is smaller,
    so its overhead is larger; and the priced step is the formula's sum."""
    spec = variant("tiny", sample_size=8)
    assignment = assignment_of(spec, "layers")
    overheads = {}
    for trainable in ("all", "lora:4"):
        regime = Regime(precision, trainable)
        priced = at_stated_rates(_profile(spec, regime.describe()), spec, BATCH, CONTEXT, 1e12, 1e11, regime)
        c = counted(spec, BATCH, CONTEXT, regime.lora_rank)
        kept = sum(1 << 10 for _ in leaf_units(spec, {}))
        update = update_bytes(regime, c.trained_weights) + cast_bytes(regime, c.weights)
        assert priced.step_time_s == pytest.approx(c.total / 1e12 + (2 * kept + update) / 1e11)
        overheads[trainable] = predict(priced, spec, assignment).overhead(priced)
    assert overheads["lora:4"] > 1.2 * overheads["all"] > 0


def test_unit_ops_are_in_forward_order() -> None:
    units = list(unit_ops(variant("tiny"), 1))
    assert units[0] == "stem" and units[-1] == "head"
    assert units.index("mid.resnets.0") < units.index("mid.attentions.0") < units.index("mid.resnets.1")
