"""The benchmark: output schema, OOM handling, the CPU memory tracker's accuracy, remat really saving.

End-to-end runs use the tiny preset at batch 1 with one timed step. The jax worker compiles with
LLVM at -O0 here (``--xla_backend_optimization_level=0``): it halves XLA:CPU compile times and
changes no memory figure, since buffer assignment happens before code generation.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import yaml

from benchmarks import plot, report
from benchmarks.common import KILL_SIM_ENV, OOM_SIM_ENV, REPO_ROOT, Job, cpu_snapshot, other_cpu_share
from benchmarks.compare import build_parser
from benchmarks.torch_memory import AllocatorPeak, LiveBytesTracker, SavedBytesCounter
from benchmarks.worker import run_row
from tests.utils import TINY

ROW_KEYS = {
    "framework",
    "policy",
    "batch_size",
    "peak_bytes",
    "static_bytes",
    "activation_bytes",
    "saved_bytes",
    "step_time_s",
    "flops",
}
FAST = ["--config", "tiny", "--batch-size", "1", "--steps", "1", "--device", "cpu"]


def _compare(args: list[str], out: Path, **env: str) -> tuple[subprocess.CompletedProcess, dict[str, Any] | None]:
    environ = {**os.environ, "XLA_FLAGS": "--xla_backend_optimization_level=0", **env}
    cmd = [sys.executable, "-m", "benchmarks.compare", *args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=environ, capture_output=True, text=True, timeout=300)
    files = sorted(out.glob("*.json"))
    return proc, json.loads(files[-1].read_text()) if files else None


def _rows(doc: dict[str, Any], framework: str) -> dict[str, dict[str, Any]]:
    return {r["policy"]: r for r in doc["rows"] if r["framework"] == framework}


def test_both_frameworks_schema_and_full_lowers_the_peak(tmp_path: Path) -> None:
    """One run of both frameworks (one test, so that pytest-xdist compiles the jax step once)."""
    proc, doc = _compare(["--framework", "both", "--policies", "full", *FAST], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert doc is not None
    _check_schema(proc, doc, tmp_path)
    for framework in ("torch", "jax"):
        rows = _rows(doc, framework)
        assert rows["full"]["peak_bytes"] < rows["none"]["peak_bytes"], framework
        assert rows["full"]["saved_bytes"] < rows["none"]["saved_bytes"], framework
        assert rows["full"]["static_bytes"] == rows["none"]["static_bytes"], framework
        assert rows["full"]["recompute_flops"] > 0, framework  # the recomputation is paid for
        assert rows["full"]["peak_reduction"] > 0 and rows["full"]["time_overhead"] > 0


def _check_schema(proc: subprocess.CompletedProcess, doc: dict[str, Any], out: Path) -> None:
    assert {"config", "device", "rows", "versions", "git_sha", "dtype", "methods"} <= doc.keys()
    assert doc["config"]["name"] == "tiny" and doc["dtype"] == "float32"
    assert {"torch", "jax", "flax", "python"} <= doc["versions"].keys()
    assert doc["device"]["torch"]["kind"] == doc["device"]["jax"]["kind"] == "cpu"
    assert "cse_barrier_expander disabled" in doc["methods"]["jax"]["peak_method"]
    assert len(doc["rows"]) == 4  # none is always added, as the baseline
    for row in doc["rows"]:
        assert row.keys() == set(report.COLUMNS) and row.keys() >= ROW_KEYS
        assert row["status"] == "ok", row["error"]
        assert row["peak_bytes"] == row["static_bytes"] + row["input_bytes"] + row["activation_bytes"]
        assert row["flops"] > 0 and row["step_time_s"] > 0 and row["saved_bytes"] > 0
    with open(next(out.glob("*.csv")), newline="") as f:
        reader = csv.DictReader(f)
        assert tuple(reader.fieldnames or ()) == report.COLUMNS
        assert len(list(reader)) == 4
    assert len(list(out.glob("*.png"))) == 1
    assert not list(out.glob(".*.tmp")), "temporary files left behind"
    assert "OOM" not in proc.stdout
    assert "tiny @ 8x8, float32" in proc.stdout


def test_oom_is_a_row_and_the_run_goes_on(tmp_path: Path) -> None:
    """An OOM raised in the worker, and a worker killed mid-row (a fresh one takes over)."""
    sim = {OOM_SIM_ENV: "torch:full:1", KILL_SIM_ENV: "torch:balanced:1"}
    proc, doc = _compare(["--framework", "torch", "--policies", "full,balanced,layers", *FAST], tmp_path, **sim)
    assert proc.returncode == 0, proc.stderr
    assert doc is not None
    rows = _rows(doc, "torch")
    assert rows["full"]["status"] == "oom" and "out of memory" in rows["full"]["error"]
    assert rows["full"]["peak_bytes"] is None and rows["full"]["peak_reduction"] is None
    assert rows["balanced"]["status"] == "oom" and "SIGKILL" in rows["balanced"]["error"]
    assert rows["none"]["status"] == rows["layers"]["status"] == "ok"
    assert rows["layers"]["peak_reduction"] is not None  # measured by the second worker
    assert proc.stdout.count("OOM") == 2


def test_jax_oom_is_reported_without_compiling(tmp_path: Path) -> None:
    proc, doc = _compare(["--framework", "jax", "--policies", "none", *FAST], tmp_path, **{OOM_SIM_ENV: "jax:none:1"})
    assert proc.returncode == 0, proc.stderr
    assert _rows(doc, "jax")["none"]["status"] == "oom"
    assert "RESOURCE_EXHAUSTED" in _rows(doc, "jax")["none"]["error"]


class _FakeBackend:
    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def measure(self, *args: Any) -> dict[str, Any]:
        if self.error is not None:
            raise self.error
        return {"peak_bytes": 1}

    def oom_types(self) -> tuple[type[BaseException], ...]:
        return (MemoryError,)

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
    job = Job("torch", "tiny", None, ("none",), (1,), 1, "float32", "cpu", 4)
    row = run_row(_FakeBackend(error), job, "none", 1, None)
    assert row["status"] == status and row["framework"] == "torch" and row["batch_size"] == 1


def _linear_step(layers: int, batch: int, width: int) -> tuple[torch.nn.Module, Any, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters())
    x, target = torch.randn(batch, width), torch.randn(batch, width)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        F.mse_loss(model(x), target).backward()
        opt.step()

    step()  # gradients and optimizer state exist from here on
    static = [*model.parameters(), *(p.grad for p in model.parameters())]
    static += [v for s in opt.state.values() for v in s.values()]
    return model, step, [*static, x, target]


def test_cpu_tracker_matches_an_analytic_count_on_a_linear_stack() -> None:
    layers, batch, width = 32, 512, 256
    model, step, existing = _linear_step(layers, batch, width)
    unit, weight = batch * width * 4, width * width * 4
    with LiveBytesTracker(existing) as tracker:
        step()
    # The backward pass starts with every layer's output alive (the activations), the loss
    # gradient and the first input gradient in flight, and one weight gradient being formed.
    analytic = layers * unit + 2 * unit + weight
    measured = tracker.peak - tracker.baseline
    assert abs(measured - analytic) <= 0.05 * analytic, (measured, analytic)
    with AllocatorPeak() as allocator:
        step()
    assert abs(measured - allocator.peak) <= 0.05 * allocator.peak, (measured, allocator.peak)

    with SavedBytesCounter(exclude=list(model.parameters())) as saved:
        out = model(existing[-2])
    assert saved.bytes == layers * unit  # each linear layer saves its input
    del out


def test_cpu_tracker_against_the_allocator_on_the_unet() -> None:
    """The tracker sees tensors, not kernels' scratch space: never above the allocator's count,
    and within 5% of it where activations dominate (policy none)."""
    from benchmarks import torch_bench as tb
    from shared_configs import load_spec

    spec, device = load_spec("tiny"), torch.device("cpu")
    job = Job("torch", "tiny", None, ("none", "full"), (2,), steps=1, dtype="float32", device="cpu", context_length=4)
    for policy in job.policies:
        model, opt = tb.trainable(tb.build(job, spec, policy), torch.float32, device)
        batch = tb.make_batch(spec, 2, 4, torch.float32, device)
        step = tb.make_step(model, opt, batch)
        step()
        existing = [t for g in tb.static_tensors(model, opt).values() for t in g]
        existing += [v for v in batch.values() if v is not None]
        with AllocatorPeak() as allocator, LiveBytesTracker(existing) as tracker:
            step()
        measured = tracker.peak - tracker.baseline
        assert measured <= allocator.peak, (policy, measured, allocator.peak)
        if policy == "none":
            assert measured >= 0.95 * allocator.peak, (measured, allocator.peak)


def test_xla_cpu_strips_remat_barriers_unless_the_pass_is_disabled() -> None:
    """Why the jax worker sets the flag: without it XLA:CPU shows no saving from remat."""
    import jax
    import jax.numpy as jnp

    def loss(ws: list[jax.Array], x: jax.Array) -> jax.Array:
        layer = jax.checkpoint(lambda w, h: jnp.tanh(jnp.tanh(h @ w) @ w))
        for w in ws:
            x = layer(w, x)
        return jnp.sum(x**2)

    ws = [jnp.full((64, 64), 0.01) for _ in range(8)]
    lowered = jax.jit(jax.grad(loss)).lower(ws, jnp.ones((256, 64)))

    def temp(disabled: str) -> int:
        options = {"xla_disable_hlo_passes": disabled, "xla_backend_optimization_level": 0}
        return lowered.compile(compiler_options=options).memory_analysis().temp_size_in_bytes

    assert temp("cse_barrier_expander") < 0.8 * temp("")


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
    ],
)
def test_bad_input_is_one_line_and_no_traceback(tmp_path: Path, args: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", *args, "--out", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())


def test_jax_refuses_a_batch_norm_spec_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bn.yaml"
    path.write_text(yaml.safe_dump({**TINY, "norm_kind": "batch"}))
    proc, doc = _compare(["--config", str(path)], tmp_path / "out")
    assert proc.returncode == 2 and doc is None
    assert proc.stderr.strip().startswith("compare: error: norm_kind: 'batch' is not benchmarked in jax yet")


def test_missing_gpu_is_a_one_line_error(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc, doc = _compare(["--framework", "torch", "--device", "gpu", "--config", "tiny"], tmp_path)
    assert proc.returncode == 1 and doc is None
    assert proc.stderr.strip() == "compare: error: device: gpu requested but torch sees no CUDA device"


def test_help_documents_every_option() -> None:
    parser = build_parser()
    text = parser.format_help()
    for action in parser._actions:
        assert action.help, action.dest
        for flag in action.option_strings:
            assert flag in text


def test_reductions_and_ratios_are_against_none_of_the_same_framework_and_batch() -> None:
    def row(fw: str, policy: str, peak: int, time_s: float, batch: int = 2) -> dict[str, Any]:
        return {"framework": fw, "policy": policy, "batch_size": batch, "status": "ok", "peak_bytes": peak,
                "step_time_s": time_s, "flops": 10.0 * peak}  # fmt: skip

    rows = report.complete(
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
    negative = report.complete([{**row("jax", "none", 100, 1.0), "activation_bytes": 50}])
    negative += report.complete([{**row("jax", "layers", 90, 1.0), "activation_bytes": -5}])
    assert report.complete(negative)[1]["activation_reduction"] is None  # no share of a negative amount


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


def test_atomic_write_leaves_nothing_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "rows.json"
    target.write_text("old")

    def broken(f: Any) -> None:
        f.write("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        report.atomic_write(target, broken)
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["rows.json"]
