"""`python -m benchmarks.plan`: bad input is one line and exit 2 with nothing written; the JSON
document's shape; one plan for both frameworks; the library call. Profiles are seeded into a
temporary cache (random figures), so nothing is measured except in the slow --verify test."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import torch_impl
from benchmarks import plan as cli
from benchmarks.reports import plan_text
from shared_configs import SpecError, load_spec, resolve_plan
from shared_configs.planning import candidates, pipeline, stepclock
from shared_configs.planning.budget import SAFETY, Profile, per_rank, predict, safety_margin
from shared_configs.planning.candidates import HAND_POLICIES
from shared_configs.planning.pipeline import CACHE_ENV, Workload, plan_for_budget, profile_path
from shared_configs.planning.solver import smallest_peak, solve
from shared_configs.planning.units import assignment_of, block_layers
from shared_configs.regime import Regime
from shared_configs.sizes import MIB
from tests.helpers.specs import random_profile

SPEC = load_spec("tiny")


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """Random profiles of tiny at batch 2 for both frameworks, where the planner looks first."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    profiles = {}
    for seed, fw in enumerate(("torch", "jax")):
        profile = random_profile(SPEC, seed, framework=fw)
        path = profile_path(fw, Workload.of("tiny", batch_size=2))
        path.parent.mkdir(parents=True, exist_ok=True)
        profile.save(path)
        profiles[fw] = profile
    _measure_as(monkeypatch, profiles)  # the checks and the torch default's race
    return profiles


def _check_as(monkeypatch: pytest.MonkeyPatch, profiles: dict[str, Profile], factor: float) -> list[int]:
    """The planner's check of a plan's peak (JAX: XLA's compiled peak; torch: a fake-tensor step),
    stood in for: the profile's prediction, times ``factor`` for JAX (that the checks give the
    measured figures: tests/test_plan_model.py). Returns the JAX peaks given."""
    given: list[int] = []

    def run_worker(request: dict) -> dict:
        assert request["kind"] == "peaks", request["kind"]
        (policy,) = request["policies"]
        fw = request["framework"]
        peak = predict(profiles[fw], SPEC, assignment_of(SPEC, policy)).peak_bytes
        if fw == "jax":
            peak = round(factor * peak)
            given.append(peak)
        return {"peaks": {policy: peak}}

    monkeypatch.setattr(pipeline, "run_worker", run_worker)
    return given


