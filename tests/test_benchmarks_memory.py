"""The benchmark's memory instruments against independent references: an analytic count, PyTorch's
own MemTracker, the CPU allocator, and XLA's own statement of its live-range peak."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from benchmarks import compare
from benchmarks.backends import jax_bench
from benchmarks.backends import torch_bench as tb
from benchmarks.harness.job import Job
from jax_impl import memory as jax_memory
from jax_impl import step as jstep
from shared_configs import block_names, load_spec
from shared_configs.memory import CATEGORIES, OUTSIDE
from tests.helpers.specs import FAST_COMPILE
from torch_impl.memory import StepTracker, allocator_peak, memtracker, saved_for_backward
from torch_impl.unet import UNet as TorchUNet


def _linear_step(layers: int, batch: int, width: int) -> tuple[torch.nn.Module, Any, Any, torch.Tensor]:
    """A stack of bias-free linear layers and its training step, written as train_step is."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters())
    x, target = torch.randn(batch, width), torch.randn(batch, width)

    def step() -> None:
        opt.zero_grad()  # set_to_none: the previous gradients go before the forward
        F.mse_loss(model(x), target).backward()
        opt.step()

    step()  # optimizer state exists from here on
    return model, opt, step, x


def test_step_tracker_against_an_analytic_count_memtracker_and_the_allocator() -> None:
    layers, batch, width = 32, 512, 256
    model, opt, step, x = _linear_step(layers, batch, width)
    unit, weight = batch * width * 4, width * width * 4
    with memtracker(model, opt) as reference, StepTracker(model, opt) as tracker:  # both watch one step
        step()
    result = tracker.result
    assert result is not None
    parts = result.breakdown
    assert sum(parts.values()) == result.peak and min(parts.values()) >= 0
    assert parts["params"] == layers * weight and parts["optimizer"] >= 2 * layers * weight
    # The backward starts with every layer's output (the activations) alive, the loss gradient and
    # the first input gradient in flight (temporaries) and one weight gradient formed.
    assert abs(parts["activation"] - layers * unit) <= unit, parts
    assert abs(parts["temporary"] - 2 * unit) <= unit and parts["grads"] == weight, parts
    kinds = reference["parts"]
    assert result.peak == reference["peak"], (result.peak, reference)
    assert kinds["Activation"] == parts["activation"]
    # A gradient is a temporary to MemTracker until it is accumulated into .grad; here by its fate.
    assert kinds["Gradient"] + kinds["Temp"] == parts["grads"] + parts["temporary"]
    with allocator_peak() as allocator:
        step()
    # The allocator's events show what the step allocates (frees of older blocks are not seen).
    made = parts["activation"] + parts["temporary"] + parts["grads"]
    assert abs(made - allocator["peak"]) <= 0.05 * allocator["peak"], (made, allocator["peak"])
    with saved_for_backward(exclude=list(model.parameters())) as saved:
        out = model(x)
    assert saved["bytes"] == layers * unit  # each linear layer saves its input
    del out


def _tiny_layers_peak(detail: bool) -> int:
    """`StepTracker`'s peak of a training step of ``tiny`` under ``layers``."""
    torch.manual_seed(0)
    model = TorchUNet(load_spec("tiny"), "layers")
    opt = torch.optim.AdamW(model.parameters())
    x, t = torch.randn(2, 4, 8, 8), torch.tensor([10, 500])
    ctx = torch.randn(2, 77, model.spec.cross_attention_dim)

    def step() -> None:
        opt.zero_grad()
        F.mse_loss(model(x, t, ctx), x).backward()
        opt.step()

    step()
    with StepTracker(model, opt, detail=detail) as tracker:
        step()
    assert tracker.result is not None
    return tracker.result.peak


def test_the_trackers_module_bookkeeping_holds_no_gradient_the_step_would_not() -> None:
    """ModTracker's hook for leaving a module in the backward waits, by default, for every input's
    gradient: a checkpointed ResNet's input gradient would stay until the time embedding's is complete.
    With the bookkeeping on (``detail``), the tracked step peaks as the same step without it."""
    assert _tiny_layers_peak(detail=True) == _tiny_layers_peak(detail=False)


@pytest.mark.slow
def test_torch_rows_add_up_and_agree_with_memtracker() -> None:
    """train_step on tiny: parts add up, none negative, within 5% of MemTracker's peak (the issue's
    bar; in practice equal), never above the allocator's count; block starts in forward order."""
    spec = load_spec("tiny")
    job = Job("torch", "tiny", None, ("none", "full"), (2,), 1, "fp32", "cpu", 4, peak_only=True, timeline=("none",))
    rows = {p: tb.measure(job, p, 2, torch.device("cpu")) for p in job.policies}
    for policy, row in rows.items():
        parts = [row[f"{kind}_bytes"] for kind in CATEGORIES]
        assert sum(parts) == row["peak_bytes"] and min(parts) >= 0, (policy, parts)
        assert abs(row["peak_bytes"] / row["memtracker_peak_bytes"] - 1) <= 0.05, policy
        assert row["tracker_peak_bytes"] <= row["allocator_peak_bytes"], policy
        assert row["static_bytes"] == row["params_bytes"] + row["optimizer_bytes"]
    assert rows["none"]["tracker_peak_bytes"] >= 0.95 * rows["none"]["allocator_peak_bytes"]
    assert rows["full"]["activation_bytes"] < rows["none"]["activation_bytes"]
    timeline = rows["none"]["timeline"]
    forward = [b for pos, b in timeline["marks"] if pos < timeline["phases"]["backward"]]
    backward = [b for pos, b in timeline["marks"] if pos >= timeline["phases"]["backward"]]
    assert forward == block_names(spec) and backward == block_names(spec)[::-1]
    assert "timeline" not in rows["full"]


