"""The ControlNet step's one plan over two networks (`shared_configs.pair`): the grammar, its
refusals, the step's units in the planner, and the CLI's refusals. Pure Python: nothing is measured."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import plan as cli
from shared_configs import SpecError, spec_from_dict
from shared_configs.pair import CONTROLNET, controlnet_pair, pair_names, split_pair_plan, workload_spec
from shared_configs.planning.budget import random_assignment
from shared_configs.planning.pipeline import Workload
from shared_configs.planning.solver import solve
from shared_configs.planning.units import assignment_of, leaf_units, policy_string
from shared_configs.regime import Regime
from tests.helpers.specs import random_profile

PAIR = controlnet_pair("tiny")


@pytest.mark.parametrize("policy", ["none", "full", "layers", "every:2", "save_convs", "layers/save=conv+matmul"])
def test_a_named_policy_is_that_policy_on_both_networks(policy: str) -> None:
    plan = split_pair_plan(PAIR, policy)
    assert plan.unet.recompute == split_pair_plan(PAIR, policy).unet.recompute
    assert plan.unet.policy == plan.controlnet.policy  # resolved alike; the ControlNet's over its own units
    assert not any(n.startswith("up.") for n in plan.controlnet.recompute)
    assert split_pair_plan(PAIR, plan.policy).recompute == plan.recompute


def test_names_go_to_their_network_and_groups_keep_their_save_sets() -> None:
    plan = split_pair_plan(PAIR, "controlnet.down.0,up.1;controlnet.mid.resnets.1,up.0/save=conv+matmul")
    assert plan.controlnet.recompute == ("down.0", "mid.resnets.1")
    assert plan.unet.recompute == ("up.0", "up.1")
    assert plan.save_for("controlnet.mid.resnets.1") == plan.save_for("up.0") == ("conv", "matmul")
    assert plan.save_for("controlnet.down.0") == plan.save_for("up.1") == ()
    assert plan.recompute == ("controlnet.down.0", "controlnet.mid.resnets.1", "up.0", "up.1")
    again = split_pair_plan(PAIR, plan.policy)  # the written string is the same plan
    assert (again.unet, again.controlnet) == (plan.unet, plan.controlnet)


def test_names_are_the_controlnets_prefixed_then_the_unets() -> None:
    names = pair_names(PAIR)
    assert names[0] == "controlnet.down.0" and "controlnet.mid.attentions.0" in names and "up.1.resnets.1" in names
    assert not any(n.startswith(CONTROLNET + "up.") for n in names)


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("controlnet.up.0", "policy: unknown unit 'controlnet.up.0' in 'controlnet.up.0' (allowed: a named policy"),
        ("down.0,foo.1", "policy: unknown unit 'foo.1'"),
        ("fulll", "policy: unknown policy 'fulll' (allowed: none, full"),
        ("down.0;down.0", "policy: 'down.0' is named in two ';' groups"),
        (
            "controlnet.down.0,controlnet.down.0.resnets.0",
            "lies inside 'down.0', which is already recomputed (in the ControlNet's units, controlnet.* here)",
        ),
        ("controlnet.mid/save=gemm", "save: unknown op 'gemm' (allowed: conv, matmul, attention, norm)"),
    ],
)
def test_bad_pair_policies_are_one_line(policy: str, message: str) -> None:
    with pytest.raises(SpecError) as err:
        split_pair_plan(PAIR, policy)
    assert message in str(err.value) and "\n" not in str(err.value)
    if "unknown unit" in message:  # the allowed names are listed
        assert "controlnet.mid.resnets.1" in str(err.value) and "up.1.attentions.1" in str(err.value)


def test_the_steps_units_run_controlnet_first_and_the_solver_plans_both() -> None:
    units = [u for u, _ in leaf_units(PAIR, {})]
    assert units[0] == "controlnet.stem" and units[-1] == "head"
    assert units.index("controlnet.head") < units.index("stem") < units.index("down.0.resnets.0")
    profile = random_profile(PAIR, 3)
    rng = np.random.default_rng(0)
    for _ in range(20):  # every plan's string is a pair policy standing for the same assignment
        assignment = random_assignment(PAIR, rng)
        assert assignment_of(PAIR, policy_string(assignment)) == assignment
    sol = solve(profile, PAIR, 10**12)
    assert sol.policy == "none"
    low = solve(profile, PAIR, (solve(profile, PAIR, 10**12).prediction.peak_bytes * 9) // 10)
    assert split_pair_plan(PAIR, low.policy).recompute  # something recomputed, in pair names


def test_a_workload_of_the_pair_round_trips_and_refuses_what_it_does_not_plan() -> None:
    work = Workload.of("tiny", 16, controlnet=True, batch_size=2)
    assert work.spec.name == "tiny+controlnet" and work.spec.sample_size == 16
    assert workload_spec(work.request("torch", "profile")["spec"]) == work.spec
    with pytest.raises(SpecError, match=r"^--trainable: the ControlNet step trains the whole ControlNet"):
        Workload.of("tiny", controlnet=True, batch_size=2, regime=Regime(trainable="lora:4"))
    batch_norm = spec_from_dict({**PAIR.unet.model_dump(), "norm_kind": "batch"})
    with pytest.raises(SpecError, match=r"^norm_kind: the ControlNet step is planned for GroupNorm U-Nets"):
        Workload.of(batch_norm, controlnet=True, batch_size=2)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--sweep", "out"], "--controlnet: plans and measures one process's step; not with --sweep"),
        (["--budget-mib", "100", "--policy", "controlnet.up.0"], "policy: unknown unit 'controlnet.up.0'"),
    ],
)
def test_plan_cli_refusals_are_one_line(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--config", "tiny", "--batch-size", "2", "--controlnet", *extra]
    if "--policy" in extra:
        argv.remove("--budget-mib"), argv.remove("100")
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and err.count("\n") == 1, err
