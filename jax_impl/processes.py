"""One training run over several JAX processes: joining them, agreeing between them, leaving.

`join` starts `jax.distributed` from the flags or a cluster JAX detects; `ProcessComm` gives the run
folder's collectives as small all-gathers; `lost_processes` turns a collective failed by a dead process
into one line. No torch mirror: torchrun does this. docs/training.md "JAX over several processes".
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from jax_impl.compat import backends_started, cluster_types, coordination_client
from shared_configs.cli import nonnegative, positive
from shared_configs.training.run_folder import SOLO, Comm

CPU_COLLECTIVES = "gloo"  # jax_cpu_collectives_implementation: gloo over TCP (the other choice, mpi, needs MPI)
HEARTBEAT_S = 30  # a process silent this long is taken for dead (JAX's default, 100 s, holds a failed run longer)
JOIN_TIMEOUT_S = 300  # how long process 0 waits for the others to start (JAX's default)
LEAVE_WAIT_S = 5.0  # how long process 0, which hosts the coordination service, waits for the others to go
LEAVING = "unet-remat/leaving/"  # the key-value store's folder where each other process says it leaves


def coordinator_address(text: str) -> str:
    """An argparse ``type``: ``HOST:PORT`` with a port in 1..65535."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (a port in 1..65535), got {text!r}")
    return text


def add_flags(parser: argparse.ArgumentParser) -> None:
    """``--coordinator``, ``--num-processes``, ``--process-id`` (`check_flags` says what goes together)."""
    parser.add_argument(
        "--coordinator",
        type=coordinator_address,
        default=None,
        metavar="HOST:PORT",
        help="jax.distributed: process 0's address and a free port there, the same for every "
        "process, given with the next two flags (none of the three: what jax.distributed "
        "detects, e.g. SLURM, else one process)",
    )
    parser.add_argument(
        "--num-processes",
        type=positive(int),
        default=None,
        metavar="N",
        help="jax.distributed: how many processes the run has",
    )
    parser.add_argument(
        "--process-id",
        type=nonnegative(int),
        default=None,
        metavar="I",
        help="jax.distributed: this process's number, 0 .. N-1 (process 0 writes logs)",
    )


def check_flags(
    coordinator: str | None, num_processes: int | None, process_id: int | None, distributed: str | None
) -> None:
    """Refuse a partial set of the three flags, a bad process id, or several processes without ``--distributed``."""
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    missing = [flag for flag, value in given.items() if value is None]
    if missing and len(missing) < len(given):
        raise ValueError(
            f"{', '.join(missing)}: needed with {', '.join(f for f in given if f not in missing)} "
            "(give all three, or none to let jax.distributed detect the cluster)"
        )
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise ValueError(
            f"--process-id {process_id}: expected 0 .. {num_processes - 1} (--num-processes {num_processes})"
        )
    if (num_processes or 1) > 1:
        check_distributed(num_processes, distributed)  # type: ignore[arg-type]


def check_distributed(processes: int, distributed: str | None) -> None:
    if distributed is None:
        raise ValueError(f"--distributed: needed over {processes} processes (ddp or fsdp)")


_joined = False  # jax.distributed started here: JAX's process index and count are this process's place in the run
_lost = False  # a collective failed for want of another process: nobody to wait for when leaving


