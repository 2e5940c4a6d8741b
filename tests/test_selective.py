"""Op-level (selective) plans: one vocabulary, the same saved tensors in torch and JAX, same results."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import torch

from benchmarks import saved as insp
from shared_configs import load_spec, resolve_plan
from shared_configs.vocabulary import OP_CLASSES
from tests.helpers.policies import (
    assert_plans_keep_loss_and_grads,
    assert_same_loss_and_grads,
    jax_policy_grads,
    torch_policy_grads,
)
from tests.helpers.specs import variant


@pytest.fixture(scope="module")
def docs() -> dict[str, dict]:
    """The inspector's documents for none, full and save_convs on tiny (both frameworks)."""
    return {p: insp.inspect_policy("tiny", p, ["torch", "jax"], 2, None) for p in ("none", "full", "save_convs")}


def test_policy_syntax_and_presets() -> None:
    spec = load_spec("tiny")
    full = resolve_plan(spec, "full")
    preset = resolve_plan(spec, "save_convs")
    assert preset.recompute == full.recompute and preset.save == ("conv", "matmul") and not preset.offload
    assert resolve_plan(spec, "full/save=matmul+conv").save == preset.save
    assert resolve_plan(spec, "full", save=("conv", "matmul")).save == preset.save
    assert resolve_plan(spec, preset) == preset and hash(preset) == hash(resolve_plan(spec, "save_convs"))
    assert resolve_plan(spec, "offload_convs").offload
    yaml_spec = variant("tiny", checkpoint="balanced/save=conv+norm")  # the spec's YAML field
    assert (
        resolve_plan(yaml_spec).save == ("conv", "norm") and resolve_plan(yaml_spec).policy == "balanced/save=conv,norm"
    )
    assert set(OP_CLASSES) == {"conv", "matmul", "attention", "norm"}


@pytest.mark.parametrize("policy", ["save_convs", "balanced/save=attention,norm", "layers/save=conv"])
def test_torch_selective_equals_plain(policy: str) -> None:
    assert_plans_keep_loss_and_grads(torch_policy_grads, [policy])  # bit for bit


def test_benchmark_saved_bytes_count_policy_outputs() -> None:
    """`saved_for_backward` (the benchmark's torch saved column) sees what SAC keeps."""
    from torch_impl import UNet
    from torch_impl.memory import saved_for_backward

    model = UNet(variant("tiny", dropout=0.0))
    x, ctx = torch.randn(1, 4, 8, 8), torch.randn(1, 5, 12)
    saved = {}
    for policy in ("none", "full", "save_convs"):
        model.enable_gradient_checkpointing(policy)
        with saved_for_backward(exclude=list(model.parameters())) as counter:
            model(x, torch.tensor([3.0]), ctx).sum().backward()
        saved[policy] = counter["bytes"]
    assert saved["full"] < saved["save_convs"] < saved["none"], saved


def test_torch_offload_on_cpu_warns_and_saves_in_place() -> None:
    ref = torch_policy_grads("save_convs")
    with pytest.warns(UserWarning, match="offload: tensors on CPU already live in host memory"):
        got = torch_policy_grads("offload_convs")
    assert_same_loss_and_grads(got, ref)  # bit for bit


@pytest.mark.heavy  # JAX save= plans keep the plain gradients in the default run: test_plan_grammar's grouped plan
def test_jax_selective_equals_plain() -> None:
    """float32, tolerance 1e-5 relative (float32 round-off), or 1e-6 absolute for gradients that are
    zero in exact arithmetic (the key bias: softmax ignores a constant added to every key); the loss 1e-6."""
    policies = ("save_convs", "balanced/save=attention,norm")
    assert_plans_keep_loss_and_grads(jax_policy_grads, policies, tol=1e-5, atol=1e-6, loss_tol=1e-6)


