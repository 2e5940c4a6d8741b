"""The planner in a training regime: profiles taken in the regime, checked against the benchmark's
tracker on real steps of that regime (an instrument the profile does not use); the regime keys the
profile cache; adamw8bit's modelled state against torchao's real one.

Workload: tiny at 32x32, batch 4 (activations well above its weights), as tests/test_plan_model.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from shared_configs.planning.budget import Profile, predict, random_assignment
from shared_configs.planning.pipeline import Workload, profile_path
from shared_configs.planning.units import assignment_of, policy_string
from shared_configs.regime import Regime, state_bytes
from tests.helpers.specs import variant

SPEC = variant("tiny", sample_size=32, dropout=0.0)
BATCH, CONTEXT = 4, 5
TOLERANCE = 0.05
REGIMES = {
    "bf16-mixed": Regime("bf16-mixed"),
    "lora": Regime("bf16-mixed", "lora:8"),
    "fp16-adafactor-ema": Regime("fp16-mixed", optimizer="adafactor", ema=True),
    "bf16": Regime("bf16"),
}


def _profile(fields: dict, regime: Regime) -> Profile:
    return Profile(
        config="tiny32", sample_size=32, batch_size=BATCH, context_length=CONTEXT, regime=regime.describe(), **fields
    )


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REGIMES))
def test_torch_profile_in_a_regime_predicts_the_tracked_peak(name: str) -> None:
    """Profiled in the regime (autocast, frozen base, the regime's optimizer and EMA copy), the
    model predicts real steps of that regime within 5%, plans it never ran included."""
    from torch_impl import profile as profile_torch
    from torch_impl.memory import step_peak

    regime = REGIMES[name]
    profile = _profile(profile_torch.profile(SPEC, BATCH, CONTEXT, repeats=0, regime=regime), regime)
    rng = np.random.default_rng(1)
    policies = ["none", "full", "layers"] + [policy_string(random_assignment(SPEC, rng)) for _ in range(2)]
    s = profile_torch.setup(SPEC, BATCH, CONTEXT, regime=regime)
    for policy in policies:
        s["model"].enable_gradient_checkpointing(policy)
        with step_peak(s["model"], s["opt"], profile_torch.batch_inputs(s["batch"]), s["held"]) as found:
            s["step"]()
        measured = found["peak"]
        predicted = predict(profile, SPEC, assignment_of(SPEC, policy)).peak_bytes
        assert abs(predicted / measured - 1) <= TOLERANCE, (policy, predicted, measured)


@pytest.mark.slow
def test_the_regime_changes_what_a_step_keeps() -> None:
    """Not a float32 profile rescaled: a frozen base keeps fewer activations than a trained one in
    the same precision, and pure bfloat16 less than mixed (fake tensors: nothing allocated)."""
    from torch_impl import profile as profile_torch

    def peaks(regime: Regime) -> dict[str, int]:
        return profile_torch.peaks(SPEC, BATCH, ["none", "full"], CONTEXT, regime=regime)["peaks"]

    fp32, mixed, lora, bf16 = (peaks(r) for r in (Regime(), REGIMES["bf16-mixed"], REGIMES["lora"], REGIMES["bf16"]))
    assert mixed["none"] < fp32["none"]
    assert lora["none"] < mixed["none"]
    assert bf16["none"] < mixed["none"]
    # checkpointing saves a different amount in each regime, not one ratio
    savings = {k: 1 - p["full"] / p["none"] for k, p in {"fp32": fp32, "mixed": mixed, "lora": lora}.items()}
    assert len({round(v, 3) for v in savings.values()}) == 3, savings


def test_adamw8bit_state_model_matches_torchao() -> None:
    """`state_bytes("adamw8bit", ...)` against the bytes torchao's AdamW8bit really keeps after a step."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("torchao")
    from torch_impl.memory import state_tensors, storage_bytes
    from torch_impl.regime import make_optimizer
    from torch_impl.unet import UNet

    model = UNet(SPEC)
    opt = make_optimizer(model, 1e-3, 0.0, Regime(optimizer="adamw8bit"))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    with torch.compiler.set_stance("force_eager"):  # the same state, without compiling a step per shape
        opt.step()
    moments = [t for t in state_tensors(opt) if t.dim() > 0]  # the step counters are scalars
    numels = [p.numel() for p in model.parameters()]
    assert storage_bytes(moments) == state_bytes("adamw8bit", numels, 4)
    assert state_bytes("adamw8bit", numels, 4) < 0.6 * state_bytes("adamw", numels, 4)  # tiny: many small tensors


@pytest.mark.heavy
def test_jax_profile_in_a_regime_predicts_the_compiled_peak() -> None:
    """JAX in bfloat16 mixed precision, LoRA adapters on a frozen base, Adafactor and an EMA copy:
    the profile (XLA's live ranges) predicts the compiled step's ``memory_analysis()`` peak within
    5% (float16 has no XLA:CPU matmul kernel): its own five compiles (`none`, `full`, `layers`, ...,
    keyed by their unit lists) and a mixed plan it never compiled, through the planner's compile check."""
    from jax_impl import profile as profile_jax

    regime = Regime("bf16-mixed", "lora:8", "adafactor", ema=True)
    fields = profile_jax.profile(SPEC, BATCH, CONTEXT, shapes=True, repeats=0, attention_chunk=None, regime=regime)
    profile = _profile(fields, regime)
    measured = {policy: run["peak_bytes"] for policy, run in profile.meta["runs"].items()}
    assert "none" in measured and len(measured) >= 3, sorted(measured)  # `full` and `layers` as unit lists
    mixed = policy_string(random_assignment(SPEC, np.random.default_rng(5)))
    measured |= profile_jax.peaks(SPEC, BATCH, [mixed], CONTEXT, None, regime)["peaks"]
    for policy, peak in measured.items():
        predicted = predict(profile, SPEC, assignment_of(SPEC, policy)).peak_bytes
        assert abs(predicted / peak - 1) <= TOLERANCE, (policy, predicted, peak)


def test_the_regime_keys_the_profile_cache() -> None:
    regimes = [Regime(), Regime(keep_grads=True), *REGIMES.values()]
    paths = {profile_path("torch", Workload(SPEC, BATCH, r)) for r in regimes}
    assert len(paths) == len(regimes)
    request = Workload(SPEC, BATCH, REGIMES["lora"]).request("torch", "profile")
    assert request["regime"] == {
        "precision": "bf16-mixed",
        "trainable": "lora:8",
        "optimizer": "adamw",
        "ema": False,
        "keep_grads": False,
    }


def test_a_regime_jax_cannot_run_here_is_refused_before_any_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """float16 compute on XLA:CPU (no float16 matmul kernel): one line, no worker started; torch plans it."""
    from shared_configs.planning import pipeline
    from shared_configs.spec import SpecError

    monkeypatch.setattr(pipeline, "run_worker", lambda request: pytest.fail(f"a worker was started: {request['kind']}"))
    work = Workload(SPEC, BATCH, Regime("fp16-mixed"), shapes=True)
    with pytest.raises(SpecError, match=r"^precision: fp16-mixed has no XLA:CPU matmul .*use bf16-mixed"):
        pipeline.predict_policy(work, "full", "jax")
    with pytest.raises(SpecError, match="precision: fp16-mixed"):
        pipeline.plan(work, 1 << 30, "both")