def join(coordinator: str | None, num_processes: int | None, process_id: int | None) -> int:
    """Join the run's processes (before any JAX computation), once per interpreter: how many the run has (1:
    no flags, and no cluster detected or JAX already running). Process 0 prints which it used."""
    global _joined
    if _joined:
        return jax.process_count()
    via = f"--coordinator {coordinator}" if coordinator else detected_cluster()  # or e.g. "SlurmCluster"
    if via is None or (coordinator is None and backends_started()):  # a caller whose JAX runs already: as it is
        return 1
    jax.config.update("jax_cpu_collectives_implementation", CPU_COLLECTIVES)
    try:
        jax.distributed.initialize(
            coordinator,
            num_processes,
            process_id,
            heartbeat_timeout_seconds=HEARTBEAT_S,
            initialization_timeout=JOIN_TIMEOUT_S,
        )
    except (RuntimeError, ValueError) as err:  # JaxRuntimeError is a RuntimeError
        raise ConnectionError(f"jax.distributed via {via}: {_first_line(err)}") from None
    _joined = True
    if jax.process_index() == 0:
        devices = jax.devices()
        print(
            f"jax.distributed: {jax.process_count()} processes via {via}, {len(devices)} {devices[0].platform} "
            f"devices in all ({jax.local_device_count()} here); CPU collectives: {CPU_COLLECTIVES}",
            file=sys.stderr,
            flush=True,
        )
    return jax.process_count()


def detected_cluster() -> str | None:
    """The cluster class `jax.distributed.initialize()` would detect (e.g. "SlurmCluster"), or None."""
    found = next((k for k in cluster_types() if not k.opt_in_only_method and k.is_env_present()), None)
    return None if found is None else found.__name__


def process_rank() -> int:
    """This process's number (0 before or without `join`): who prints the CLI's shared lines."""
    return jax.process_index() if _joined else 0


@dataclass(frozen=True)
class ProcessComm:
    """`shared_configs.training.run_folder.Comm` over JAX's processes: tiny all-gathers, compiled once per shape."""

    rank: int
    world: int

    def max(self, value: int) -> int:
        return int(np.max(multihost_utils.process_allgather(np.int32(value))))

    def gather(self, obj: Any) -> list[Any]:
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        sizes = multihost_utils.process_allgather(np.int32(data.size))
        width = 1 << int(max(sizes) - 1).bit_length()  # powers of two: a few shapes, a few compiles
        rows = multihost_utils.process_allgather(np.pad(data, (0, width - data.size)))
        return [pickle.loads(row[:n].tobytes()) for row, n in zip(rows, sizes, strict=True)]


def current_comm() -> Comm:
    """The joined processes, or `SOLO` for one."""
    return SOLO if jax.process_count() == 1 else ProcessComm(jax.process_index(), jax.process_count())


class ProcessLost(ConnectionError):
    """A collective failed because another process of the run is gone (killed, crashed, or failed)."""


_GLOO_FAILURE = re.compile(r"Gloo [\w-]+ failed")


@contextmanager
def lost_processes() -> Iterator[None]:
    """Turn a collective that failed for want of another process into one line (`ProcessLost`)."""
    try:
        yield
    except (RuntimeError, ValueError) as err:  # XLA raises gloo's failures as either
        if not _joined or not _GLOO_FAILURE.search(str(err)):
            raise
        global _lost
        _lost = True
        cause = _first_line(err).rsplit("] ", 1)[-1]  # gloo's reason, without its source location
        raise ProcessLost(
            f"another process of the run is gone (a collective failed: {cause}); its own output says why"
        ) from None


def leave(code: int) -> int:
    """End this process's part in the run with exit status ``code``: 0 through JAX's shutdown barrier;
    otherwise a process may be gone and the barrier would wait for the heartbeat, so `os._exit`,
    process 0 last (the others need its coordination service to exit cleanly)."""
    if not _joined:
        return code
    if code == 0:
        jax.distributed.shutdown()
        return code
    if not _lost:
        _wait_for_the_others()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _wait_for_the_others() -> None:
    """Process 0: wait (at most `LEAVE_WAIT_S`) until every other process has said it leaves."""
    client = coordination_client()  # JAX has no public handle on the coordination service's key-value store
    try:
        if jax.process_index() != 0:
            client.key_value_set(f"{LEAVING}{jax.process_index()}", "1")
            return
        deadline = time.monotonic() + LEAVE_WAIT_S
        while time.monotonic() < deadline and len(client.key_value_dir_get(LEAVING)) < jax.process_count() - 1:
            time.sleep(0.05)
    except Exception:  # the service is gone (process 0 died): nothing to wait for
        return


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
