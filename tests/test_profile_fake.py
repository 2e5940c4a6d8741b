"""The torch profile's runs on fake tensors (`torch_impl.profile.fake_is_exact`) against the same runs
on real tensors: every unit's bytes, the optimizer's peak and the step's peak equal to the byte, so
the profile traces the runs it does not time on fake tensors; and a kept worker (profile, then
the check) answers as fresh workers do."""

from __future__ import annotations

import pytest

from shared_configs.pair import controlnet_pair
from shared_configs.planning.budget import PROFILE_RUNS
from shared_configs.planning.units import PLAIN, uniform
from shared_configs.regime import Regime
from tests.helpers.specs import variant

SPEC = variant("tiny", sample_size=32, dropout=0.0)
BATCH, CONTEXT = 4, 5
CASES = {
    "fp32": (SPEC, Regime()),
    "dropout": (variant("tiny", sample_size=32, dropout=0.1), Regime()),
    "lora": (SPEC, Regime(trainable="lora:4")),
    "ema": (SPEC, Regime(ema=True)),
    "keep-grads": (SPEC, Regime(keep_grads=True)),
    "adafactor": (SPEC, Regime(optimizer="adafactor")),
    "controlnet": (controlnet_pair(SPEC), Regime()),
}
HEAVY = {"ema", "keep-grads", "adafactor"}  # the regime checks of test_plan_regime keep their ground


def _runs(spec, regime: Regime, shapes: bool) -> list:
    from torch_impl import profile as profile_torch

    s = profile_torch.setup(spec, BATCH, CONTEXT, shapes, regime)
    return [profile_torch.memory_run(s, {} if c == PLAIN else uniform(spec, c, level)) for c, level in PROFILE_RUNS]


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.heavy) if c in HEAVY else c for c in CASES])
def test_fake_runs_file_the_real_runs_bytes(case: str) -> None:
    from torch_impl.profile import fake_is_exact

    spec, regime = CASES[case]
    assert fake_is_exact(regime)
    for run, real, fake in zip(PROFILE_RUNS, _runs(spec, regime, False), _runs(spec, regime, True), strict=True):
        assert real == fake, run  # (per-unit costs, optimizer peak, step peak)


@pytest.mark.slow
def test_mixed_precision_is_not_taken_from_fake_runs() -> None:
    """Under autocast the real step holds bytes the fake one does not: those runs stay real."""
    from torch_impl.profile import fake_is_exact

    regime = Regime(precision="bf16-mixed")
    assert not fake_is_exact(regime)
    real, fake = _runs(SPEC, regime, False)[0], _runs(SPEC, regime, True)[0]
    assert real[2] > fake[2]


@pytest.mark.slow
def test_a_kept_worker_checks_as_a_fresh_one() -> None:
    """`workers.kept_alive`: the profile and the check go to one process, whose check (on the
    profile's fake set-up) equals a fresh worker's; the process is gone after the block."""
    from shared_configs.planning import workers
    from shared_configs.planning.pipeline import Workload

    work = Workload.of(SPEC, batch_size=BATCH, context_length=CONTEXT)
    check = work.request("torch", "peaks", policies=["full", "layers"])
    with workers.kept_alive():
        profile = workers.run_worker(work.request("torch", "profile", repeats=0))
        (kept,) = workers._kept.values()  # type: ignore[union-attr]
        again = workers.run_worker(check)
        assert list(workers._kept.values()) == [kept]  # type: ignore[union-attr]
    assert kept.proc.returncode == 0
    assert profile["mode"] == "shapes"  # bytes only (repeats=0)
    assert again["peaks"] == workers.run_worker(check)["peaks"]
