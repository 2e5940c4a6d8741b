"""Checkpoint plans under ``torch.compile`` (docs/compile.md): same gradients, BatchNorm, the CLIs.

The plan matrix compiles with ``aot_eager_decomp_partition``: Dynamo, AOTAutograd and the min-cut
partitioner that honours the plans' save/recompute tags, i.e. everything of inductor's path but
its code generation, at a fifth of the compile time on CPU. Inductor itself runs in the BatchNorm
test and in the training CLI's. Compiled gradients differ from eager ones by rounding only; they
are compared over all parameters at once (a per-parameter error means nothing for a gradient
that is zero in exact arithmetic, as the key projections' biases are: softmax ignores them).
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo

from benchmarks import compare
from shared_configs import SpecError
from shared_configs.training.data import example_batch
from tests.helpers.specs import variant
from tests.helpers.tensors import rel_err
from torch_impl import UNet, apply_plan, checkpointing
from torch_impl import train as ttrain

BACKEND = "aot_eager_decomp_partition"
PLANS = ["full", "layers", "full/save=conv,matmul", "down.0,up.1;down.1,mid/save=conv+matmul", "offload_convs"]
TOL = 1e-5  # global relative error of compiled against eager gradients (measured: about 1e-6)


def _grads(model: torch.nn.Module, params: torch.nn.Module, inputs: tuple) -> dict[str, Any]:
    """Loss, gradients (one vector) and the bytes saved for backward, of one forward/backward."""
    params.zero_grad(set_to_none=True)
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*inputs).square().mean()
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in params.parameters()])
    return {"loss": loss.item(), "grads": grads, "saved": sum(saved)}


def _compiled(model: torch.nn.Module, backend: str = BACKEND) -> torch.nn.Module:
    torch._dynamo.reset()
    return torch.compile(model, backend=backend, fullgraph=True)  # fullgraph: no graph break anywhere


@pytest.fixture(scope="module")
def tiny() -> dict[str, Any]:
    """`tiny` (dropout 0: compiled and eager draw different masks), its inputs, and the eager reference."""
    torch.manual_seed(0)
    model = UNet(variant("tiny", dropout=0.0)).train()
    gen = torch.Generator().manual_seed(1)
    inputs = (torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([3.0, 700.0]), torch.randn(2, 5, 12, generator=gen))
    model.disable_gradient_checkpointing()
    plain = _grads(model, model, inputs)
    return {"model": model, "inputs": inputs, "plain": plain, "compiled_none": _grads(_compiled(model), model, inputs)}


@pytest.mark.slow
# In the default run: `full` and the grouped mixed plan; the other kinds compile in the heavy tier.
@pytest.mark.parametrize(
    "policy", [p if p in ("full", PLANS[3]) else pytest.param(p, marks=pytest.mark.heavy) for p in PLANS]
)
def test_compiled_plan_gradients_equal_eager(tiny: dict[str, Any], policy: str) -> None:
    model, inputs, plain = tiny["model"], tiny["inputs"], tiny["plain"]
    model.enable_gradient_checkpointing(policy)
    try:
        with warnings.catch_warnings():  # offload on CPU: eager warns it saves in place
            warnings.simplefilter("ignore")
            eager = _grads(model, model, inputs)
        compiled = _grads(_compiled(model), model, inputs)
    finally:
        model.disable_gradient_checkpointing()
    assert abs(compiled["loss"] - plain["loss"]) <= TOL * abs(plain["loss"])
    assert rel_err(compiled["grads"], plain["grads"]) <= TOL
    assert rel_err(compiled["grads"], eager["grads"]) <= TOL
    # the plan is really in the compiled graph: it saves less for backward than compiled `none`
    assert compiled["saved"] < tiny["compiled_none"]["saved"]


def test_compiled_context_is_a_partial_over_constants() -> None:
    """What Dynamo can trace: no context for plain recompute, a partial of tuples and bools for a save set."""
    spec = variant("tiny", dropout=0.0)
    from shared_configs import resolve_plan

    plan = resolve_plan(spec, "down.0,up.1;down.1,mid/save=conv+matmul/offload")
    assert checkpointing.make_context_fn("down.0", plan, compiled=True) is None
    ctx = checkpointing.make_context_fn("mid", plan, compiled=True)
    assert isinstance(ctx, functools.partial) and isinstance(ctx.args[0], functools.partial)
    assert ctx.args[0].args == (("conv", "matmul"), True)


@pytest.mark.heavy  # minutes of CPU: left out of the default run
def test_inductor_batchnorm_plan_updates_running_stats_once(tmp_path: Path) -> None:
    """Under compile the recompute is a graph's, and the running-stat update an input mutation
    applied once: no freeze needed. Stats and gradients equal the plain eager model's."""
    spec = variant("tiny", norm_kind="batch", dropout=0.0)
    torch.manual_seed(0)
    model = UNet(spec).train()
    gen = torch.Generator().manual_seed(1)
    inputs = (torch.randn(2, 4, 8, 8, generator=gen), torch.tensor([3.0, 700.0]), torch.randn(2, 5, 12, generator=gen))
    start = {n: b.clone() for n, b in model.named_buffers()}
    plain = _grads(model, model, inputs)
    stats = {n: b.clone() for n, b in model.named_buffers()}
    for n, b in model.named_buffers():
        b.copy_(start[n])
    model.enable_gradient_checkpointing("full/save=conv,matmul")
    compiled = _grads(_compiled(model, "inductor"), model, inputs)
    assert rel_err(compiled["grads"], plain["grads"]) <= TOL
    for name, buffer in model.named_buffers():
        if name.endswith("num_batches_tracked"):
            assert buffer.item() == 1, name
        else:
            assert rel_err(buffer, stats[name]) <= TOL, name


