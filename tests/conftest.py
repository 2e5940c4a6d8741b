"""Set-up for the whole test run: fast XLA compiles and one torch thread per test process.

The tests check values, not speed. XLA:CPU spends seconds optimising each gradient program, so
every compile of the test run (and in the subprocesses tests start, which inherit the environment)
runs with backend optimisation off and in one LLVM module (`FAST_COMPILE`): the same HLO, the same
buffer assignment and memory analysis, several times faster to compile (Flax's own example tests set
``jax_disable_most_optimizations`` the same way). This must happen before jax is first imported,
hence at conftest import time. A test that needs the optimised compile passes its own ``compiler_options``.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator

import pytest

from tests.helpers.specs import fast_xla_flags


def _fast_xla_environment() -> None:
    os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")  # level 0, cheap LLVM passes
    flags = os.environ.get("XLA_FLAGS", "").split()
    for flag in fast_xla_flags().split():  # a flag already given wins
        if not any(f.startswith(flag.split("=")[0] + "=") for f in flags):
            flags.append(flag)
    os.environ["XLA_FLAGS"] = " ".join(flags)


_fast_xla_environment()
# No persistent compilation cache (the training CLI's and the planner's measuring worker's default,
# shared_configs.defaults): a cache hit compiles nothing, so an XLA dump a later test reads would be
# missing, and the tests would write to the user's cache.
os.environ.setdefault("UNET_REMAT_JAX_CACHE", "none")
# The planner's profiles go to one folder of this test run (its workers inherit it, as on a fresh machine),
# not the user's cache: a profile left by an earlier run would hide a test's cost and its cold path.
if "UNET_REMAT_PLAN_CACHE" not in os.environ:
    os.environ["UNET_REMAT_PLAN_CACHE"] = tempfile.mkdtemp(prefix="unet-remat-plan-")
    atexit.register(shutil.rmtree, os.environ["UNET_REMAT_PLAN_CACHE"], ignore_errors=True)


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """pytest -n 2 on a 2-core box: two test processes, so one intra-op thread each (more only contend)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _logging_off() -> Iterator[None]:
    """Each test starts with the library's logging off, whatever an earlier test in this process left on
    (a CLI run in-process, a worker's set-up, a library that lowered the root level): pytest's capture
    handler sits on the root logger, so a root level of INFO alone would send `say`'s lines to logging."""
    from shared_configs import progress

    logger, root = progress.LOGGER, logging.getLogger()
    state, root_level = (list(logger.handlers), logger.level, logger.propagate), root.level
    logger.handlers[:], logger.level, logger.propagate = [], logging.NOTSET, True
    root.setLevel(logging.WARNING)
    yield
    logger.handlers[:], logger.level, logger.propagate = state
    root.setLevel(root_level)


@pytest.fixture(autouse=True)
def _no_dispatch_mode_left() -> Iterator[None]:
    """Each test ends with no torch dispatch mode active: a guard's watch of the script between its first two
    calls (`torch_impl.guard_model.HeldWatch`) ends with the guard, and a mode left behind would slow every later
    op of the process and break its torch.compile calls."""
    yield
    if "torch_impl" not in sys.modules:
        return
    from torch_impl.compat import innermost_mode

    if innermost_mode() is not None:
        gc.collect()  # a guard dropped by the test, its finalizer not run yet
    assert innermost_mode() is None, f"a dispatch mode is still active after the test: {innermost_mode()!r}"


# The inner loop (`pytest -m "not slow" -n 2`) leaves out the tests marked `slow` in their files:
# those that start subprocesses (torchrun, the CLIs, forced multi-device JAX) and those that took
# about 2 s or more each on a 2-core box (XLA compiles of whole gradient programs, mostly). A
# parametrized test whose cases differ marks the slow ones by id, ``@pytest.mark.slow_for("sd", ...)``;
# an id that names no case of its test fails the collection, so a rename cannot drop a mark.
# `heavy` marks the longest checks (minutes each on 2 cores) whose ground a cheaper test in the
# default run also covers: `python -m pytest -n 2` leaves them out (pyproject's addopts), and
# `python -m pytest -n 2 -m heavy` runs them.


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    declared: dict[tuple[str, str], set[str]] = {}
    seen: dict[tuple[str, str], set[str]] = {}
    for item in items:
        if item.get_closest_marker("heavy"):  # the inner loop leaves them out too
            item.add_marker(pytest.mark.slow)
        mark = item.get_closest_marker("slow_for")
        if mark is None:
            continue
        key = (str(item.path), getattr(item, "originalname", item.name))
        case = item.callspec.id if hasattr(item, "callspec") else ""
        declared[key] = set(mark.args)
        seen.setdefault(key, set()).add(case)
        if case in mark.args:
            item.add_marker(pytest.mark.slow)
    if any("::" in arg for arg in config.args):  # a selection of cases: the rest were not collected
        return
    for (path, name), ids in declared.items():
        if unknown := sorted(ids - seen[(path, name)]):
            cases = sorted(seen[(path, name)])
            raise pytest.UsageError(f"{path}::{name}: slow_for names no case {unknown}; its cases: {cases}")
