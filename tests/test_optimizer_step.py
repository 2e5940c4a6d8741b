"""The optimizer step's temporaries (`shared_configs.planning.optimizer_step`) against the CPU
allocator running torch's own implementations: the per-parameter loop, foreach and fused AdamW,
Adafactor's loop and foreach (the code CUDA runs, run here on CPU tensors)."""

from __future__ import annotations

import pytest
import torch

from shared_configs.planning import optimizer_step as opt_step
from shared_configs.spec import SpecError
from torch_impl.memory import allocator_peak

CASES = [
    ("adamw", "per-parameter", lambda p: torch.optim.AdamW(p, foreach=False)),
    ("adamw", "foreach", lambda p: torch.optim.AdamW(p, foreach=True)),
    ("adamw", "fused", lambda p: torch.optim.AdamW(p, fused=True)),
    ("adafactor", "per-parameter", lambda p: torch.optim.Adafactor(p)),
    ("adafactor", "foreach", lambda p: torch.optim.Adafactor(p, foreach=True)),
]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 384), torch.nn.Linear(384, 8))


def _step_peak(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """The allocator's peak above its level during the second step (the first makes the state)."""
    for _ in range(2):
        model(torch.randn(4, 256)).sum().backward()
        with allocator_peak() as allocator:
            opt.step()
    return allocator["peak"]


def test_each_implementations_temporaries_as_torch_allocates_them() -> None:
    for optimizer, name, make in CASES:
        model = _model()
        params = list(model.parameters())
        trained = opt_step.Trained(sum(p.numel() for p in params), max(p.numel() for p in params))
        measured = _step_peak(model, make(params))
        want = opt_step.temporaries(optimizer, name, trained)
        # beyond the figure: scalars, Adafactor's row and column means and its vectors' squares (< 8 KiB here)
        assert want <= measured <= want + 8192, (optimizer, name, measured, want)


def test_torchs_defaults_per_device() -> None:
    assert opt_step.implementation("adamw", "cpu") == "per-parameter"
    assert opt_step.implementation("adamw", "cuda-sm90") == "foreach"
    assert opt_step.implementation("adafactor", "cuda") == "per-parameter"  # Adafactor's documented default
    trained = opt_step.Trained(numel=1000, largest=300)
    # foreach: one more copy of the trained weights; the loop: two of the largest tensor
    assert opt_step.temporaries("adamw", "foreach", trained) == 4000
    assert opt_step.temporaries("adamw", "per-parameter", trained) == 2400
    assert opt_step.temporaries("adamw8bit", "torchao", opt_step.Trained(1000, 300, itemsize=2)) == 2400  # float32
    with pytest.raises(SpecError, match="adamw8bit runs as one of torchao, bitsandbytes, got 'fused'"):
        opt_step.implementation("adamw8bit", "cuda", "fused")


def test_the_safety_margin_reads_the_runs_in_the_modelled_state() -> None:
    """adamw8bit's profile runs AdamW and holds 8-bit state (``modelled_state_bytes`` < 0): its runs'
    peaks, AdamW's, are compared with the prediction in the same state, not read as an error."""
    import dataclasses

    from shared_configs import load_spec
    from shared_configs.planning.budget import SAFETY, predict, safety_margin, with_static_bytes
    from shared_configs.planning.units import assignment_of
    from tests.helpers.specs import random_profile

    spec = load_spec("tiny")
    base = dataclasses.replace(random_profile(spec, 2, framework="torch"), scale=1.0)
    runs = {p: {"peak_bytes": predict(base, spec, assignment_of(spec, p)).peak_bytes} for p in ("none", "full")}
    delta = -(10 << 20)  # the 8-bit state 10 MiB below AdamW's
    profile = with_static_bytes(dataclasses.replace(base, meta={"runs": runs, "modelled_state_bytes": delta}), delta)
    assert safety_margin(profile, spec) == pytest.approx(SAFETY)
    unmodelled = dataclasses.replace(profile, meta={"runs": runs})  # read as AdamW's: 10 MiB over, an error
    assert safety_margin(unmodelled, spec) > SAFETY
