"""The one worker protocol, both frameworks: the planner's profile, peaks and measure, the benchmark's rows.

A worker runs ``python -m shared_configs.planning.workers`` in `worker_env` (XLA's flags), one framework
per process (two runtimes in one skew each other's memory and time), and answers by event lines on
stdout (`emit`): with ``--serve``, a ``result`` per planner request read from stdin (`run_worker`;
`kept_alive`: a plan's profile and check share one); with REQUEST_JSON, the events of the request's
own ``backend`` module (the benchmark's rows, docs/benchmark.md; `run`). Progress goes to stderr. A worker
never outlives its parent: each runs in a process group of its own (`worker_group`), stopped as a group (a
worker, or torchrun and its ranks) when the parent leaves by an exception (an interrupt, an error)."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from shared_configs.cli import BenchmarkError
from shared_configs.pair import workload_spec
from shared_configs.progress import MARK, Relay, worker_logging
from shared_configs.regime import Regime

REPO_ROOT = Path(__file__).resolve().parents[2]
BACKENDS = {"torch": "torch_impl.profile", "jax": "jax_impl.profile"}  # the planner's measuring half
ENCODERS = "torch_impl.encoders"  # the models beside the U-Net, from shapes (torch only)
KEPT_KINDS = ("profile", "peaks")  # what a kept worker answers (a measurement gets a fresh process)
SERVE = "--serve"  # the worker's argument: answer requests read from stdin, one JSON line each
EVENT_PREFIX = "@@bench "  # worker stdout lines carrying an event start with this
# XLA:CPU drops remat's optimization barriers unless this pass is off (docs/remat_vs_checkpoint.md).
XLA_CPU_FLAG = "--xla_disable_hlo_passes=cse_barrier_expander"
XLA_CPU_OPTIONS = {"xla_disable_hlo_passes": "cse_barrier_expander"}  # the same, as jit's compiler_options
# XLA:CPU single-threaded, as torch in the worker: CPU seconds then add up to the step's work.
XLA_SINGLE_THREAD = ("--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1")

Event = dict[str, Any]


def worker_env(framework: str) -> dict[str, str]:
    """The planner's workers' environment: JAX on the CPU, its remat barriers kept, single-threaded."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if framework == "jax":  # the barrier option is also passed to each compile; set here for any other
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        env.setdefault("JAX_PLATFORMS", "cpu")
        ours = (XLA_CPU_FLAG, *XLA_SINGLE_THREAD)
        env["XLA_FLAGS"] = " ".join([*(f for f in env.get("XLA_FLAGS", "").split() if f not in ours), *ours])
    return env


# -- the parent's side ---------------------------------------------------------------------------


@contextlib.contextmanager
def worker_group(cmd: list[str], **popen: Any) -> Iterator[subprocess.Popen]:
    """``Popen(cmd, **popen)`` in a process group of its own, stopped whole if the block is left by an exception."""
    proc = subprocess.Popen(cmd, start_new_session=True, **popen)
    try:
        yield proc
    except BaseException:
        stop_group(proc)
        raise
    finally:
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
        proc.wait()


STOP_GRACE_S = 5.0


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s process group; SIGKILL to what is left once ``proc`` exits or `STOP_GRACE_S` pass."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(STOP_GRACE_S)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@dataclass
class Finished:
    """A worker that has exited: its events, its exit code, the last line of its stderr."""

    events: list[Event]
    returncode: int
    stderr_tail: str


