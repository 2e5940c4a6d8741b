"""The benchmark's rows in a worker of `shared_configs.planning.workers` (the one worker protocol).

`serve` answers a ``rows`` request (``env`` once, then ``start`` and ``row`` per row: a row that
fails is reported, ``oom`` or ``error``, and the next row runs) or a ``floor`` request, with one
framework's backend (`torch_bench`, `jax_bench`, `compiled_bench`, `diffusers_bench`), a module
providing ``resolve_device(requested)`` (auto / cpu / gpu; RuntimeError if there is none),
``prepare(job, device)`` (process-wide set-up before the first row), ``device_info(device)``,
``one_row_per_process(device)`` (a peak counter that cannot be reset),
``measure(job, policy, batch_size, device)``, ``release(device)`` (free what a row left behind), and
``VERSIONS``, ``OOM_TYPES`` and ``simulated_oom()`` (a fresh error of the framework's own out-of-memory kind). Testing
hooks (environment): ``BENCHMARKS_SIMULATE_OOM=framework:policy:batch,...`` raises the framework's
own out-of-memory error at that row; ``BENCHMARKS_SIMULATE_KILL`` (same syntax) SIGKILLs the
worker there, as the kernel's OOM killer would.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import traceback
from types import SimpleNamespace
from typing import Any

from benchmarks.harness.job import JOBS, KILL_SIM_ENV, OOM_SIM_ENV, Job, is_oom_message, one_line, parse_sim
from shared_configs.planning.workers import emit


def load_backend(framework: str) -> Any:
    """``<framework>_bench``; a variant (its ``BASE`` set) takes from that backend what it does not define."""
    module = importlib.import_module(f"benchmarks.backends.{framework}_bench")
    base = getattr(module, "BASE", None)
    return module if base is None else SimpleNamespace(**(vars(base) | vars(module)))


def run_row(backend: Any, job: Job, policy: str, batch_size: int, device: Any) -> dict[str, Any]:
    """Measure one row; failures become a row with ``status`` ``oom`` or ``error``."""
    key = (job.framework, policy, batch_size)
    try:
        if key in parse_sim(os.environ.get(KILL_SIM_ENV)):
            os.kill(os.getpid(), signal.SIGKILL)
        if key in parse_sim(os.environ.get(OOM_SIM_ENV)):
            raise backend.simulated_oom()
        row = {**backend.measure(job, policy, batch_size, device), "status": "ok"}
    except Exception as err:  # a row's failure must not end the run
        oom = isinstance(err, backend.OOM_TYPES) or is_oom_message(str(err))
        if not oom:
            traceback.print_exc(file=sys.stderr)
        # leaving this clause drops err and the frames holding the row's tensors, before release() frees them
        row = {"status": "oom" if oom else "error", "error": one_line(err)}
    finally:
        backend.release(device)
    return {"framework": job.framework, "policy": policy, "batch_size": batch_size, **row}


def serve(request: dict[str, Any]) -> int:
    """A worker's answer to ``request`` (``kind`` rows or floor, ``job`` a `Job` as a dict), as events."""
    job = JOBS.validate_python(request["job"])
    if request["kind"] == "floor":  # benchmarks.max_batch: the least any step can need, from shapes
        from benchmarks.backends.torch_bench import static_floor

        emit("floor", **static_floor(job))
        return 0
    backend = load_backend(job.framework)
    try:
        device = backend.resolve_device(job.device)
    except RuntimeError as err:
        emit("fatal", message=str(err))
        return 3
    try:
        backend.prepare(job, device)
    except Exception as err:  # e.g. a diffusers folder whose weights do not fit its config: no row can run
        emit("fatal", message=one_line(err))
        return 3
    emit(
        "env",
        framework=job.framework,
        versions=backend.VERSIONS,
        device=backend.device_info(device),
        xla_flags=os.environ.get("XLA_FLAGS", "") if job.framework == "jax" else None,
    )
    for policy, batch_size in job.rows():
        emit("start", policy=policy, batch_size=batch_size)
        emit("row", **run_row(backend, job, policy, batch_size, device))
        if backend.one_row_per_process(device):
            break  # the parent starts a fresh process for the next row
    return 0
