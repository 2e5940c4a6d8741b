"""`torch_impl.apply_plan` on diffusers' own U-Nets: exactly the plan's units recompute, gradients
equal the plain diffusers model's, the peak equals our U-Net's under the same plan, and
`remove_plan` undoes it.

References: the same diffusers model without a plan (gradients, FLOPs), FLOPs counted per
diffusers module, and our U-Net with the same weights measured by the benchmark's tracker (peaks).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

from benchmarks.backends.diffusers_bench import DiffusersForward
from benchmarks.harness.job import load_benchmark_spec
from shared_configs import SpecError, UNetSpec, block_names, layer_names
from shared_configs.training.data import example_batch
from tests.helpers.diffusers_ref import diffusers_pair
from tests.helpers.policies import assert_same_loss_and_grads, checkpointed_names, torch_loss_and_grads
from tests.helpers.specs import variant
from tests.helpers.tensors import count_flops
from torch_impl import UNet, apply_plan, remove_plan
from torch_impl.diffusers_adapter import diffusers_path, diffusers_spec
from torch_impl.memory import StepTracker
from torch_impl.step import as_tensors
from torch_impl.train import make_optimizer, train_step

CONTEXT = 8  # cross-attention tokens
SPECS = {  # a UNet2DConditionModel as sd_narrow, an SDXL-shaped one (text_time, 2 transformer layers), a UNet2DModel
    "sd_narrow": lambda: load_benchmark_spec("sd_narrow", 16),  # 16x16 latents: its 32x32 step takes seconds
    "sdxl_tiny": lambda: variant("sdxl_style", dropout=0.0),
    "ddpm_tiny": lambda: variant("ddpm_style", dropout=0.0),
}
POLICIES = [
    "full",
    "layers",
    "balanced",
    "down.1,mid",
    "layers/save=conv,matmul",
    "down.0,up.1;down.1,mid/save=conv+matmul",
]


@pytest.fixture(scope="module", params=list(SPECS))
def case(request: pytest.FixtureRequest) -> dict[str, Any]:
    spec = SPECS[request.param]()
    unet = diffusers_pair(spec)[1]
    noisy, t, _, conditioning = as_tensors(example_batch(spec, 2, CONTEXT))
    model = DiffusersForward(unet)
    inputs = (noisy, t, *conditioning.values())
    plain = torch_loss_and_grads(model, inputs)
    return {"spec": spec, "unet": unet, "model": model, "inputs": inputs, "plain": plain}


def test_every_plan_name_is_the_diffusers_module_of_that_role(case: dict[str, Any]) -> None:
    """Found from diffusers' module tree alone: its ResNets, attention layers and blocks are exactly
    the units a plan can name."""
    spec, unet = case["spec"], case["unet"]
    modules = dict(unet.named_modules())
    resnets = {n for n, m in modules.items() if type(m).__name__ == "ResnetBlock2D"}
    attentions = {n for n, m in modules.items() if n.split(".")[-2:-1] == ["attentions"]}
    blocks = {
        n
        for n in modules
        if n == "mid_block" or (n.count(".") == 1 and n.split(".")[0] in ("down_blocks", "up_blocks"))
    }
    layers = [diffusers_path(n) for n in layer_names(spec)]
    assert {p for p in layers if ".resnets." in p} == resnets
    assert {p for p in layers if ".attentions." in p} == attentions and attentions
    assert {diffusers_path(n) for n in block_names(spec)} == blocks
    assert {type(modules[p]).__name__ for p in attentions} <= {"Transformer2DModel", "Attention"}


@pytest.mark.slow_for(  # seconds each: sd_narrow keeps one plan in the inner loop
    *(f"sd_narrow-{p}" for p in POLICIES if p != "down.1,mid")
)
@pytest.mark.parametrize("policy", POLICIES)
def test_gradients_equal_the_plain_models(case: dict[str, Any], policy: str) -> None:
    unet, model = case["unet"], case["model"]
    plan = apply_plan(unet, policy)
    try:
        assert set(checkpointed_names(unet)) == {diffusers_path(n) for n in plan.recompute} != set()
        got = torch_loss_and_grads(model, case["inputs"])
    finally:
        remove_plan(unet)
    assert_same_loss_and_grads(got, case["plain"])  # bit for bit


@pytest.mark.slow_for("sd_narrow-full", "sdxl_tiny-full", "ddpm_tiny-layers")
@pytest.mark.parametrize("policy", ["full", "layers", "every:2"])
def test_backward_recomputes_exactly_the_planned_units(case: dict[str, Any], policy: str) -> None:
    """Backward FLOPs grow by the planned units' forward FLOPs (diffusers' modules, counted apart)."""
    unet, model, inputs = case["unet"], case["model"], case["inputs"]
    if "flops" not in case:  # the plain model's, once per model
        case["flops"] = (count_flops(model, inputs, backward=False)[1], count_flops(model, inputs, backward=True)[0])
    forward_per_module, plain_total = case["flops"]
    plan = apply_plan(unet, policy)
    try:
        with set_checkpoint_early_stop(False):  # the recompute is then the unit's whole forward
            total, _ = count_flops(model, inputs, backward=True)
    finally:
        remove_plan(unet)
    recomputed = sum(forward_per_module["unet." + diffusers_path(name)] for name in plan.recompute)
    assert recomputed > 0
    assert total - plain_total == recomputed


def test_remove_restores_the_forward_that_was_there(case: dict[str, Any]) -> None:
    """A forward someone else set on a unit (accelerate's hooks do) runs under the plan and is back after."""
    unet, model, inputs = case["unet"], case["model"], case["inputs"]
    block, calls = unet.mid_block, []
    plain = block.forward

    def hooked(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return plain(*args, **kwargs)

    block.forward = hooked
    apply_plan(unet, "full")
    apply_plan(unet, "mid")  # a second plan replaces the first
    assert checkpointed_names(unet) == ["mid_block"]
    model(*inputs).sum().backward()
    assert len(calls) == 2  # the forward, and its recompute in the backward
    remove_plan(unet)
    assert block.forward is hooked and checkpointed_names(unet) == []
    del block.forward
    assert all("forward" not in m.__dict__ for m in unet.modules())
    assert_same_loss_and_grads(torch_loss_and_grads(model, inputs), case["plain"])  # bit for bit


def test_refusals_are_one_line(case: dict[str, Any]) -> None:
    unet, spec = case["unet"], case["spec"]
    unet.enable_gradient_checkpointing()
    try:
        with pytest.raises(ValueError, match=r"^gradient_checkpointing: diffusers' own checkpointing is on.*disable"):
            apply_plan(unet, "layers")
    finally:
        unet.disable_gradient_checkpointing()
    with pytest.raises(SpecError, match=r"^policy: unknown block name 'down.9'"):
        apply_plan(unet, "down.9")
    with pytest.raises(TypeError, match=r"^model: apply_plan takes diffusers' UNet2DModel or UNet2DConditionModel"):
        apply_plan(torch.nn.Linear(2, 2), "full")
    saved = unet.mid_block.resnets
    unet.mid_block.resnets = torch.nn.ModuleList([saved[0]])  # a model that lost a unit
    try:
        with pytest.raises(ValueError, match=r"^plan: unit 'mid.resnets.1' has no module 'mid_block.resnets.1'"):
            apply_plan(unet, "full")
    finally:
        unet.mid_block.resnets = saved
    assert checkpointed_names(unet) == []
    ours = UNet(spec)
    assert apply_plan(ours, "balanced") == ours.plan  # our U-Net: its own enable_gradient_checkpointing
    assert set(checkpointed_names(ours)) == set(ours.plan.recompute) != set()


def _peak(model: torch.nn.Module, spec: UNetSpec, batch_size: int) -> int:
    """The peak of one training step (`torch_impl.train.train_step`, AdamW state made by a warm-up)."""
    optimizer = make_optimizer(model, 1e-4, 0.0)
    step = functools.partial(train_step, model, optimizer, example_batch(spec, batch_size, CONTEXT))
    step()
    with StepTracker(model, optimizer) as tracker:
        step()
    return tracker.result.peak


PEAK_CASES = [
    ("sd_narrow", 8, ["full", "layers", "balanced"]),
    ("sdxl_tiny", 16, ["full", "layers", "down.0,up.1;down.1,mid/save=conv+matmul"]),
    ("ddpm_tiny", 16, ["full", "layers/save=conv,matmul"]),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "batch_size", "policies"), PEAK_CASES, ids=[c[0] for c in PEAK_CASES])
def test_peak_equals_our_unets_under_the_same_plan(name: str, batch_size: int, policies: list[str]) -> None:
    spec = SPECS[name]()
    peaks: dict[str, tuple[int, int]] = {}
    for policy in ["none", *policies]:
        ours, theirs = diffusers_pair(spec)
        processors = {type(m.processor).__name__ for m in theirs.modules() if hasattr(m, "processor")}
        assert processors == {"AttnProcessor2_0"}  # F.scaled_dot_product_attention, as ours
        apply_plan(ours, policy)
        apply_plan(theirs, policy)
        peaks[policy] = (_peak(ours, spec, batch_size), _peak(DiffusersForward(theirs), spec, batch_size))
    for policy, (mine, theirs_peak) in peaks.items():
        assert abs(theirs_peak / mine - 1) <= 0.03, (policy, peaks)
        assert policy == "none" or mine < peaks["none"][0], (policy, peaks)  # the plan really saves memory


@pytest.mark.slow
def test_the_diffusers_lora_example_plans_and_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/examples/finetune_diffusers_lora.py end to end on sd_narrow's diffusers model (16x16):
    from a pipeline folder, LoRA through peft, a budget between the regime's `full` and `none`
    peaks, bf16 autocast; the plan it applies recomputes something and the loss is finite."""
    import importlib.util

    from shared_configs.planning.pipeline import CACHE_ENV, Workload, predict_policy
    from shared_configs.regime import Regime

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    _, theirs = diffusers_pair(SPECS["sd_narrow"]())
    theirs.save_pretrained(tmp_path / "pipe" / "unet")
    work = Workload(diffusers_spec(theirs), 2, Regime("bf16-mixed", "lora:4"))  # the example's own workload
    none, full = (predict_policy(work, p)[0].predictions[0].peak_bytes for p in ("none", "full"))
    assert full < none
    path = Path(__file__).parents[1] / "docs" / "examples" / "finetune_diffusers_lora.py"
    example = importlib.util.module_from_spec(importlib.util.spec_from_file_location("example", path))
    example.__spec__.loader.exec_module(example)
    budget_mib = (none + full) / 2 / (1 << 20)
    argv = [str(tmp_path / "pipe"), "--budget-mib", str(budget_mib), "--batch-size", "2", "--steps", "2", "--rank", "4"]
    losses = example.main(argv)
    assert len(losses) == 2 and all(np.isfinite(losses))
    policy = capsys.readouterr().out.split("MiB: ")[1].splitlines()[0]
    assert policy != "none"
