"""`benchmarks.max_batch`: the search against brute force, and one end-to-end run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.harness.job import REPO_ROOT
from benchmarks.max_batch import DEFAULT_PROBES, ROUNDS, answer, main, next_batches
from shared_configs import load_spec
from shared_configs.sizes import MIB
from torch_impl import UNet


def _row(batch: int, peak: float) -> dict:
    return {"framework": "jax", "policy": "full", "batch_size": batch, "status": "ok", "peak_bytes": peak}


def _search(peak: Callable[[int], float], budget: float) -> dict:
    """The rounds `main` runs, with ``peak`` standing in for a worker."""
    rows = [_row(b, peak(b)) for b in DEFAULT_PROBES]
    for _ in range(ROUNDS):
        todo = next_batches(rows, budget)
        if not todo:
            break
        rows += [_row(b, peak(b)) for b in todo]
    return answer(rows, budget)[0] | {"measured": len(rows)}


PEAKS = {
    "affine": lambda b: (100 + 7 * b) * MIB,
    # XLA-like: mostly affine, with buffer-assignment jumps of a few MiB every 16 samples
    "jumps": lambda b: (100 + 7 * b + 5 * ((b // 16) % 2)) * MIB,
    # small batches cost more per sample than large ones (kernel workspace), so the probe line overshoots
    "concave": lambda b: (100 + 7 * b + 40 * min(b, 4)) * MIB,
}


@pytest.mark.parametrize("shape", PEAKS)
@pytest.mark.parametrize("budget_mib", [450, 1000, 2500])
def test_search_finds_the_brute_force_answer(shape: str, budget_mib: int) -> None:
    peak, budget = PEAKS[shape], budget_mib * MIB
    truth = max(b for b in range(1, 2000) if peak(b) <= budget and peak(b + 1) > budget)
    found = _search(peak, budget)
    assert found["largest_batch"] == truth and found["bracketed"]
    assert found["peak_bytes"] == peak(truth)
    assert found["measured"] <= 2 + 2 * ROUNDS


def test_budget_below_the_fixed_memory_has_no_answer() -> None:
    found = _search(PEAKS["affine"], 50 * MIB)
    assert found["largest_batch"] is None and not found["bracketed"]


@pytest.mark.parametrize("budget", ["0", "-5", "nan", "inf", "lots"])
def test_an_impossible_budget_is_refused_at_once(budget: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--config", "tiny", f"--budget-mib={budget}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "argument --budget-mib: expected a positive" in err, err


@pytest.mark.slow
def test_a_budget_below_the_floor_is_refused_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The floor (parameters + AdamW's two moments, float32) from the model's shapes, before any work."""
    with pytest.raises(SystemExit) as exit_:
        main(["--config", "tiny", "--budget-mib", "1", "--out", str(tmp_path)])
    assert exit_.value.code == 2
    model = UNet(load_spec("tiny"))
    floor = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    err = capsys.readouterr().err.strip()
    assert err == (
        "python -m benchmarks.max_batch: error: "
        f"--budget-mib: 1.0 MiB is not above the floor of {floor / MIB:,.1f} MiB that every step "
        f"holds ({floor // 12:,} float32 parameters and their AdamW state); a budget must exceed it"
    )
    assert not list(tmp_path.glob("max_batch-*.json"))


@pytest.mark.heavy  # minutes of CPU: left out of the default run
def test_end_to_end_torch(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "benchmarks.max_batch", "--framework", "torch", "--config", "tiny"]
    cmd += ["--policies", "full", "--budget-mib", "12", "--device", "cpu", "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one torch thread, as tests/conftest.py sets in-process
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(next(tmp_path.glob("max_batch-*.json")).read_text())
    results = {r["policy"]: r for r in doc["largest_batch"]}
    for policy, result in results.items():  # the answer fits, the batch above it does not
        peaks = {r["batch_size"]: r["peak_bytes"] for r in doc["rows"] if r["policy"] == policy}
        assert peaks[result["largest_batch"]] <= 12 * MIB < peaks[result["largest_batch"] + 1]
    assert results["full"]["largest_batch"] > results["none"]["largest_batch"]