def _lowered(policy: str) -> Any:
    job = Job("jax", "tiny", None, (policy,), (1,), 1, "fp32", "cpu", 4, attention_chunk=4)
    s = jax_bench._setup(job, policy, 1, jax.devices("cpu")[0])
    return jstep.train_step.lower(s["state"], s["batch"], s["key"], model=s["model"], tx=s["tx"], compute_dtype=None)


def _compile(lowered: Any, cache: Path | None) -> tuple[Any, jax_memory.MemoryPlan]:
    # cse_barrier_expander off, as the benchmark's worker sets it: remat's barriers kept on XLA:CPU
    options = {**FAST_COMPILE, "xla_disable_hlo_passes": "cse_barrier_expander"}
    compiled, plan, _ = jax_memory.compile_with_plan(lowered, None if cache is None else str(cache), options)
    return compiled, plan


@pytest.mark.slow
def test_xla_plan_adds_up_to_memory_analysis_and_matches_xla_own_peak() -> None:
    """The plan read back from XLA's dump: parts add up to memory_analysis()'s total, none
    negative; the live bytes rebuilt from the buffer assignment match XLA's own count where its
    live-range dump places its peak; remat (full) lowers the activations."""
    plans = {}
    for policy in ("none", "full"):
        compiled, plan = _compile(_lowered(policy), None)
        m = compiled.memory_analysis()
        total = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
        assert plan.peak == total == sum(plan.parts.values()) and min(plan.parts.values()) >= 0, plan.parts
        assert m.alias_size_in_bytes > 0  # the state is donated
        assert abs(plan.live_peak / plan.xla_live_peak - 1) < 0.01, (plan.live_peak, plan.xla_live_peak)
        assert 0 <= plan.fragmentation <= m.temp_size_in_bytes
        series = np.sum([plan.timeline["series"][c] for c in CATEGORIES], axis=0)
        assert series.max() == plan.peak - plan.fragmentation  # the picture keeps the peak exactly
        assert {b for _, b in plan.timeline["marks"]} == set(block_names(load_spec("tiny"))) - {OUTSIDE}
        plans[policy] = plan
    assert plans["full"].parts["activation"] < 0.8 * plans["none"].parts["activation"]


@pytest.mark.heavy  # two compiles, a minute of CPU
def test_a_step_loaded_from_the_persistent_cache_gets_the_same_plan(tmp_path: Path) -> None:
    """A step JAX loads from its compilation cache is not compiled, so XLA dumps nothing: the plan
    comes from the benchmark's own record, or, without one, from a compile past the cache."""
    from jax.experimental.compilation_cache import compilation_cache

    cache = tmp_path
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    compilation_cache.reset_cache()
    try:
        first = _compile(_lowered("none"), cache)[1]  # compiled, stored in both caches
        records = list((cache / "xla-memory").glob("*.json"))
        assert len(records) == 1 and any(p.name != "xla-memory" for p in cache.iterdir())
        records[0].unlink()  # only the executable is left: its load dumps nothing
        jax.clear_caches()
        again = _compile(_lowered("none"), cache)[1]
        assert records[0].is_file()  # rebuilt by a compile past the cache
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
        compilation_cache.reset_cache()
    assert first.parts == again.parts and first.timeline == again.timeline


@pytest.mark.slow  # a batch-8 sd_narrow step in torch, a compile in JAX
def test_the_default_workload_is_activation_dominated_in_both_frameworks() -> None:
    """compare's default (sd_narrow, batch 8, policy none): activations + temporaries at least twice
    the static memory (parameters + optimizer state) in both frameworks; the same parameters."""
    assert (compare.DEFAULT_CONFIG, compare.DEFAULT_BATCH_SIZES) == ("sd_narrow", (8,))
    job = Job("torch", "sd_narrow", None, ("none",), (8,), 1, "fp32", "cpu", 77, peak_only=True)
    rows = {"torch": tb.measure(job, "none", 8, torch.device("cpu"))}
    job = replace(job, framework="jax", attention_chunk="auto")
    rows["jax"] = jax_bench.measure(job, "none", 8, jax.devices("cpu")[0])  # on CPU: compiled, not run
    for framework, row in rows.items():
        assert row["activation_bytes"] + row["temporary_bytes"] >= 2 * row["static_bytes"], framework
    assert rows["torch"]["param_count"] == rows["jax"]["param_count"] == 3_092_580
    # the same, but for torch AdamW's step counter per parameter against optax's one count
    assert 0 <= rows["torch"]["static_bytes"] - rows["jax"]["static_bytes"] <= 4 * 300
