"""`python -m benchmarks.estimates`: the table from cached shapes-only profiles (seeded here with
random figures: nothing is profiled), each cell what the planner predicts; bad input is one line."""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path

import pytest

from benchmarks import estimates
from shared_configs import load_spec
from shared_configs.cli import Interrupted
from shared_configs.planning import gpu, pipeline
from shared_configs.planning.budget import predict
from shared_configs.planning.pipeline import CACHE_ENV, Workload, profile_path
from shared_configs.planning.units import assignment_of
from shared_configs.regime import Regime
from shared_configs.sizes import MIB
from tests.helpers.specs import random_profile

SPEC = load_spec("tiny")


def test_the_table_is_the_planners_predictions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    profiles = {}
    for i, name in enumerate(("fp32", "bf16-mixed+lora:8")):
        work = Workload.of("tiny", batch_size=2, regime=estimates.REGIMES[name], shapes=True)
        profile = dataclasses.replace(
            random_profile(SPEC, i, framework="torch"), mode="shapes", regime=work.regime.describe()
        )
        path = profile_path("torch", work)
        path.parent.mkdir(parents=True, exist_ok=True)
        profile.save(path)
        profiles[name] = (work, profile)

    def run_worker(request: dict) -> dict:  # the fit check: the prediction itself
        assert request["kind"] == "peaks", request["kind"]
        name = "fp32" if request["regime"]["trainable"] == "all" else "bf16-mixed+lora:8"
        (policy,) = request["policies"]
        return {"peaks": {policy: predict(profiles[name][1], SPEC, assignment_of(SPEC, policy)).peak_bytes}}

    monkeypatch.setattr(pipeline, "run_worker", run_worker)
    # budgets in MiB here (tiny's figures are far below a GiB): one between full's and none's peaks
    monkeypatch.setattr(estimates, "GIB", MIB)
    fp32 = profiles["fp32"][1]
    none, full = (predict(fp32, SPEC, assignment_of(SPEC, p)).peak_bytes for p in ("none", "full"))
    mid, high = (none + full) // 2 // MIB, none // MIB + 1
    out = tmp_path / "out"
    argv = ["--configs", "tiny", "--batches", "2", "--regimes", "fp32,bf16-mixed+lora:8", "--out", str(out)]
    assert estimates.main([*argv, "--budgets-gib", f"{mid},{high}"]) == 0
    doc = json.loads((out / "estimates.json").read_text())
    assert doc["complete"] is True and [r["regime"] for r in doc["rows"]] == ["fp32", "bf16-mixed+lora:8"]
    for row in doc["rows"]:
        work, profile = profiles[row["regime"]]
        assert row["none"]["peak_bytes"] == predict(profile, SPEC, {}).peak_bytes
        assert row["diffusers_style"]["peak_bytes"] == predict(profile, SPEC, assignment_of(SPEC, "layers")).peak_bytes
        # the GPU flavour (the default --device cuda): the same policy on the flavoured profile
        flavour = gpu.estimate(profile, SPEC, work.regime, {})
        assert (
            row["none"]["cuda"] == dataclasses.asdict(flavour) and flavour.allocated_bytes > row["none"]["peak_bytes"]
        )
    planned = doc["rows"][0]["plans"]
    assert planned[str(high)]["policy"] == "none"
    assert planned[str(mid)]["policy"] not in (None, "none") and planned[str(mid)]["peak_bytes"] <= mid * MIB
    assert planned[str(mid)]["policy"] == pipeline.plan(profiles["fp32"][0], mid * MIB).policy
    assert "| tiny 8² | 2 | fp32 |" in (out / "estimates.md").read_text()
    assert "cuda: none GiB (allocated / device)" in (out / "estimates.md").read_text()


@pytest.mark.parametrize(
    ("flag", "value", "match"),
    [
        ("--regimes", "fp32,bf17", "--regimes: expected names from fp32, bf16-mixed"),
        ("--batches", "1,0", "--batches: expected positive integers separated by commas, got '1,0'"),
        ("--gpu-gib", "12,0", "--gpu-gib: expected positive numbers separated by commas, got '12,0'"),
        ("--with-encoders", None, "--with-encoders, --cached-latents, --train-text-encoder: for the card table"),
    ],
)
def test_bad_input_is_one_line(flag: str, value: str | None, match: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        estimates.main([flag] if value is None else [flag, value])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and match in err


def test_a_stopped_run_says_what_it_wrote_and_marks_it_incomplete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    done: list[str] = []

    def row(config: str, batch: int, regime: str, budgets_gib: tuple, device: str) -> dict:
        if done:  # the second case: stopped as by Ctrl-C
            raise Interrupted(signal.SIGINT)
        done.append(regime)
        return {"config": config, "batch_size": batch, "regime": regime}

    monkeypatch.setattr(estimates, "row", row)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        estimates.main(["--configs", "tiny", "--batches", "1,2", "--regimes", "fp32", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_info.value.code == 128 + signal.SIGINT
    assert f"1 of 2 rows written to {out / 'estimates.json'}, marked incomplete" in err and "nothing written" not in err
    doc = json.loads((out / "estimates.json").read_text())
    assert doc["complete"] is False and doc["cases"] == 2 and len(doc["rows"]) == 1
    assert not (out / "estimates.md").exists()


def test_the_card_table_is_the_largest_batch_that_fits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--gpu-gib``: per card, the largest batch whose plain peak fits, and the largest with a
    plan, each against the card's memory as nvidia-smi counts it (the GPU flavour's reading)."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    profiles = {}
    for batch in (1, 2):
        work = Workload.of("tiny", batch_size=batch, shapes=True)
        profile = dataclasses.replace(random_profile(SPEC, batch, framework="torch"), mode="shapes", batch_size=batch)
        path = profile_path("torch", work)
        path.parent.mkdir(parents=True, exist_ok=True)
        profile.save(path)
        profiles[batch] = profile
    card_mib = 700
    monkeypatch.setattr(estimates, "GIB", MIB)  # tiny's figures are far below a GiB: cards in MiB here
    out = tmp_path / "out"
    argv = ["--config", "tiny", "--batches", "1,2", "--regimes", "fp32", "--device", "cuda", "--out", str(out)]
    assert estimates.main([*argv, "--gpu-gib", str(card_mib)]) == 0
    doc = json.loads((out / "cards.json").read_text())
    cell = doc["rows"][0]["cards"][str(card_mib)]
    on_card = {b: gpu.estimate(p, SPEC, Regime(), {}).device_bytes for b, p in profiles.items()}  # plain, on the card
    fits = [b for b, total in on_card.items() if total <= card_mib * MIB]
    assert (cell["none"] or {}).get("batch") == max(fits, default=None)
    plan = cell["plan"]
    assert plan["device_bytes"] <= card_mib * MIB
    flavour = gpu.estimate(profiles[plan["batch"]], SPEC, Regime(), assignment_of(SPEC, plan["policy"]))
    assert flavour.device_bytes == plan["device_bytes"]
    assert "| tiny 8² | fp32 |" in (out / "cards.md").read_text()
