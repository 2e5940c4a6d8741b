"""What the guard's tests share: one profile cache per test module, and the planner's worker check of a plan
stood in for by the profile's prediction (tests/test_guard.py, tests/test_guard_scripts.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from shared_configs.pair import workload_spec
from shared_configs.planning import pipeline
from shared_configs.planning.pipeline import CACHE_ENV, Workload, predict_policy
from shared_configs.regime import Regime


@pytest.fixture(scope="module")
def plan_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One profile cache for the module: each spec is profiled once."""
    path = tmp_path_factory.mktemp("plan-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(path))
        yield path


@pytest.fixture
def check_by_prediction(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's check of a plan's peak (a fake-tensor step in a worker) stood in for by the
    profile's prediction; profiles are still measured."""
    monkeypatch.setattr(pipeline, "run_worker", checking_by_prediction(pipeline.run_worker))


def checking_by_prediction(real: Callable[[dict], dict]) -> Callable[[dict], dict]:
    """``real`` (the planner's worker call) with its "peaks" requests answered by the profile's prediction."""

    def run_worker(request: dict) -> dict:
        if request["kind"] != "peaks":
            return real(request)
        work = Workload(
            workload_spec(request["spec"]),
            request["batch_size"],
            Regime(**request["regime"]),
            request["context_length"],
        )
        return {"peaks": {p: predicted(work, p) for p in request["policies"]}}

    return run_worker


def predicted(work: Workload, policy: str) -> int:
    """The profile's predicted peak of ``policy`` (bytes)."""
    return predict_policy(work, policy)[0].prediction.peak_bytes