@pytest.mark.slow
def test_apply_plan_on_diffusers_compiles_with_equal_gradients() -> None:
    pytest.importorskip("diffusers")
    from benchmarks.backends.diffusers_bench import DiffusersForward
    from tests.helpers.diffusers_ref import diffusers_pair
    from torch_impl.step import as_tensors

    spec = variant("sdxl_style", dropout=0.0)  # a UNet2DConditionModel with SDXL's text_time conditioning
    unet = diffusers_pair(spec)[1]  # diffusers' model, with our seeded U-Net's weights
    model = DiffusersForward(unet).train()
    noisy, t, _, conditioning = as_tensors(example_batch(spec, 2, 8))
    inputs = (noisy, t, *conditioning.values())
    plain = _grads(model, model, inputs)
    apply_plan(unet, "layers/save=conv,matmul")
    compiled = _grads(_compiled(model), model, inputs)
    assert rel_err(compiled["grads"], plain["grads"]) <= TOL
    assert compiled["saved"] < plain["saved"]


@pytest.mark.heavy  # minutes of CPU: left out of the default run
def test_train_cli_compile_full_trains(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m torch_impl.train --compile --policy full`` (inductor) on tiny: finite losses, compile timed."""
    out = tmp_path / "run"
    args = ["--compile", "--policy", "full", "--steps", "3", "--batch-size", "4", "--sample-steps", "0"]
    assert ttrain.main([*args, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "torch.compile: first step" in err
    losses = json.loads((out / "losses.json").read_text())
    assert len(losses) == 3 and all(loss == loss and abs(loss) < 1e3 for loss in losses)


@pytest.mark.parametrize("other", [["--distributed"], ["--budget-mib", "100"]])
def test_train_compile_refuses_what_it_cannot_do_in_one_line(other: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        ttrain.parse_args(["--compile", *other])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--compile: not with " + other[0] in err
    from jax_impl import train as jtrain

    with pytest.raises(SystemExit):  # a torch-only flag: the JAX step is always compiled
        jtrain.parse_args(["--compile"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--framework", "jax", "--compile"], "--compile: measures torch's step"),
        (["--framework", "torch", "--compile-budget-at", "full"], "--compile-budget-at: needs --compile"),
        (["--framework", "torch", "--compile", "--compile-budget-at", "balanced"], "'balanced' is not a measured"),
        (["--framework", "torch", "--compile", "--world-size", "2", "--device", "cpu"], "--compile: one process"),
    ],
)
def test_compare_compile_refusals_are_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(SpecError, match=message):
        compare.parse_args(["--config", "tiny", *argv])


def test_compare_compile_adds_the_compiled_job_with_budget_rows() -> None:
    _, jobs = compare.parse_args(
        [
            "--config",
            "tiny",
            "--framework",
            "torch",
            "--policies",
            "full,layers",
            "--compile",
            "--compile-budget-at",
            "layers",
        ]
    )
    assert [j.framework for j in jobs] == ["torch", "compiled"]
    assert jobs[1].policies == ("none", "full", "layers", "budget@layers")