@pytest.mark.slow
def test_jax_offload_on_cpu_warns_and_saves_in_place() -> None:
    ref = jax_policy_grads("save_convs")
    with pytest.warns(UserWarning, match="offload: on CPU the pinned host is the device's own memory"):
        got = jax_policy_grads("offload_convs")
    assert_same_loss_and_grads(got, ref, tol=1e-5, atol=1e-6, loss_tol=1e-7)


def _policy_rows(doc: dict, fw: str, block: str) -> Counter:
    """Layout-free identity of the outputs kept by the op-level policy: (op class, element count)."""
    rows = doc["frameworks"][fw]["rows"]
    return Counter((r["op"], math.prod(r["shape"])) for r in rows if r["kind"] == "policy" and r["block"] == block)


@pytest.mark.slow  # `docs`: the inspector over three plans in both frameworks (the CLI's own check stays)
def test_save_convs_saves_the_same_tensors_in_both(docs: dict[str, dict]) -> None:
    """Per recomputed block, the outputs kept by the op-level policy match, modulo layout.

    Shapes differ only by layout: torch convs are NCHW, JAX's NHWC; torch's linear folds (B, T, C)
    into (B*T, C) before addmm, Flax's Dense keeps (B, T, C); element counts match one for one.
    One honest difference: torch SAC caches *every* MUST_SAVE output in the forward, while JAX keeps
    only the named values its backward needs. A block whose last op is a conv/matmul whose output
    only leaves the block (down.1's proj_out, up.1's to_out, ...) has that one output extra in torch.
    """
    doc = docs["save_convs"]
    extras = 0
    for block in resolve_plan(load_spec("tiny"), "save_convs").recompute:
        torch_rows, jax_rows = _policy_rows(doc, "torch", block), _policy_rows(doc, "jax", block)
        assert jax_rows and not jax_rows - torch_rows, block
        extra = torch_rows - jax_rows
        assert sum(extra.values()) <= 1, (block, extra)
        extras += sum(extra.values())
    assert extras < sum(doc["frameworks"]["jax"]["blocks"][b]["count"] for b in ("down.0", "mid"))


@pytest.mark.slow
def test_saved_bytes_between_full_and_none(docs: dict[str, dict]) -> None:
    for fw in ("torch", "jax"):
        total = {p: d["frameworks"][fw]["total_bytes"] for p, d in docs.items()}
        assert total["full"] < total["save_convs"] < total["none"], (fw, total)


@pytest.mark.slow
def test_jax_keeps_no_more_than_torch_under_full(docs: dict[str, dict]) -> None:
    """Under ``full`` what stays for the backward is each block's input and what runs outside the
    blocks (conv_norm_out, ...): no more in JAX than torch's autograd keeps, since the Flax layers
    recompute their norms' and GEGLUs' elementwise work (`jax_impl.layers.norm_act`, `geglu`).
    Autodiff's own residuals kept 41% more than torch here."""
    total = {fw: docs["full"]["frameworks"][fw]["total_bytes"] for fw in ("torch", "jax")}
    assert total["jax"] <= total["torch"], total


def test_inspector_json_schema_and_totals(capsys: pytest.CaptureFixture[str]) -> None:
    assert insp.main(["--config", "tiny", "--policy", "full", "--framework", "jax", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"config", "policy", "batch_size", "frameworks", "differ", "settings"}
    jax_doc = doc["frameworks"]["jax"]
    assert set(jax_doc) == {"rows", "blocks", "total_count", "total_bytes"}
    assert (
        jax_doc["total_bytes"]
        == sum(r["bytes"] for r in jax_doc["rows"])
        == sum(b["bytes"] for b in jax_doc["blocks"].values())
    )
    assert jax_doc["total_count"] == len(jax_doc["rows"])
    assert set(jax_doc["rows"][0]) == {"block", "op", "kind", "shape", "dtype", "bytes"}


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--policy", "full/save=relu"], "save: unknown op 'relu'"),
        (["--config", "nope"], "saved: error:"),
        (["--block", "down.9", "--framework", "jax"], "block: unknown block 'down.9'"),
    ],
)
def test_inspector_bad_input_is_one_line(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        insp.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1
