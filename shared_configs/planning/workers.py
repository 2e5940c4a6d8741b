"""The planner's worker processes: ``python -m benchmarks.plan_worker`` runs a profile, a peak check
or a measurement in one framework, in an environment set before that framework is imported.
No torch or jax import here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from shared_configs.cli import BenchmarkError
from shared_configs.processes import worker_group

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKER = "benchmarks.plan_worker"  # the profiling / measuring process (it imports one framework)
# XLA:CPU drops remat's optimization barriers unless this pass is off (docs/remat_vs_checkpoint.md).
XLA_CPU_FLAG = "--xla_disable_hlo_passes=cse_barrier_expander"
XLA_CPU_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}  # the same, as jit's compiler_options


# XLA:CPU single-threaded, as torch in the worker: CPU seconds then add up to the step's work.
XLA_SINGLE_THREAD = ("--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1")


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
    """Run ``request`` in the `WORKER` process (one framework per process)."""
    with tempfile.TemporaryDirectory(prefix="plan-worker-") as folder:
        out = Path(folder) / "result.json"
        cmd = [sys.executable, "-m", WORKER, json.dumps(request), str(out)]
        env = worker_env(request["framework"])
        with worker_group(cmd, cwd=REPO_ROOT, env=env, stderr=subprocess.PIPE, text=True) as proc:
            stderr = proc.communicate()[1]
        if proc.returncode != 0 or not out.is_file():
            lines = [ln for ln in stderr.splitlines() if ln.strip()]
            why = lines[-1] if lines else f"exit {proc.returncode}"
            raise BenchmarkError(f"{request['framework']} planner worker failed: {why}")
        return json.loads(out.read_text())
