"""Gradients kept between steps (``--keep-grads``: ``zero_grad(set_to_none=False)``, the default of
diffusers' DreamBooth and ControlNet scripts). The reference is the benchmark's tensor tracker on
real steps (an instrument the planner's profile does not use): the gradients are live from the
step's start, so its peak moves from the backward to the end of the forward, checkpointing saves
more of it, and the profile taken in that regime predicts it. JAX refuses it in one line.

Workload: tiny at 8x8, batch 1: gradients and optimizer temporaries weigh about as much as the
activations, as SD 1.5 at batch 1 on a GPU.
"""

from __future__ import annotations

import numpy as np
import pytest

from shared_configs.planning.budget import Profile, predict
from shared_configs.planning.units import assignment_of
from shared_configs.regime import Regime, add_regime_arguments, check_planned
from shared_configs.spec import SpecError
from tests.helpers.specs import variant

SPEC = variant("tiny", sample_size=8, dropout=0.0)
BATCH, CONTEXT = 1, 5
KEPT, FREED = Regime(keep_grads=True), Regime()


def _tracked(regime: Regime, policy: str) -> tuple[int, dict, int]:
    """(peak, timeline, gradient bytes) of one real step of ``regime`` under ``policy``."""

    from torch_impl import profile as profile_torch
    from torch_impl.memory import StepTracker
    from torch_impl.regime import trained_parameters

    s = profile_torch.setup(SPEC, BATCH, CONTEXT, regime=regime)
    s["model"].enable_gradient_checkpointing(policy)
    s["step"]()  # the plan's first step (a warm-up: the gradients exist, or were freed, as in a run)
    tracker = StepTracker(s["model"], s["opt"], inputs=profile_torch.batch_inputs(s["batch"]))
    with tracker:
        s["step"]()
    assert tracker.result is not None
    grads = sum(p.numel() * p.element_size() for p in trained_parameters(s["model"]))
    return tracker.result.peak, tracker.result.timeline, grads


def _peak_share_of_backward(timeline: dict) -> float:
    """Where the step's peak sits: its position's share of the way through the backward (<= 0:
    before the backward starts, that is in the forward or the loss)."""
    total = np.sum([timeline["series"][k] for k in timeline["series"]], axis=0)
    at = timeline["x"][int(np.argmax(total))]
    start, end = timeline["phases"]["backward"], timeline["phases"].get("optimizer", timeline["positions"])
    return (at - start) / (end - start)


def test_kept_gradients_move_the_peak_to_the_end_of_the_forward() -> None:
    freed_peak, freed_line, grads = _tracked(FREED, "none")
    kept_peak, kept_line, _ = _tracked(KEPT, "none")
    assert _peak_share_of_backward(freed_line) > 0.5  # freed: late, as the gradients grow (or in the optimizer)
    assert _peak_share_of_backward(kept_line) < 0.05  # kept: at the forward's end (the backward's first op)
    assert kept_peak > freed_peak  # the gradients now sit beside every activation
    assert kept_peak - freed_peak <= grads


def test_checkpointing_saves_more_with_kept_gradients() -> None:
    """Kept, the peak is the end of the forward, exactly what recomputing shrinks; freed, this
    step peaks after its activations are gone and recomputing them saves nothing."""
    saved = {r.keep_grads: _tracked(r, "none")[0] - _tracked(r, "full")[0] for r in (FREED, KEPT)}
    assert saved[False] == 0 and saved[True] > 0, saved


@pytest.mark.slow
def test_profile_with_kept_gradients_predicts_the_tracked_peak() -> None:
    """Profiled in the regime, the model predicts its real steps within 5% (the hand policies)."""
    from torch_impl import profile as profile_torch

    fields = profile_torch.profile(SPEC, BATCH, CONTEXT, repeats=0, regime=KEPT)
    profile = Profile(
        config="tiny32", sample_size=32, batch_size=BATCH, context_length=CONTEXT, regime=KEPT.describe(), **fields
    )
    for policy in ("none", "full", "layers"):
        predicted = predict(profile, SPEC, assignment_of(SPEC, policy)).peak_bytes
        measured = _tracked(KEPT, policy)[0]
        assert abs(predicted / measured - 1) <= 0.05, (policy, predicted, measured)


def test_jax_refuses_kept_gradients_in_one_line() -> None:
    with pytest.raises(SpecError, match=r"^keep_grads: .*temporaries.*--framework torch$"):
        check_planned(KEPT, "jax")
    check_planned(KEPT, "torch")  # torch runs it


def test_the_flag_is_part_of_the_regime() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_regime_arguments(parser)
    args = parser.parse_args(["--keep-grads"])
    regime = Regime(args.precision, args.trainable, args.optimizer, args.ema, args.keep_grads)
    assert regime == KEPT and regime.describe().endswith("grads kept")
    assert regime.as_dict()["keep_grads"] is True  # hence in every profile's cache key
    with pytest.raises(SpecError, match="keep_grads: expected true or false"):
        Regime(keep_grads="yes")  # type: ignore[arg-type]


def test_compare_refuses_kept_gradients_for_jax_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import compare

    with pytest.raises(SystemExit) as exit_:
        compare.main(["--framework", "jax", "--config", "tiny", "--keep-grads", "--steps", "1"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--keep-grads: a jitted JAX step's gradients are temporaries" in err
