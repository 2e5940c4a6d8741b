"""Measure one framework's rows in this process: ``python -m benchmarks.worker JOB_JSON``.

Started by `benchmarks.runner`, one process per framework, with the environment already set
(``XLA_FLAGS`` must be in place before jax is imported). Talks to the parent through event
lines on stdout (see `benchmarks.common.emit`): ``env`` once, then ``start`` and ``row`` per
row. A row that fails is reported (``oom`` or ``error``) and the next row runs.

Testing hooks (environment): ``BENCHMARKS_SIMULATE_OOM=framework:policy:batch,...`` raises the
framework's own out-of-memory error at that row; ``BENCHMARKS_SIMULATE_KILL`` (same syntax)
SIGKILLs this process there, as the kernel's OOM killer would.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import traceback
from typing import Any

from benchmarks.common import KILL_SIM_ENV, OOM_SIM_ENV, Job, emit, is_oom_message, one_line, parse_sim


def run_row(backend: Any, job: Job, policy: str, batch_size: int, device: Any) -> dict[str, Any]:
    """Measure one row; failures become a row with ``status`` ``oom`` or ``error``."""
    key = (job.framework, policy, batch_size)
    try:
        if key in parse_sim(os.environ.get(KILL_SIM_ENV)):
            os.kill(os.getpid(), signal.SIGKILL)
        if key in parse_sim(os.environ.get(OOM_SIM_ENV)):
            raise backend.simulated_oom()
        row = backend.measure(job, policy, batch_size, device)
        row["status"] = "ok"
    except Exception as err:  # a row's failure must not end the run
        oom = isinstance(err, backend.oom_types()) or is_oom_message(str(err))
        if not oom:
            traceback.print_exc(file=sys.stderr)
        row = {"status": "oom" if oom else "error", "error": one_line(err)}
        del err
    finally:
        backend.release(device)
    return {"framework": job.framework, "policy": policy, "batch_size": batch_size, **row}


def main(argv: list[str]) -> int:
    job = Job.from_json(argv[0])
    backend = importlib.import_module(f"benchmarks.{job.framework}_bench")
    try:
        device = backend.resolve_device(job.device)
    except RuntimeError as err:
        emit("fatal", message=str(err))
        return 3
    emit(
        "env",
        framework=job.framework,
        versions=backend.versions(),
        device=backend.device_info(device),
        xla_flags=os.environ.get("XLA_FLAGS", "") if job.framework == "jax" else None,
    )
    for policy, batch_size in job.rows():
        emit("start", policy=policy, batch_size=batch_size)
        emit("row", **run_row(backend, job, policy, batch_size, device))
        if getattr(backend, "one_row_per_process", lambda d: False)(device):
            break  # the parent starts a fresh process for the next row
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
