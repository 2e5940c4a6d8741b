"""The planner's worker processes: a profile, a peak check or a measurement, in one framework.

The parent (`run_worker`, no torch or jax import here) starts ``python -m torch_impl.profile`` or
``python -m jax_impl.profile`` in an environment set before that framework is imported (XLA's
flags); the worker hands the request to `serve` with its own module as the backend, and `serve`
writes the JSON result. One framework per process: two runtimes in one process skew each other's
memory and time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from shared_configs.cli import BenchmarkError
from shared_configs.files import atomic_write
from shared_configs.pair import workload_spec
from shared_configs.processes import worker_group
from shared_configs.progress import Relay, worker_logging
from shared_configs.regime import Regime

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKERS = {"torch": "torch_impl.profile", "jax": "jax_impl.profile"}  # the measuring half, per framework
# XLA:CPU drops remat's optimization barriers unless this pass is off (docs/remat_vs_checkpoint.md).
XLA_CPU_FLAG = "--xla_disable_hlo_passes=cse_barrier_expander"
XLA_CPU_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}  # the same, as jit's compiler_options


# XLA:CPU single-threaded, as torch in the worker: CPU seconds then add up to the step's work.
XLA_SINGLE_THREAD = ("--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1")


class Backend(Protocol):
    """What `torch_impl.profile` and `jax_impl.profile` provide (the planner's measuring half)."""

    def profile(self, spec: Any, batch_size: int, context_length: int, shapes: bool, repeats: int,
                **extra: Any) -> dict: ...  # fmt: skip
    def peaks(self, spec: Any, batch_size: int, policies: list[str], context_length: int, **extra: Any) -> dict: ...
    def measure(self, spec: Any, batch_size: int, policies: list[str], context_length: int, steps: int,
                **extra: Any) -> dict: ...  # fmt: skip


def worker_env(framework: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if framework == "jax":  # the barrier option is also passed to each compile; set here for any other
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        env.setdefault("JAX_PLATFORMS", "cpu")
        ours = (XLA_CPU_FLAG, *XLA_SINGLE_THREAD)
        flags = [f for f in env.get("XLA_FLAGS", "").split() if f not in ours]
        env["XLA_FLAGS"] = " ".join([*flags, *ours])
    return env


def run_worker(request: dict[str, Any]) -> dict[str, Any]:
    """Run ``request`` in its framework's worker process (`WORKERS`); its JSON result."""
    with tempfile.TemporaryDirectory(prefix="plan-worker-") as folder:
        out = Path(folder) / "result.json"
        cmd = [sys.executable, "-m", WORKERS[request["framework"]], json.dumps(request), str(out)]
        env = worker_env(request["framework"])
        relay = Relay(f"{request['framework']} {request['kind']}")  # its progress lines, logged here
        with worker_group(cmd, cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True) as proc:
            for line in proc.stderr:  # type: ignore[union-attr]
                relay.feed(line)
            proc.wait()
        relay.close()
        stderr = relay.text
        if proc.returncode != 0 or not out.is_file():
            lines = [ln for ln in stderr.splitlines() if ln.strip()]
            why = lines[-1] if lines else f"exit {proc.returncode}"
            raise BenchmarkError(f"{request['framework']} planner worker failed: {why}")
        return json.loads(out.read_text())


def answer(backend: Backend, request: dict[str, Any]) -> dict[str, Any]:
    """The worker's side: ``request`` (`planner.Workload.request`) answered by ``backend``."""
    if request["kind"] == "encoders":  # the models beside the U-Net (shared_configs.planning.whole)
        return backend.encoders(request)  # type: ignore[attr-defined]
    spec = workload_spec(request["spec"])  # a U-Net's, or the ControlNet step's pair
    extra: dict[str, Any] = {"regime": Regime(**request["regime"])}
    if request["framework"] == "jax":  # torch's attention is not chunked
        extra["attention_chunk"] = request["attention_chunk"]
    size, context = request["batch_size"], request["context_length"]
    if request["kind"] == "profile":
        return backend.profile(spec, size, context, request["shapes"], request["repeats"], **extra)
    if request["kind"] == "peaks":  # nothing allocated: JAX compiled, torch on fake tensors
        return backend.peaks(spec, size, request["policies"], context, **extra)
    if request.get("race_to"):  # stepclock.race among the policies that fit
        extra["race_to"] = request["race_to"]
    out = backend.measure(spec, size, request["policies"], context, request["steps"], **extra)
    if request.get("ratios"):  # torch.compile's activation_memory_budget, in the same process (same `none`)
        compiled = backend.measure_compiled(spec, size, request["ratios"], context, request["steps"])  # type: ignore[attr-defined]
        out["rows"] |= compiled["rows"]
        out["compiled_method"] = compiled["method"]
    return out


def serve(backend: Backend, argv: list[str]) -> int:
    """``python -m {torch,jax}_impl.profile REQUEST_JSON OUT_PATH``: answer, write the JSON atomically."""
    worker_logging()  # progress as lines on stderr, for run_worker's Relay
    result = answer(backend, json.loads(argv[0]))
    plain = json.loads(json.dumps(result, default=asdict))  # the profile's `Cost` dataclasses as dicts
    atomic_write(Path(argv[1]), json.dumps(plain, indent=2, allow_nan=False).encode())
    return 0
