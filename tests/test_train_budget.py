"""``--budget-mib`` on both training CLIs: the plan is the planner's for the run's own workload, the
measured peak is the step's (checked against the benchmark's own instruments), and a resume with
the same budget keeps the run's plan. Profiles are seeded into a temporary cache (random figures),
so nothing is profiled; the planner's check is stood in for by the profile's prediction."""

from __future__ import annotations

import importlib
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from shared_configs import load_spec
from shared_configs.defaults import defaults
from shared_configs.planning import pipeline
from shared_configs.planning.budget import predict
from shared_configs.planning.closed_loop import MEASURED_STEPS
from shared_configs.planning.pipeline import CACHE_ENV, Workload, plan_for_budget, profile_path
from shared_configs.planning.solver import smallest_peak
from shared_configs.planning.units import assignment_of
from shared_configs.sizes import MIB
from shared_configs.training.run_folder import checkpoints
from shared_configs.training.run_plan import RunPlan
from tests.helpers.specs import random_profile

SPEC = load_spec("tiny")
BATCH = 4
# What a training step reads: `shared_configs.training.data` gives one context token per image.
WORKLOAD = Workload.of("tiny", batch_size=BATCH, context_length=1)


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--policy", "full", "--budget-mib", "100"], "argument --budget-mib: not allowed with argument --policy"),
        (["--budget-mib", "0"], "argument --budget-mib: expected a positive number of MiB, got '0'"),
    ],
)
def test_bad_budget_flags_are_one_line(
    framework: str, flags: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(f"{framework}_impl.train").parse_args(flags)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m {framework}_impl.train: error: ") and match in err and err.count("\n") == 1


def _seed(framework: str, factor: int = 1) -> int:
    """A random profile of the training workload in the cache (bytes times ``factor``); returns a
    budget halfway between its smallest feasible peak and none's."""
    profile = random_profile(SPEC, 0, framework=framework)
    # the workload the run plans for, as the cache checks it on read
    profile = replace(profile, batch_size=WORKLOAD.batch_size, context_length=WORKLOAD.context_length)
    profile = replace(
        profile,
        units={
            u: {
                c: replace(v, keep=v.keep * factor, fwd_peak=v.fwd_peak * factor, bwd_peak=v.bwd_peak * factor)
                for c, v in per.items()
            }
            for u, per in profile.units.items()
        },
    )
    path = profile_path(framework, WORKLOAD)
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    low, high = smallest_peak(profile, SPEC).prediction.peak_bytes, predict(profile, SPEC, {}).peak_bytes
    return (low + high) // 2


@pytest.fixture
def seen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """An empty profile cache; the planner's check stood in for by the prediction; the measured
    peaks the loops report, as they give them (bytes)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))

    def run_worker(request: dict) -> dict:
        assert request["kind"] == "peaks", request["kind"]  # never a profile: they are seeded
        profile = pipeline.get_profile(request["framework"], WORKLOAD)
        return {"peaks": {p: predict(profile, SPEC, assignment_of(SPEC, p)).peak_bytes for p in request["policies"]}}

    monkeypatch.setattr(pipeline, "run_worker", run_worker)
    peaks: list[int] = []
    line = RunPlan.peak_line

    def peak_line(self: RunPlan, measured: int, instrument: str) -> str:
        peaks.append(measured)
        return line(self, measured, instrument)

    monkeypatch.setattr(RunPlan, "peak_line", peak_line)
    return peaks


def _argv(out: Path, steps: int, budget_bytes: int, *extra: str) -> list[str]:
    flags = ["--batch-size", BATCH, "--steps", steps, "--checkpoint-every", 1, "--sample-steps", 0, "--out", out]
    return [str(f) for f in flags] + ["--budget-mib", repr(budget_bytes / MIB), *extra]


def _record(out: Path) -> dict:
    manifest = checkpoints(out)[-1][1] / "manifest.json"
    return json.loads(manifest.read_text())["run"]["config"]


def _torch_tracker_peak(policy: str) -> int:
    """The benchmark's `StepTracker` over the first two steps of a fresh run under ``policy``."""
    from shared_configs.training.data import load_dataset
    from tests.helpers.training import SCHEDULE, torch_model
    from torch_impl import train as ttrain
    from torch_impl.memory import StepTracker
    from torch_impl.profile import batch_inputs

    model = torch_model(SPEC, policy)
    optimizer = ttrain.make_optimizer(model, 1e-3, 0.0)
    dataset, peaks = load_dataset("digits", SPEC), []
    for step in range(MEASURED_STEPS):
        batch = dataset.batch(step, BATCH, SCHEDULE, 0)
        with StepTracker(model, optimizer, inputs=batch_inputs(batch)) as tracker:
            ttrain.train_step(model, optimizer, batch)
        peaks.append(tracker.result.peak)
    return max(peaks)


@pytest.mark.slow
def test_torch_trains_to_a_budget_and_resumes_its_plan(
    seen: list[int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plan is `plan_for_budget`'s for the run's workload; the measured peak is the benchmark
    tracker's within 1%; the run's `BudgetGuard` corrects the plan against that measurement (this
    profile is random: its predictions are not the step's), its history and last plan go into the
    run's record, and a resume with the same budget starts from that plan though the profile changed
    so that no plan fits now; one with another budget plans again (and says none fits)."""
    from torch_impl import train as ttrain

    budget, out = _seed("torch"), tmp_path / "run"
    policy = plan_for_budget("tiny", BATCH, budget, context_length=1)
    assert ttrain.main(_argv(out, 2, budget)) == 0
    err = capsys.readouterr().err
    predicted = predict(pipeline.get_profile("torch", WORKLOAD), SPEC, assignment_of(SPEC, policy)).peak_bytes
    assert f"policy {policy} (planned for this run); torch predicted peak {predicted / MIB:.1f} MiB" in err
    assert len(seen) == 1 and "torch_impl.memory.step_peak" in err and "max of steps 1-2" in err
    assert math.isclose(max(seen), _torch_tracker_peak(policy), rel_tol=0.01)
    history = _history(out)
    assert (history[0]["plan"], history[0]["action"]) == (policy, "given")
    measured = [r for r in history if r["measured"] is not None]
    assert [r["step"] for r in measured] == [1, 2] and max(r["measured"] for r in measured) == seen[0]
    last, changes = history[-1]["plan"], [r for r in history[1:] if r["measured"] is None]
    assert _record(out)["policy"] == last and ("guard: step" in err) == bool(changes)

    _seed("torch", factor=100)  # the cache changes: planning again could not fit the budget
    assert ttrain.main(_argv(out, 3, budget, "--resume")) == 0
    assert f"policy {last} (the run's own plan, kept on resume)" in capsys.readouterr().err
    assert _record(out)["policy"] == last and len(seen) == 2  # its one step measured and reported
    assert len(_history(out)) > len(history)  # the resumed run's guard adds to the run's history
    assert ttrain.main(_argv(out, 4, budget + MIB, "--resume")) == 2
    assert "budget: no plan fits" in capsys.readouterr().err


def _history(out: Path) -> list[dict]:
    manifest = checkpoints(out)[-1][1] / "manifest.json"
    return json.loads(manifest.read_text())["run"]["guard"]


@pytest.mark.heavy
def test_jax_trains_to_a_budget_reporting_the_compiled_peak_the_planner_checks(
    seen: list[int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """JAX: the plan is `plan_for_budget`'s; the peak reported is the loop's compiled step's, equal
    (within 1%: the optimizer's hyperparameters differ) to the planner's check of the same plan."""
    from jax_impl import train as jtrain
    from jax_impl.profile import peaks

    budget = _seed("jax")
    policy = plan_for_budget("tiny", BATCH, budget, framework="jax", context_length=1)
    assert jtrain.main(_argv(tmp_path / "run", 1, budget)) == 0
    err = capsys.readouterr().err
    assert f"policy {policy} (planned for this run); jax predicted peak" in err
    assert "memory_analysis()" in err and "cse_barrier_expander off" in err
    assert len(seen) == 1 and _record(tmp_path / "run")["policy"] == policy
    # The loop's own compiled step is judged before training (`jax_impl.plan_for_step`): the model's
    # step and nothing more, so the planned policy fits as it is, in one compile, kept in the record.
    assert [(r["plan"], r["action"]) for r in _history(tmp_path / "run")] == [(policy, "fits")]
    assert "guard: the loop's compiled step under" in err
    # The loop's attention is the device default's (query-chunked on CPU), as the planner's workload is.
    checked = peaks(SPEC, BATCH, [policy], context_length=1, attention_chunk=defaults("cpu").attention_chunk)
    assert math.isclose(seen[0], checked["peaks"][policy], rel_tol=0.01)
