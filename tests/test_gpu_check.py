"""`python -m benchmarks.gpu_check`: every command of the GPU's and of the CPU's checks is one its
CLI accepts (each parser, not a copy of its flags), each step has its own folder, a step over its
limit is stopped and reported, and a failed step makes the check exit 1 with the report written."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from benchmarks.gpu_check import Step


@pytest.mark.parametrize("cuda", [True, False], ids=["gpu", "cpu"])
def test_every_step_is_a_command_its_cli_accepts(cuda: bool, tmp_path: Path) -> None:
    steps = gpu_check.steps(cuda, tmp_path)
    assert {s.name for s in steps} >= {"compare", "sweep", "estimates", "guard", "measured"}
    names = [s.name for s in steps]
    assert names.index("estimates") < names.index("guard")  # the guard's sd15 profile is the estimates' own
    for step in steps:
        assert step.argv[:2] == [sys.executable, "-m"]
        parser = importlib.import_module(step.argv[2]).build_parser()
        args = parser.parse_args(step.argv[3:])  # exits (a failure here) on a flag the CLI lacks
        folder = args.sweep if step.name == "sweep" else args.out
        assert folder == tmp_path / step.name
    if cuda:  # the bound: at most 8 minutes on the GPU
        assert sum(s.limit_s for s in steps) <= 8 * 60


def test_a_step_over_its_limit_is_stopped_and_a_failed_check_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = Step("slow", [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"], 2)
    failing = Step("failing", [sys.executable, "-c", "raise SystemExit(3)"], 30)
    monkeypatch.setattr(gpu_check, "steps", lambda cuda, out: [slow, failing])
    monkeypatch.setattr(gpu_check, "device", lambda: (False, "CPU"))
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    by_name = {r["name"]: r for r in doc["steps"]}
    assert by_name["slow"]["rc"] is None and by_name["slow"]["seconds"] < 30
    assert "started" in by_name["slow"]["output"] and "stopped at its 2 s limit" in by_name["slow"]["output"]
    assert by_name["failing"]["rc"] == 3
    assert "## slow: stopped at its limit" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.heavy  # minutes of CPU: left out of the default run
def test_the_guard_step_keeps_an_extra_buffer_within_budget_and_reports_each_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CPU's `guard` step as it runs (`tiny` 16x16 batch 2, 3 steps): the first measured step is
    over budget (the extra buffer), the guard tightens, and the last measured step fits."""
    (step,) = [s for s in gpu_check.steps(False, tmp_path) if s.name == "guard"]
    from benchmarks import guard_check

    assert guard_check.main(step.argv[3:]) == 0
    doc = json.loads((tmp_path / "guard" / "guard.json").read_text())
    measured = [r for r in doc["history"] if r["measured"] is not None]
    assert measured[0]["measured"] > doc["budget"] >= measured[-1]["measured"]
    assert any(r["action"] == "tightened" for r in doc["history"])
    out = capsys.readouterr().out
    assert out.count("step ") == len(doc["history"]) and "over budget" in out
