"""Per-unit save sets (``;``-grouped plans): syntax, and the same effect in torch and JAX.

A grouped plan such as ``down.0,up.1;down.1,mid/save=conv,matmul`` recomputes down.0 and up.1
keeping nothing inside them, and down.1 and mid keeping their conv/matmul outputs. It must keep,
per block, exactly what the single-save plan for that block keeps (checked against the inspector's
``full`` and ``save_convs`` rows, both frameworks), and its gradients must equal the plain model's.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from benchmarks import saved as insp
from shared_configs import SpecError, load_spec, resolve_plan
from tests.helpers.policies import assert_plans_keep_loss_and_grads, jax_policy_grads, torch_policy_grads

MIXED = "down.0,up.1;down.1,mid/save=conv,matmul"
LAYERS = "down.1.resnets.0;down.1.attentions.0,mid.resnets.1/save=conv+matmul;up.0.attentions.1/save=norm"


def test_grouped_plan_resolves_per_unit_saves() -> None:
    spec = load_spec("tiny")
    plan = resolve_plan(spec, MIXED)
    assert plan.recompute == ("down.0", "down.1", "mid", "up.1")
    assert plan.save_for("down.0") == plan.save_for("up.1") == ()
    assert plan.save_for("down.1") == plan.save_for("mid") == ("conv", "matmul")
    assert plan.save_for("up.0") == () and plan.saves and plan.policy == MIXED
    assert resolve_plan(spec, plan.policy) == plan  # the string round-trips
    assert resolve_plan(spec, "full").save_for("mid") == () and not resolve_plan(spec, "full").saves
    # The single-group forms are unchanged.
    assert resolve_plan(spec, "save_convs").save_for("mid") == ("conv", "matmul")
    assert resolve_plan(spec, "down.0;mid").unit_save == () and resolve_plan(spec, "down.0;mid").recompute == (
        "down.0",
        "mid",
    )
    layers = resolve_plan(spec, LAYERS)
    assert layers.save_for("up.0.attentions.1") == ("norm",) and layers.save_for("down.1.resnets.0") == ()
    overridden = resolve_plan(spec, MIXED, save=("norm",))  # an explicit save= applies to every unit
    assert overridden.save_for("down.0") == overridden.save_for("mid") == ("norm",)
    assert resolve_plan(spec, overridden.policy) == overridden


@pytest.mark.parametrize(
    ("policy", "match"),
    [
        ("down.0;down.0/save=conv", r"policy: 'down.0' is named in two ';' groups"),
        ("full;down.0.resnets.0/save=conv", r"'down.0.resnets.0' lies inside 'down.0'"),
        ("down.0/save=conv/offload;mid/save=conv", r"offload: every ';' group .* must say /offload, or none"),
        ("down.0;mid/save=relu", r"save: unknown op 'relu'"),
        ("none/save=conv;mid", r"recomputes no block"),
        ("full/save=conv,relu", r"save: unknown op 'relu' \(allowed: conv, matmul, attention, norm\)"),
        ("none/save=conv", r"save: policy 'none/save=conv' recomputes no block"),
        ("full/offload", r"offload: .* saves no op to offload"),
        ("full/keep=conv", r"policy: unknown modifier 'keep=conv'"),
    ],
)
def test_bad_policies_are_one_line(policy: str, match: str) -> None:
    with pytest.raises(SpecError, match=match) as err:
        resolve_plan(load_spec("tiny"), policy)
    assert "\n" not in str(err.value)


def _policy_rows(doc: dict, fw: str, block: str) -> Counter:
    """What the op-level policy keeps inside ``block``: (op, element count). Plain autograd's rows at
    the block's edges depend on the neighbours' plans (a recomputed consumer keeps its inputs)."""
    rows = doc["frameworks"][fw]["rows"]
    return Counter((r["op"], math.prod(r["shape"])) for r in rows if r["block"] == block and r["kind"] == "policy")


@pytest.mark.slow_for("jax")
@pytest.mark.parametrize("fw", ["torch", "jax"])
def test_each_block_keeps_what_its_own_save_set_keeps(fw: str) -> None:
    """Per block, the grouped plan keeps the rows of the uniform plan with that block's save set."""
    docs = {p: insp.inspect_policy("tiny", p, [fw], 2, None) for p in (MIXED, "full", "save_convs")}
    plan = resolve_plan(load_spec("tiny"), MIXED)
    for block in plan.recompute:
        reference = docs["save_convs" if plan.save_for(block) else "full"]
        assert _policy_rows(docs[MIXED], fw, block) == _policy_rows(reference, fw, block), (fw, block)
    assert all(_policy_rows(docs[MIXED], fw, b) for b in plan.recompute if plan.save_for(b)), fw


@pytest.mark.parametrize("policy", [MIXED, LAYERS])
def test_torch_grouped_plan_gradients_equal_plain(policy: str) -> None:
    assert_plans_keep_loss_and_grads(torch_policy_grads, [policy])  # bit for bit, the loss too


@pytest.mark.slow
@pytest.mark.parametrize("policy", [MIXED, LAYERS])
def test_jax_grouped_plan_gradients_equal_plain(policy: str) -> None:
    """Tolerance as in test_selective: float32 round-off, or 1e-6 absolute where exact arithmetic gives 0."""
    assert_plans_keep_loss_and_grads(jax_policy_grads, [policy], tol=1e-5, atol=1e-6, loss_tol=1e-6)