@pytest.mark.parametrize(
    ("budget", "match"),
    [
        ("0", "--budget-mib: expected a positive number of MiB, got '0'"),
        ("-3", "--budget-mib: expected a positive number of MiB, got '-3'"),
        ("nan", "--budget-mib: expected a positive number of MiB, got 'nan'"),
        ("inf", "--budget-mib: expected a positive number of MiB, got 'inf'"),
        ("lots", "--budget-mib: expected a positive number of MiB, got 'lots'"),
        ("1", "budget: no plan fits 1.0 MiB; the smallest feasible budget is"),
    ],
)
def test_bad_budget_is_one_line_exit_2_nothing_written(
    budget: str, match: str, cache: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "plan.json"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--config", "tiny", "--batch-size", "2", f"--budget-mib={budget}", "--json", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1
    assert not out.exists()


def test_unknown_config_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--config", "nope", "--batch-size", "2", "--budget-mib", "100", "--json", str(tmp_path / "p.json")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "config: unknown preset 'nope'" in err and err.count("\n") == 1
    assert not (tmp_path / "p.json").exists()


def test_infeasible_names_the_smallest_budget(cache: dict, capsys: pytest.CaptureFixture[str]) -> None:
    """The smallest feasible budget is the lowest predicted peak plus the safety margin (0.5% for a
    profile without steps to check itself on), and a budget of exactly that is planned."""
    assert safety_margin(cache["torch"], SPEC) == SAFETY
    smallest = math.ceil(smallest_peak(cache["torch"], SPEC).prediction.peak_bytes / (1 - SAFETY))
    with pytest.raises(SystemExit):
        cli.main(["--config", "tiny", "--batch-size", "2", "--budget-mib", str((smallest - 8) / MIB)])
    assert f"({smallest} bytes)" in capsys.readouterr().err
    assert cli.main(["--config", "tiny", "--batch-size", "2", "--budget-mib", str(smallest / MIB)]) == 0


def test_json_document_and_one_plan_for_both(cache: dict, tmp_path: Path) -> None:
    none = max(predict(p, SPEC, {}).peak_bytes for p in cache.values())
    floor = max(p.peak_bytes for p in smallest_peak(list(cache.values()), SPEC).predictions)
    budget = (floor + none) / 2
    out = tmp_path / "plan.json"
    argv = ["--config", "tiny", "--batch-size", "2", "--budget-mib", str(budget / MIB), "--framework", "both"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc) == {
        "plan",
        "budget_bytes",
        "frameworks",
        "margin",
        "solve_seconds",
        "world_size",
        "distributed",
        "settings",
        "regime",
    }
    assert doc["regime"] == {
        "precision": "fp32",
        "trainable": "all",
        "optimizer": "adamw",
        "ema": False,
        "keep_grads": False,
    }
    assert set(doc["frameworks"]) == {"torch", "jax"}
    for fw, entry in doc["frameworks"].items():
        assert {"predicted_peak_bytes", "predicted_overhead", "recompute_flops"} <= set(entry)
        assert entry["predicted_peak_bytes"] <= doc["budget_bytes"] * (1 - doc["margin"])
        assert entry["predicted_peak_bytes"] == predict(cache[fw], SPEC, assignment_of(SPEC, doc["plan"])).peak_bytes
    resolve_plan(SPEC, doc["plan"])  # what both U-Nets accept


def test_a_jax_plan_that_compiles_over_the_budget_is_planned_lower(
    cache: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """XLA puts every plan 6% above the model: the first plan compiles over the budget, the
    planner plans lower by the excess (and 0.5%) and the plan it returns compiles under it."""
    given = _check_as(monkeypatch, cache, 1.06)
    margin = safety_margin(cache["jax"], SPEC)
    # A budget the model's plan fills to the edge, so that 6% more is over it.
    tight = solve(cache["jax"], SPEC, predict(cache["jax"], SPEC, {}).peak_bytes // 2, margin)
    budget = math.ceil(tight.predictions[0].peak_bytes / (1 - margin)) + 1
    out = tmp_path / "plan.json"
    argv = ["--config", "tiny", "--batch-size", "2", "--budget-mib", str(budget / MIB), "--framework", "jax"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(given) >= 2 and given[0] > budget >= given[-1]
    assert doc["margin"] > safety_margin(cache["jax"], SPEC) + 0.05
    assert given[-1] == round(1.06 * doc["frameworks"]["jax"]["predicted_peak_bytes"])


def test_library_call_returns_a_policy_both_unets_accept(cache: dict) -> None:
    from jax_impl import UNet as JaxUNet
    from torch_impl import UNet as TorchUNet

    budget = predict(cache["torch"], SPEC, assignment_of(SPEC, "full")).peak_bytes
    policy = torch_impl.plan_for_budget("tiny", batch_size=2, budget_bytes=budget)  # what a torch loop calls
    assert predict(cache["torch"], SPEC, assignment_of(SPEC, policy)).peak_bytes <= budget
    assert TorchUNet(SPEC).enable_gradient_checkpointing(policy) == JaxUNet(spec=SPEC, policy=policy).plan
    with pytest.raises(SpecError, match="smallest feasible budget"):
        plan_for_budget("tiny", batch_size=2, sample_size=None, budget_bytes=MIB, framework="torch")


def test_fsdp_divides_the_static_bytes_by_the_world_size(cache: dict, tmp_path: Path) -> None:
    """Two FSDP ranks: every peak drops by half the parameters and optimizer state, less half the
    largest block's parameters (gathered whole while it runs); DDP replicates: unchanged."""
    static, block = 300 * MIB, 40 * MIB
    profile = dataclasses.replace(cache["torch"], static_bytes=static, grad_bytes=static // 3, block_param_bytes=block)
    profile.save(profile_path("torch", Workload.of("tiny", batch_size=2)))
    one = predict(profile, SPEC, {}).peak_bytes
    assert predict(per_rank(profile, 2, "ddp"), SPEC, {}).peak_bytes == one
    two = predict(per_rank(profile, 2, "fsdp"), SPEC, {}).peak_bytes
    assert abs((one - two) - profile.scale * (static - block) / 2) <= 1
    out = {n: tmp_path / f"{n}.json" for n in ("1", "2")}
    argv = ["--config", "tiny", "--batch-size", "2", "--budget-mib", "100000", "--distributed", "fsdp"]
    for n, path in out.items():
        assert cli.main([*argv, "--world-size", n, "--json", str(path)]) == 0
    peaks = {n: json.loads(p.read_text())["frameworks"]["torch"]["predicted_peak_bytes"] for n, p in out.items()}
    assert (peaks["1"], peaks["2"]) == (one, two)
    policy = plan_for_budget("tiny", 2, two, world_size=2, distributed="fsdp")
    assert predict(per_rank(profile, 2, "fsdp"), SPEC, assignment_of(SPEC, policy)).peak_bytes <= two


def test_fsdp_verify_is_refused_in_one_line(cache: dict, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--config", "tiny", "--batch-size", "2", "--budget-mib", "100", "--world-size", "2"]
    argv += ["--distributed", "fsdp"]
    with pytest.raises(SystemExit) as exit_:
        cli.main([*argv, "--verify"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--verify, --candidates and --sweep measure one process only" in err and err.count("\n") == 1


@pytest.mark.heavy
def test_verify_measures_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end on torch (profile and measurement in subprocesses): the plan fits when measured."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    out = tmp_path / "plan.json"
    argv = ["--config", "tiny", "--sample-size", "32", "--batch-size", "4", "--budget-mib", "60"]
    assert cli.main([*argv, "--verify", "--steps", "1", "--json", str(out)]) == 0
    torch_doc = json.loads(out.read_text())["frameworks"]["torch"]
    assert torch_doc["measured_peak_bytes"] <= 60 * MIB
    assert abs(torch_doc["predicted_peak_bytes"] / torch_doc["measured_peak_bytes"] - 1) <= 0.05
    spread = torch_doc["measured_overhead_paired"]  # one round bounds nothing: said, not made up
    assert (spread["rounds"], spread["low"], spread["verdict"]) == (1, None, "too few rounds")


HAND = HAND_POLICIES[1:]  # the hand policies but none


def _true_step(policy: str) -> float:
    """A stand-in's step seconds: the plain step's 1.0 plus an overhead the profile does not know (so
    that the measurement, not the model, decides), fixed per policy."""
    return 1.0 if policy == "none" else 1.05 + (zlib.crc32(policy.encode()) % 1000) / 2000


def _measure_as(monkeypatch: pytest.MonkeyPatch, profiles: dict[str, Profile], over: bool = False) -> list[tuple]:
    """The planner's workers, stood in for: checked peaks are the profile's predictions; measured
    ones too (``over``: the fastest plan measured is 10% above), and steps take `_true_step`
    seconds times a load shared by each round (and 1% of noise), raced by the worker's own
    `shared_configs.planning.stepclock.measured_rounds` on a stand-in clock. Returns the requests (kind,
    framework, policies)."""
    calls: list[tuple] = []
    load = np.random.default_rng(0).uniform(1.0, 1.5, 64)

    def run_worker(request: dict) -> dict:
        fw, policies = request["framework"], request["policies"]
        calls.append((request["kind"], fw, tuple(policies)))
        peaks = {p: predict(profiles[fw], SPEC, assignment_of(SPEC, p)).peak_bytes for p in policies}
        if request["kind"] == "peaks":
            return {"peaks": peaks}
        fastest = min((p for p in policies if p != "none"), key=_true_step)
        measured = {p: round(v * (1.1 if over and p == fastest else 1.0)) for p, v in peaks.items()}
        clock = {"now": 0.0, "ran": dict.fromkeys(policies, 0)}

        def step(p: str) -> Callable[[], None]:
            def run() -> None:
                r = clock["ran"][p]
                clock["now"] += _true_step(p) * load[r] * (1 + 0.01 * np.sin(7 * r + len(p)))
                clock["ran"][p] += 1

            return run

        monkeypatch.setattr(stepclock, "clock", lambda: clock["now"])
        rounds = stepclock.measured_rounds(
            {p: step(p) for p in policies}, measured, request["steps"], request.get("race_to")
        )
        return {"rows": {p: {"peak_bytes": measured[p]} | stepclock.times(rounds[p]) for p in policies}}

    monkeypatch.setattr(pipeline, "run_worker", run_worker)
    return calls


def _mid_budget(profile: Profile) -> int:
    floor = smallest_peak(profile, SPEC).prediction.peak_bytes
    return (floor + predict(profile, SPEC, {}).peak_bytes) // 2


@pytest.mark.parametrize("over", [False, True])
def test_candidates_return_the_fastest_that_fits_when_measured(
    over: bool, cache: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The solver's best plans and the hand policies that fit race; the answer is the fastest whose
    measured peak fits (``over``: the fastest measures 10% over its checked peak, so the next one
    wins), not the model's cheapest; every candidate is reported with its peaks and overheads."""
    budget, profile = _mid_budget(cache["torch"]), cache["torch"]
    argv = ["--config", "tiny", "--batch-size", "2", "--budget-mib", str(budget / MIB), "--candidates", "4"]
    calls = _measure_as(monkeypatch, cache, over)
    # the hand policies raced: those predicted within RACE_WITHIN of the solver's plan, here the two cheapest
    first = pipeline.plan(Workload.of("tiny", batch_size=2), budget).solution.prediction.overhead(profile)
    hand = {h: predict(profile, SPEC, assignment_of(SPEC, h)).overhead(profile) for h in HAND}
    monkeypatch.setattr(candidates, "RACE_WITHIN", sum(sorted(hand.values())[1:3]) / 2 - first)
    out = tmp_path / "plan.json"
    assert cli.main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    report = doc["candidates"]
    measured = {c["policy"]: c["frameworks"]["torch"]["measured_peak_bytes"] for c in report["candidates"]}
    expected = min((p for p, peak in measured.items() if peak <= budget), key=_true_step)
    assert doc["plan"] == report["chosen"] == expected
    assert over == any(peak > budget for peak in measured.values())
    sources = [c["source"] for c in report["candidates"]]
    assert sources[:4] == ["solver 1", "solver 2", "solver 3", "solver 4"]
    plans = {frozenset(assignment_of(SPEC, c["policy"]).items()) for c in report["candidates"]}
    assert len(plans) == len(report["candidates"])  # one entry per plan
    near = {h: hand[h] <= first + candidates.RACE_WITHIN for h in HAND}
    assert {h: frozenset(assignment_of(SPEC, h).items()) in plans for h in HAND} == near and sum(near.values()) == 2
    raced = [c for kind, _, c in calls if kind == "measure"]
    checked = {c["policy"]: c["frameworks"]["torch"]["checked_peak_bytes"] for c in report["candidates"]}
    assert raced == [("none", *(p for p, peak in checked.items() if peak <= budget))]
    for c in report["candidates"]:
        f = c["frameworks"]["torch"]
        assert {"predicted_peak_bytes", "checked_peak_bytes", "measured_peak_bytes"} <= set(f)
        assert ("measured_overhead" in f) == c["timed"] == (f["measured_peak_bytes"] <= budget)  # over: not raced
        if not c["chosen"] and c["timed"]:
            assert f["chosen_vs_this"]["median"] < 0  # the answer ran faster than each other candidate
    torch_doc = doc["frameworks"]["torch"]
    assert torch_doc["measured_peak_bytes"] <= budget and torch_doc["measured_overhead"] > 0
    text = capsys.readouterr().out
    assert f"chosen: {expected}" in text and "candidates (measured round by round, at most 15 rounds" in text


def test_plan_for_budget_races_in_torch_and_says_when_a_hand_policy_wins(
    cache: dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """torch's `plan_for_budget` races the solver's plan against the hand policies that fit near it, for
    5 rounds; a hand policy measured faster is returned, said in one line. `pipeline.plan` (what the
    guards call) and JAX's `plan_for_budget` race nothing by default."""
    import jax_impl

    budget, profile, work = _mid_budget(cache["torch"]), cache["torch"], Workload.of("tiny", batch_size=2)
    calls = _measure_as(monkeypatch, cache)
    unraced = pipeline.plan(work, budget).policy
    fits = [h for h in HAND if predict(profile, SPEC, assignment_of(SPEC, h)).peak_bytes <= budget]
    monkeypatch.setattr(candidates, "RACE_WITHIN", 10.0)  # every hand policy near
    monkeypatch.setattr(sys.modules[__name__], "_true_step", lambda p: {"none": 1.0, fits[0]: 1.1}.get(p, 1.3))
    assert torch_impl.plan_for_budget("tiny", 2, budget) == fits[0] != unraced
    assert capsys.readouterr().err.count(f"plan: the hand policy {fits[0]!r} measured faster than") == 1
    n = len(calls)
    assert jax_impl.plan_for_budget("tiny", 2, budget)
    assert [c for c in calls if c[0] == "measure"] == [("measure", "torch", ("none", unraced, *fits))]
    assert calls[n:] and all(c[:2] == ("peaks", "jax") for c in calls[n:])


def test_a_shapes_profile_has_no_candidates_to_measure(
    cache: dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = dataclasses.replace(cache["torch"], mode="shapes", flops_per_s=1e14)
    profile.save(profile_path("torch", Workload.of("tiny", batch_size=2)))
    calls = _measure_as(monkeypatch, {"torch": profile})
    budget = _mid_budget(profile)
    argv = ["--config", "tiny", "--batch-size", "2", "--budget-mib", str(budget / MIB), "--candidates", "4"]
    assert cli.main(argv) == 0
    assert [c[0] for c in calls] == ["peaks"]  # the plan's check; nothing measured
    err = capsys.readouterr().err
    assert err.count("candidates: nothing measured: a profile from shapes has no step to measure\n") == 1
    found = pipeline.plan(Workload.of("tiny", batch_size=2), budget)  # the library's default: nothing measured
    assert found.candidates is None and found.policy == solve(profile, SPEC, budget, SAFETY).policy


@pytest.mark.parametrize(
    "extra", [["--budget-mib", "100"], ["--sweep", "out"], ["--solve-times"], ["--candidates", "3"]]
)
def test_policy_with_a_solving_flag_is_one_line(
    extra: list[str], cache: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.json"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--config", "tiny", "--batch-size", "2", "--policy", "full", *extra, "--json", str(out)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--policy: predicts the policy given; not with --budget-mib, --sweep, --solve-times or --candidates" in err
    assert err.count("\n") == 1 and not out.exists()


def test_a_bad_policy_is_refused_before_profiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "empty"))  # nothing cached: profiling would start a worker
    monkeypatch.setattr(pipeline, "run_worker", lambda request: pytest.fail(f"profiled: {request['kind']}"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--config", "tiny", "--batch-size", "2", "--policy", "down.7"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "down.7" in err and err.count("\n") == 1


@pytest.mark.parametrize(("policy", "world"), [("layers", 1), ("full", 2), ("down.1/save=conv,matmul", 1)])
def test_policy_is_predicted_not_solved(
    policy: str, world: int, cache: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--policy: each framework's prediction is the peak model's for that policy (per FSDP rank with
    --world-size 2: parameters and optimizer state sharded), in the plan's document with no budget,
    printed the plan's way."""
    for fw, profile in cache.items():  # what FSDP shards
        cache[fw] = dataclasses.replace(profile, static_bytes=30 * MIB, grad_bytes=10 * MIB, block_param_bytes=MIB)
        cache[fw].save(profile_path(fw, Workload.of("tiny", batch_size=2)))
    out = tmp_path / "p.json"
    argv = ["--config", "tiny", "--batch-size", "2", "--policy", policy, "--framework", "both"]
    assert cli.main([*argv, "--world-size", str(world), "--distributed", "fsdp", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert (doc["plan"], doc["budget_bytes"], doc["margin"], doc["solve_seconds"]) == (policy, None, None, None)
    printed = capsys.readouterr().out
    assert "not solved" in printed and f"policy: {policy}" in printed
    for fw, profile in cache.items():
        pred = predict(per_rank(profile, world, "fsdp"), SPEC, assignment_of(SPEC, policy))
        entry = doc["frameworks"][fw]
        assert (entry["predicted_peak_bytes"], entry["peak_at"]) == (pred.peak_bytes, pred.peak_unit)
        assert entry["predicted_overhead"] == pytest.approx(pred.time_s / profile.step_time_s)
        assert f"{fw}: predicted peak {pred.peak_bytes / MIB:,.1f} MiB: " in printed
        assert f"peak at {pred.peak_unit};" in printed
    if world > 1:  # sharding took something off
        assert doc["frameworks"]["torch"]["predicted_peak_bytes"] < predict(cache["torch"], SPEC, {}).peak_bytes


def test_policy_verify_measures_it_beside_none(cache: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """--verify with --policy measures that policy and none in one process, as it measures a plan."""
    asked: list[list[str]] = []

    def measure(fw: str, workload: Workload, policies: list[str], steps: int) -> dict:
        asked.append(policies)
        rows = {p: {"peak_bytes": 7 * MIB, "step_time_s": 1.5, "rounds_s": [1.5, 1.5]} for p in policies}
        rows["none"] = {"peak_bytes": 9 * MIB, "step_time_s": 1.0, "rounds_s": [1.0, 1.0]}
        return {"rows": rows}

    monkeypatch.setattr(cli, "measure", measure)
    _, _, question = cli.parse_args(["--config", "tiny", "--batch-size", "2", "--policy", "full", "--verify"])
    doc = cli.plan_document(question, Workload.of("tiny", batch_size=2))
    assert asked == [["none", "full"]]
    entry = doc["frameworks"]["torch"]
    assert (entry["measured_peak_bytes"], entry["measured_overhead"]) == (7 * MIB, pytest.approx(0.5))


def test_plan_for_a_diffusers_folder_and_a_cached_repo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--diffusers`` plans for the model's own config (read from its folder, or from the Hugging
    Face cache by repo id, a pipeline's unet/ found in either), for both frameworks, in a regime."""
    from shared_configs.diffusers.folders import find_folder
    from tests.helpers.diffusers_ref import cache_repo
    from tests.helpers.specs import variant
    from torch_impl.unet import UNet

    ours = variant("sd_linear_proj")  # a spec diffusers' classes can express
    UNet(ours).save_diffusers(tmp_path / "pipe" / "unet")
    hub = tmp_path / "hf" / "hub"
    cache_repo(hub, "org/tiny-pipe", tmp_path / "pipe" / "unet")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    spec = cli.parse_args(["--diffusers", str(tmp_path / "pipe"), "--batch-size", "2", "--policy", "none"])[1]
    assert spec.spec.model_dump(exclude={"name", "checkpoint"}) == ours.model_dump(exclude={"name", "checkpoint"})
    regime = ["--precision", "bf16-mixed", "--optimizer", "adafactor"]
    profiles = {}
    for seed, fw in enumerate(("torch", "jax")):
        work = dataclasses.replace(spec, regime=Regime("bf16-mixed", optimizer="adafactor"))
        profiles[fw] = dataclasses.replace(random_profile(spec.spec, seed, framework=fw), regime=work.regime.describe())
        path = profile_path(fw, work)
        path.parent.mkdir(parents=True, exist_ok=True)
        profiles[fw].save(path)
    for source in (str(tmp_path / "pipe"), "org/tiny-pipe"):
        assert find_folder(source).root.name == "unet"
        out = tmp_path / "plan.json"
        argv = ["--diffusers", source, "--batch-size", "2", "--policy", "layers", "--framework", "both", *regime]
        assert cli.main([*argv, "--json", str(out)]) == 0
        doc = json.loads(out.read_text())
        assert doc["regime"]["optimizer"] == "adafactor"
        for fw, entry in doc["frameworks"].items():
            expected = predict(profiles[fw], spec.spec, assignment_of(spec.spec, "layers")).peak_bytes
            assert entry["predicted_peak_bytes"] == expected
    assert "bf16-mixed, all weights trained, adafactor" in capsys.readouterr().out


def test_the_answer_names_none_and_full_and_lists_each_block(cache: dict, capsys: pytest.CaptureFixture[str]) -> None:
    """Beside the policy string: a link to its grammar, none's and full's predicted peaks, the plan's
    saving and time cost, and per block what is recomputed, with which op classes saved, and kept."""
    none, full = (predict(cache["torch"], SPEC, assignment_of(SPEC, p)).peak_bytes for p in ("none", "full"))
    budget = (none + full) / 2
    assert cli.main(["--config", "tiny", "--batch-size", "2", "--budget-mib", str(budget / MIB)]) == 0
    out = capsys.readouterr().out
    assert "docs/spec_and_plans.md#checkpoint-plans" in out.splitlines()[0]
    plan = next(line for line in out.splitlines() if line.startswith("  policy: ")).split()[1]
    peak = predict(cache["torch"], SPEC, assignment_of(SPEC, plan)).peak_bytes
    assert f"saves {1 - peak / none:.0%} of none's peak (none {none / MIB:,.1f} MiB, full {full / MIB:,.1f} MiB)" in out
    listing = out.split("per block:")[1].splitlines()[1:]
    assignment = assignment_of(SPEC, plan)
    assert [line.split(":")[0].strip() for line in listing] == list(block_layers(SPEC))
    for line in listing:
        block, text = (part.strip() for part in line.split(":", 1))
        for layer in block_layers(SPEC)[block]:
            name = layer.removeprefix(block + ".")
            choice = assignment.get(block, assignment.get(layer, "plain"))
            if block in assignment:
                assert text.startswith("recomputed whole") and (choice == "full") == ("saving" not in text)
            elif choice == "plain":
                assert text == "kept" or name in text.split("kept ")[1]
            else:
                assert name in text.split("kept ")[0]


def test_the_block_listing() -> None:
    spec_layers = ("down.1.resnets.0", "down.1.attentions.0", "down.1.downsample")
    assignment = {"down.1.resnets.0": "full", "down.1.attentions.0": "save=conv,matmul"}
    assert plan_text.block_line("down.1", spec_layers, assignment) == (
        "down.1: recomputed resnets.0 | saving conv, matmul: attentions.0 | kept downsample"
    )
    assert plan_text.block_line("mid", ("mid.resnets.0",), {"mid": "save=conv"}) == (
        "mid: recomputed whole, saving conv outputs"
    )
    assert plan_text.block_line("up.0", ("up.0.resnets.0",), {}) == "up.0: kept"
