"""The benchmark CLI: output schema end to end, OOM handling, bad input, the report and the pictures.

End-to-end runs use the tiny preset at batch 1 with one timed step (`tests.helpers.processes.run_compare`:
LLVM at -O0, which changes no memory figure). The instruments themselves are checked in
tests/test_benchmarks_memory.py.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from benchmarks import compare, max_batch, saved
from benchmarks.backends.worker import run_row
from benchmarks.harness.job import KILL_SIM_ENV, OOM_SIM_ENV, Job, cpu_snapshot, one_line, other_cpu_share
from benchmarks.reports import plot, tables
from shared_configs.memory import CATEGORIES, block_marks, timeline
from tests.helpers.processes import rows_of, run_compare
from tests.helpers.specs import TINY

FAST = ["--config", "tiny", "--batch-size", "1", "--steps", "1", "--device", "cpu"]


@pytest.mark.slow
def test_both_frameworks_schema_and_full_lowers_the_peak(tmp_path: Path) -> None:
    """One run of both frameworks (one test, so that pytest-xdist compiles the jax step once). Batch
    16: at batch 1 tiny's peak is its parameters, gradients and AdamW state (at the step's start,
    before zero_grad), which no policy changes."""
    args = ["--framework", "both", "--policies", "full", *FAST, "--batch-size", "16"]
    proc, doc = run_compare(args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert doc is not None
    _check_schema(proc, doc, tmp_path)
    for framework in ("torch", "jax"):
        rows = rows_of(doc, framework)
        assert rows["full"]["peak_bytes"] < rows["none"]["peak_bytes"], framework
        assert rows["full"]["activation_bytes"] < rows["none"]["activation_bytes"], framework
        assert rows["full"]["saved_bytes"] < rows["none"]["saved_bytes"], framework
        assert rows["full"]["static_bytes"] == rows["none"]["static_bytes"], framework
        assert rows["full"]["recompute_flops"] > 0, framework  # the recomputation is paid for
        assert rows["full"]["peak_reduction"] > 0 and rows["full"]["time_overhead"] > 0
    torch_none = rows_of(doc, "torch")["none"]
    assert abs(torch_none["peak_bytes"] / torch_none["memtracker_peak_bytes"] - 1) <= 0.05


def _check_schema(proc: Any, doc: dict[str, Any], out: Path) -> None:
    assert {"config", "device", "rows", "versions", "git_sha", "dtype", "methods", "timelines"} <= doc.keys()
    assert doc["config"]["name"] == "tiny" and doc["dtype"] == "float32"
    assert {"torch", "jax", "flax", "python"} <= doc["versions"].keys()
    assert doc["device"]["torch"]["kind"] == doc["device"]["jax"]["kind"] == "cpu"
    assert "cse_barrier_expander disabled" in doc["methods"]["jax"]["peak_method"]
    assert "query-chunked" in doc["methods"]["jax"]["peak_method"]  # auto: chunked on CPU
    assert len(doc["rows"]) == 4  # none is always added, as the baseline
    for row in doc["rows"]:
        assert row.keys() == set(tables.COLUMNS)
        assert row["status"] == "ok", row["error"]
        parts = [row[f"{kind}_bytes"] for kind in CATEGORIES]
        assert sum(parts) == row["peak_bytes"] and min(parts) >= 0, (row["framework"], row["policy"], parts)
        assert row["flops"] > 0 and row["step_time_s"] > 0 and row["saved_bytes"] > 0
    assert {(t["framework"], t["policy"]) for t in doc["timelines"]} == {
        (fw, p) for fw in ("torch", "jax") for p in ("none", "full")
    }
    with open(next(out.glob("*.csv")), newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == tables.COLUMNS
        assert len(list(reader)) == 4
    assert len(list(out.glob("*-timeline.png"))) == 1 and len(list(out.glob("*.png"))) == 2
    assert not list(out.glob(".*.tmp")), "temporary files left behind"
    assert "OOM" not in proc.stdout
    assert "tiny @ 8x8, float32" in proc.stdout
    # Not a terminal, where rich draws its bar only at the end: a line on stderr as each row starts.
    started = [line for line in proc.stderr.splitlines() if line.startswith("compare: ")]
    assert started == [f"compare: {fw}: {p} @ batch 16 ..." for fw in ("torch", "jax") for p in ("none", "full")]


@pytest.mark.heavy
def test_batch_norm_spec_benchmarks_in_jax(tmp_path: Path) -> None:
    """The JAX step carries BatchNorm statistics (TrainState): a batch-norm spec is measured."""
    path = tmp_path / "bn.yaml"
    path.write_text(yaml.safe_dump({**TINY, "norm_kind": "batch"}))
    args = ["--framework", "jax", "--config", str(path), "--policies", "full", "--timeline", "off", *FAST[2:]]
    proc, doc = run_compare(args, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    rows = rows_of(doc, "jax")
    assert rows["full"]["status"] == rows["none"]["status"] == "ok"
    assert rows["full"]["activation_bytes"] < rows["none"]["activation_bytes"]


@pytest.mark.slow
def test_oom_is_a_row_and_the_run_goes_on(tmp_path: Path) -> None:
    """An OOM raised in the worker, and a worker killed mid-row (a fresh one takes over)."""
    sim = {OOM_SIM_ENV: "torch:full:1", KILL_SIM_ENV: "torch:balanced:1"}
    args = ["--framework", "torch", "--policies", "full,balanced,layers", *FAST]
    proc, doc = run_compare(args, tmp_path, **sim)
    assert proc.returncode == 0, proc.stderr
    assert doc is not None
    rows = rows_of(doc, "torch")
    assert rows["full"]["status"] == "oom" and "out of memory" in rows["full"]["error"]
    assert rows["full"]["peak_bytes"] is None and rows["full"]["peak_reduction"] is None
    assert rows["balanced"]["status"] == "oom" and "SIGKILL" in rows["balanced"]["error"]
    assert rows["none"]["status"] == rows["layers"]["status"] == "ok"
    assert rows["layers"]["peak_reduction"] is not None  # measured by the second worker
    assert proc.stdout.count("OOM") == 2


@pytest.mark.heavy  # an out-of-memory row stays in the default run for torch: test_oom_is_a_row_and_the_run_goes_on
def test_jax_oom_is_reported(tmp_path: Path) -> None:
    args = ["--framework", "jax", "--policies", "none", *FAST]
    proc, doc = run_compare(args, tmp_path, **{OOM_SIM_ENV: "jax:none:1"})
    assert proc.returncode == 0, proc.stderr
    assert rows_of(doc, "jax")["none"]["status"] == "oom"
    assert "RESOURCE_EXHAUSTED" in rows_of(doc, "jax")["none"]["error"]


@pytest.mark.slow
def test_missing_gpu_is_a_one_line_error(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc, doc = run_compare(["--framework", "torch", "--device", "gpu", "--config", "tiny"], tmp_path)
    assert proc.returncode == 1 and doc is None
    expected = "python -m benchmarks.compare: error: device: gpu requested but torch sees no CUDA device"
    assert proc.stderr.strip() == expected


class _FakeBackend:
    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def measure(self, *args: Any) -> dict[str, Any]:
        if self.error is not None:
            raise self.error
        return {"peak_bytes": 1}

    OOM_TYPES = (MemoryError,)

    def release(self, device: Any) -> None:
        pass


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (None, "ok"),
        (MemoryError(), "oom"),
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), "oom"),
        (RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate"), "oom"),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"), "oom"),
        (ValueError("a bug"), "error"),
    ],
)
def test_worker_classifies_failures(error: BaseException | None, status: str) -> None:
    job = Job("torch", "tiny", None, ("none",), (1,), 1, "fp32", "cpu", 4)
    row = run_row(_FakeBackend(error), job, "none", 1, None)  # type: ignore[arg-type]
    assert row["status"] == status and row["framework"] == "torch" and row["batch_size"] == 1


def test_an_error_keeps_every_line_of_its_message() -> None:
    """A state-dict mismatch names the keys on the lines after the first: none is cut off."""
    err = RuntimeError(
        "Error(s) in loading state_dict for UNet:\n\tsize mismatch for conv_in.weight: a\n\tsize "
        "mismatch for conv_out.bias: b"
    )
    line = one_line(err)
    assert "\n" not in line and "conv_in.weight" in line and "conv_out.bias" in line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policies", "none,bogus"], "policy: unknown policy 'bogus'"),
        (["--config", "nope"], "config: unknown preset 'nope'"),
        (["--batch-size", "0"], "expected a positive integer"),
        (["--batch-size", "two"], "expected a positive integer"),
        (["--policies", "down.9"], "unknown block name 'down.9'"),
        (["--sample-size", "10", "--config", "small"], "sample_size: 10 is not divisible"),
        (["--framework", "torch,mxnet"], "unknown framework 'mxnet' (allowed: both, or a comma list of torch"),
        (["--diffusers", "/nonexistent/unet"], "--diffusers: /nonexistent/unet: no config.json"),
        (["--diffusers", "/x", "--config", "tiny"], "argument --config: not allowed with argument --diffusers"),
        # tiny's level-0 self-attention has no diffusers twin (see tests/test_diffusers_export.py)
        (["--framework", "diffusers", "--config", "tiny"], "spec 'tiny' has no diffusers equivalent"),
        (["--policies", "full", "--timeline", "layers"], "timeline: 'layers' is not among the measured policies"),
        (["--jax-attention-chunk", "-1"], "expected auto, 0 (unchunked) or a number of queries"),
    ],
)
def test_bad_input_is_one_line_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        compare.main([*args, "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.parametrize("main", [compare.main, max_batch.main])
def test_an_unwritable_out_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], main: Any
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    extra = ["--budget-mib", "100"] if main is max_batch.main else []
    with pytest.raises(SystemExit) as exit_:
        main([*FAST, *extra, "--out", str(blocker / "results")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    heads = tuple(f"python -m benchmarks.{m}: error: --out: cannot write" for m in ("compare", "max_batch"))
    assert err.startswith(heads), err


@pytest.mark.parametrize("parser", [compare.build_parser(), max_batch.parser(), saved.build_parser()])
def test_help_documents_every_option(parser: Any) -> None:
    text = parser.format_help()
    for action in parser._actions:
        assert action.help, action.dest
        for flag in action.option_strings:
            assert flag in text


def test_reductions_and_ratios_are_against_none_of_the_same_framework_and_batch() -> None:
    def row(fw: str, policy: str, peak: int, time_s: float, batch: int = 2) -> dict[str, Any]:
        return {
            "framework": fw,
            "policy": policy,
            "batch_size": batch,
            "status": "ok",
            "peak_bytes": peak,
            "step_time_s": time_s,
            "flops": 10.0 * peak,
        }

    rows = tables.complete(
        [
            row("torch", "none", 100, 1.0),
            row("torch", "full", 60, 1.5),
            row("jax", "none", 200, 2.0),
            row("jax", "full", 50, 3.0),
            row("jax", "full", 10, 1.0, batch=4),
        ]
    )
    torch_full, jax_full, orphan = rows[1], rows[3], rows[4]
    assert torch_full["peak_reduction"] == pytest.approx(0.4) and torch_full["time_overhead"] == pytest.approx(1.5)
    assert jax_full["peak_reduction"] == pytest.approx(0.75) and jax_full["recompute_flops"] == pytest.approx(-1500)
    assert orphan["peak_reduction"] is None  # no baseline at batch 4


def test_other_cpu_share_is_what_this_run_did_not_use() -> None:
    cores = os.cpu_count() or 1
    start, end = (0.0, 100.0, 5.0), (10.0, 100.0 + 10.0 * cores, 5.0 + 5.0 * cores)
    assert other_cpu_share(start, end) == pytest.approx(0.5)  # busy all along, half of it ours
    assert other_cpu_share((0.0, None, 0.0), end) is None
    now = cpu_snapshot()
    assert now[2] > 0 and (now[1] is None or now[1] > 0)


def test_pareto_front() -> None:
    points = [(1.0, 0.0), (1.3, 40.0), (1.2, 10.0), (1.5, 35.0), (1.6, 60.0)]
    assert plot.pareto_front(points) == [(1.0, 0.0), (1.2, 10.0), (1.3, 40.0), (1.6, 60.0)]


def test_timeline_keeps_the_peak_and_marks_block_starts(tmp_path: Path) -> None:
    n = 10_000
    live = np.arange(n) % 1000 + 1
    live[6543] = 5_000  # the peak, at a position no stretch boundary hits
    series = {kind: live if kind == "activation" else 0 * live for kind in CATEGORIES}
    blocks = ["down.0"] * 3000 + ["(top)"] * 100 + ["down.0"] * 900 + ["mid"] * 2000 + ["up.0"] * 4000
    record = timeline(series, blocks, {"backward": 6000}, "test", points=100)
    assert len(record["x"]) <= 101 and max(record["series"]["activation"]) == 5_000
    assert record["marks"] == [(0, "down.0"), (4000, "mid"), (6000, "up.0")]
    # a phase start begins a new stretch even in the same block; short stretches are noise
    assert block_marks(["up.0"] * 500 + ["mid"] + ["up.0"] * 500, [501]) == [(0, "up.0"), (501, "up.0")]
    record = {"framework": "jax", "policy": "none", "batch_size": 1, **record}
    assert plot.plot_timelines([record], tmp_path / "t.png", "title") and (tmp_path / "t.png").stat().st_size > 0


def test_atomic_write_leaves_nothing_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails half-way (here: fsync) keeps the old file and leaves no temp file behind."""
    target = tmp_path / "rows.json"
    target.write_text("old")

    def broken(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(OSError, match="No space"):
        tables.write_json(target, {"rows": [1, 2, 3]})
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["rows.json"]
    monkeypatch.undo()
    tables.write_json(target, {"rows": [1, 2, 3]})
    assert json.loads(target.read_text()) == {"rows": [1, 2, 3]}


@pytest.mark.slow
def test_compare_measures_a_training_regime(tmp_path: Path) -> None:
    """The benchmark in the loops' regime (bf16 autocast, peft LoRA on a frozen base, an EMA copy):
    each row's step keeps less than the float32, fully trained one; the tracker agrees with
    PyTorch's own MemTracker (frozen weights and the EMA copy included); the document says the regime."""
    base = [
        "--framework",
        "torch",
        "--config",
        "tiny",
        "--batch-size",
        "2",
        "--policies",
        "full",
        "--steps",
        "1",
        "--timeline",
        "off",
        "--device",
        "cpu",
    ]
    peaks = {}
    for name, extra in {"fp32": [], "lora": ["--precision", "bf16-mixed", "--trainable", "lora:4", "--ema"]}.items():
        proc, doc = run_compare([*base, *extra], tmp_path / name)
        assert proc.returncode == 0, proc.stderr
        peaks[name] = {p: r["peak_bytes"] for p, r in rows_of(doc, "torch").items()}
        for row in doc["rows"]:
            assert abs(row["peak_bytes"] / row["memtracker_peak_bytes"] - 1) < 0.01, (name, row["policy"])
    assert doc["regime"] == {
        "precision": "bf16-mixed",
        "trainable": "lora:4",
        "optimizer": "adamw",
        "ema": True,
        "keep_grads": False,
    }
    assert "regime bf16-mixed, lora:4, adamw, EMA" in proc.stdout
    for policy in ("none", "full"):
        assert peaks["lora"][policy] < peaks["fp32"][policy]
