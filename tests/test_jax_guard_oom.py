"""`jax_impl.GuardedStep`: after XLA's out-of-memory error the same step runs again, with the same
arguments, under a plan that recomputes more; its result equals the unguarded step's. This CPU does
not run out of memory on `tiny`, so the device is stood in for: the compiled step raises XLA's
``RESOURCE_EXHAUSTED`` under the plans the test names (and may consume its donated arguments first,
as a GPU run can)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import pytest

from jax_impl import guard
from jax_impl import step as jstep
from jax_impl.pair import step_model
from jax_impl.profile import setup
from shared_configs.planning.closed_loop import FULL
from shared_configs.planning.pipeline import Workload
from tests.helpers.specs import variant

SPEC = variant("tiny", sample_size=16)
BATCH = 2
OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1048576 bytes."


class _Device:
    """A compiled step that raises XLA's out-of-memory error while its policy is in ``fails``."""

    def __init__(self, compiled: Any, fails: bool, consume: bool) -> None:
        self._compiled, self._fails, self._consume = compiled, fails, consume

    def memory_analysis(self) -> Any:
        return self._compiled.memory_analysis()

    def __call__(self, *args: Any) -> Any:
        if self._fails:
            if self._consume:  # what a donated run leaves when it fails after taking its inputs
                jax.tree.map(lambda a: a.delete(), args[0])
            raise jax.errors.JaxRuntimeError(OOM)
        return self._compiled(*args)


@pytest.fixture(scope="module")
def step() -> dict[str, Any]:
    s = setup(SPEC, BATCH, Workload.context_length, Workload.attention_chunk, run=True)

    def build(policy: str, donate: bool = False) -> Any:
        fn = functools.partial(
            jstep.train_step.__wrapped__, model=step_model(s["spec"], policy, s["chunk"]), tx=s["tx"]
        )
        return jax.jit(fn, donate_argnums=(0,) if donate else ())

    # Starting from `none` under a budget it fits: one compile, no solve.
    sp = guard.plan_for_step(build, s["args"], 1 << 40, spec=SPEC, batch_size=BATCH, policy="none")
    return {"s": s, "build": build, "sp": sp}


def _on_device(monkeypatch: pytest.MonkeyPatch, fails: Callable[[str], bool], consume: bool = False) -> None:
    real = guard.compile_for

    def compile_for(build: Any, policy: str, args: Any) -> _Device:
        return _Device(real(build, policy, args), fails(policy), consume)

    monkeypatch.setattr(guard, "compile_for", compile_for)


def _copy(tree: Any) -> Any:
    return jax.tree.map(lambda a: a.copy() if isinstance(a, jax.Array) else a, tree)


@pytest.mark.heavy  # minutes of CPU: left out of the default run
def test_out_of_memory_runs_the_same_step_again_under_a_plan_that_recomputes_more(
    step: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    s, sp = step["s"], step["sp"]
    _, want_loss = step["build"]("none")(*_copy(s["args"]))  # the unguarded step under `none`
    _on_device(monkeypatch, lambda policy: policy == "none")
    guarded = guard.GuardedStep(step["build"], sp, s["args"])
    state, loss = guarded(*_copy(s["args"]))
    error = guarded.history[-1]
    assert (error.action, error.step, error.plan) == ("out of memory", 1, "none")
    assert guarded.plan != "none" and guarded.predicted < error.predicted  # recomputes more
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    # The retried step is the step under the new plan, run once on the same arguments: its state
    # equals that plan's unguarded step bit for bit (Adam's first update is sign-like, so a plan's
    # float differences in near-zero gradients would show in it; the loss above is plan-independent).
    monkeypatch.undo()
    want_state, _ = guard.compile_for(step["build"], guarded.plan, s["args"])(*_copy(s["args"]))
    for got, want in zip(jax.tree.leaves(state), jax.tree.leaves(want_state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow
def test_out_of_memory_under_full_re_raises(step: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    s = step["s"]
    sp = guard.plan_for_step(step["build"], s["args"], 1 << 40, spec=SPEC, batch_size=BATCH, policy=FULL)
    _on_device(monkeypatch, lambda policy: True)
    guarded = guard.GuardedStep(step["build"], sp, s["args"])
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        guarded(*_copy(s["args"]))
    assert guarded.plan == FULL and guarded.history[-1].action == "out of memory"


@pytest.mark.slow
def test_a_step_that_consumed_its_donated_arguments_is_not_run_again(
    step: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _on_device(monkeypatch, lambda policy: True, consume=True)
    guarded = guard.GuardedStep(functools.partial(step["build"], donate=True), step["sp"], step["s"]["args"])
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        guarded(*_copy(step["s"]["args"]))
    assert guarded.plan == step["sp"].plan  # no re-plan: nothing left to run it on
    assert [r.action for r in guarded.history[-2:]] == ["out of memory", "consumed"]


def test_only_xla_out_of_memory_errors_are_retried() -> None:
    assert guard.is_out_of_memory(jax.errors.JaxRuntimeError(OOM))
    assert not guard.is_out_of_memory(jax.errors.JaxRuntimeError("INVALID_ARGUMENT: bad shape"))
    assert not guard.is_out_of_memory(MemoryError(OOM))