def run(
    request: dict[str, Any],
    env: dict[str, str],
    on_event: Callable[[Event], None] = lambda e: None,
    launcher: list[str] | None = None,
    on_stderr: Callable[[str], None] = lambda line: None,
) -> Finished:
    """Start a worker for ``request`` (under ``launcher``: torchrun's arguments), calling ``on_event``
    as each event arrives and ``on_stderr`` with each line of its stderr."""
    cmd = [sys.executable, *(launcher or []), "-m", __name__, json.dumps(request)]
    events: list[Event] = []
    with worker_group(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        reader, said = _read_stderr(proc.stderr, on_stderr)
        for event in _events(proc.stdout or ()):
            events.append(event)
            on_event(event)
        reader.join()  # to the worker's exit (`worker_group` waits for it)
    return Finished(events, proc.returncode, said[-1] if said else "")


def run_worker(request: dict[str, Any]) -> dict[str, Any]:
    """The planner's request (`pipeline.Workload.request`) answered in its framework's worker: the
    kept one inside `kept_alive`, else a worker of its own."""
    framework = request["framework"]
    if _kept is not None and request["kind"] in KEPT_KINDS:
        if framework not in _kept:
            _kept[framework] = _Kept(framework)
        return _kept[framework].ask(request)
    with _Kept(framework) as worker:
        return worker.ask(request)


_kept: dict[str, _Kept] | None = None  # framework -> its worker, while `kept_alive` is open


@contextlib.contextmanager
def kept_alive() -> Iterator[None]:
    """In the block, each framework's profile and peaks requests go to one worker, started by the
    first and kept to the block's end: the check reuses the profile's imports and set-up."""
    global _kept
    if _kept is not None:  # an outer block keeps them
        yield
        return
    with contextlib.ExitStack() as stack:  # closes each worker (stops it, on an exception)
        _kept = {}
        try:
            yield
        finally:
            kept, _kept = _kept, None
            for worker in kept.values():
                stack.push(worker)


def _events(lines: Iterable[str]) -> Iterator[Event]:
    return (json.loads(line[len(EVENT_PREFIX) :]) for line in lines if line.startswith(EVENT_PREFIX))


def _read_stderr(stream: Any, on_line: Callable[[str], None]) -> tuple[threading.Thread, deque[str]]:
    """A started thread passing each line of a worker's stderr to ``on_line``, and the worker's last 20 lines
    (progress left out), kept as they come."""
    said: deque[str] = deque(maxlen=20)

    def read() -> None:
        for line in stream or ():
            on_line(line)
            if line.strip() and not line.startswith(MARK):
                said.append(line.strip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader, said


class _Kept(contextlib.AbstractContextManager):
    """A ``--serve`` worker: one request at a time, its progress relayed for the request under way;
    as a context, closed at the end (stopped, on an exception)."""

    def __init__(self, framework: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, SERVE],
            cwd=REPO_ROOT,
            env=worker_env(framework),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.relay: Relay | None = None
        self.reader, self.said = _read_stderr(self.proc.stderr, self._relay)

    def _relay(self, line: str) -> None:
        if self.relay is not None:
            self.relay.feed(line)

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        self.relay = Relay(f"{request['framework']} {request['kind']}")  # its progress lines, logged here
        result = None
        if self.proc.poll() is None:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            print(json.dumps(request), file=self.proc.stdin, flush=True)
            result = next((event for event in _events(self.proc.stdout) if event.get("event") == "result"), None)
        if result is None:  # it exited: its error is on stderr
            self.proc.wait()
            self.reader.join()
        self.relay.close()
        self.relay = None
        if result is None:
            why = self.said[-1] if self.said else f"exit {self.proc.returncode}"
            raise BenchmarkError(f"{request['framework']} planner worker failed: {why}")
        return {k: v for k, v in result.items() if k != "event"}

    def close(self) -> None:
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self.proc.wait()
        self.reader.join()

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            stop_group(self.proc)
        self.close()


# -- the worker's side ---------------------------------------------------------------------------


def emit(event: str, **payload: Any) -> None:
    """Write one event line for the parent (workers only; under torchrun, rank 0 only)."""
    if os.environ.get("RANK", "0") != "0":
        return
    sys.stdout.write(EVENT_PREFIX + json.dumps({"event": event, **payload}, default=_json_default) + "\n")
    sys.stdout.flush()


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy and torch scalars
        return value.item()
    if hasattr(value, "__dataclass_fields__"):  # the profile's `Cost`s
        return asdict(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def answer(backend: Any, request: dict[str, Any]) -> dict[str, Any]:
    """The planner's ``request`` answered by ``backend``, a module of `BACKENDS`: its ``profile(spec, batch_size,
    context_length, shapes, repeats, **extra)``, ``peaks(spec, batch_size, policies, context_length, **extra)`` or
    ``measure(spec, batch_size, policies, context_length, steps, **extra)`` (and ``measure_compiled``, torch's)."""
    if request["kind"] == "encoders":  # the models beside the U-Net (shared_configs.planning.whole)
        return importlib.import_module(ENCODERS).encoders(request)
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
        compiled = backend.measure_compiled(spec, size, request["ratios"], context, request["steps"])
        out["rows"] |= compiled["rows"]
        out["compiled_method"] = compiled["method"]
    return out


def main(argv: list[str]) -> int:
    worker_logging()  # progress as lines on stderr, for the parent's Relay
    if argv[0] != SERVE:  # the benchmark's rows: a request naming its own backend
        request = json.loads(argv[0])
        return importlib.import_module(request["backend"]).serve(request)
    backend: Any = None  # a module of BACKENDS (also its `start_worker(request)`, once)
    for line in sys.stdin:  # the planner's requests, one framework's, until stdin closes
        request = json.loads(line)
        if backend is None:
            backend = importlib.import_module(BACKENDS[request["framework"]])
            backend.start_worker(request)
        emit("result", **answer(backend, request))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
