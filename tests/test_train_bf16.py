"""bf16 mixed precision in `jax_impl.train`: the heavy ops run in bf16, the curve tracks float32.

Cheap by construction: the dtype check traces the step (no compile), and the training curves come
from one subprocess that compiles the bf16 step once, with backend optimisation off, on two CPU
devices (the ``--distributed`` mesh) under the ``full`` remat policy: the three paths at once.
Its float32 reference is torch's float32 curve from the same converted weights and batches, which
`test_train_curves.test_torch_and_jax_loss_curves_agree` pins to JAX's float32 curve within 1e-4 (one
JAX compile fewer). The bf16 tolerance is far looser than that, so the stand-in costs nothing.
"""

from __future__ import annotations

import functools
from collections import Counter

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax import lax

from jax_impl import step as jstep
from shared_configs import load_spec, spec_from_dict
from shared_configs.training.data import load_dataset
from tests.helpers.processes import jax_on_two_devices
from tests.helpers.training import CFG, SCHEDULE, TINY_NO_DROPOUT, float_dtypes, jax_setup, torch_curve
from torch_impl import train as ttrain
from torch_impl.regime import StepTools

STEPS = 10
# bf16 keeps 8 significant bits (unit roundoff 2^-9 = 0.2%), but the loss averages 1024 squared
# errors, so its rounding mostly cancels; what remains is the slow drift of two trajectories.
# Measured over these 10 steps: JAX bf16 vs float32 <= 0.13% per step, vs torch autocast <= 0.11%
# (torch's own bf16 vs float32: 0.08%; 0.17-0.26% over 30 steps). 1% leaves ~7x room for other
# CPUs and library versions, yet float32 falls 21% over these steps: a bf16 step that did not
# train like float32 would fall outside it.
BF16_RTOL = 1e-2

BF16_RUN = """
import dataclasses, json, sys, jax
from jax_impl.parallel import make_mesh
from shared_configs import spec_from_dict
from shared_configs.regime import Regime
from shared_configs.training.data import load_dataset
from tests.helpers.training import CFG, SCHEDULE, TINY_NO_DROPOUT, float_dtypes, jax_setup, run_steps
spec, STEPS = spec_from_dict(TINY_NO_DROPOUT), int(sys.argv[1])
model, tx, state = jax_setup(spec, "full")
cfg, losses, data = dataclasses.replace(CFG, regime=Regime("bf16-mixed")), [], load_dataset("digits", spec)
mesh = make_mesh(cfg.batch_size)
state = run_steps(state, losses, data, SCHEDULE, cfg, STEPS, model, tx, mesh=mesh)
print(json.dumps({"devices": len(jax.devices()), "losses": losses, "state_dtypes": float_dtypes(state)}))
"""


def _compute_dtype(eqn: jax.extend.core.JaxprEqn) -> str:
    # jax.nn.dot_product_attention's backward multiplies the float32 softmax cotangent by bf16 q/k
    # with the BF16_BF16_F32 algorithm: operands rounded to bf16, float32 accumulation. bf16 compute.
    precision = eqn.params.get("precision")
    if isinstance(precision, lax.DotAlgorithmPreset) and precision.name.startswith("BF16_BF16"):
        return "bfloat16"
    return "+".join(sorted({str(v.aval.dtype) for v in eqn.invars}))


def _heavy_ops(jaxpr: jax.extend.core.Jaxpr) -> Counter[tuple[str, str]]:
    """(primitive, compute dtype) of every conv and dot_general, sub-jaxprs (jit, remat) included."""
    counts: Counter[tuple[str, str]] = Counter()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("conv_general_dilated", "dot_general"):
            counts[eqn.primitive.name, _compute_dtype(eqn)] += 1
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            counts += _heavy_ops(sub)
    return counts


def test_bf16_step_runs_every_conv_and_matmul_in_bf16() -> None:
    """Trace (not compile) the whole bf16 train step, forward, remat recompute and backward.

    Tiny has cross-attention, dropout, and a float32 timestep embedding to mix in: any float32
    leaking into the activations would promote the ops after it back to float32.
    """
    spec = load_spec("tiny")
    model, tx, state = jax_setup(spec, "full")
    batch = jstep.arrays(load_dataset("digits", spec).batch(0, CFG.batch_size, SCHEDULE, CFG.seed))
    step = functools.partial(jstep.train_step, model=model, tx=tx, compute_dtype=jnp.bfloat16)
    closed, out = jax.make_jaxpr(step, return_shape=True)(state, batch, jax.random.key(0))
    counts = _heavy_ops(closed.jaxpr)
    assert {dtype for _, dtype in counts} == {"bfloat16"}, counts
    assert counts["conv_general_dilated", "bfloat16"] > 50 and counts["dot_general", "bfloat16"] > 100, counts
    assert float_dtypes(out) == ["float32"]  # new params, optimizer state and loss


@pytest.fixture(scope="module")
def bf16_run() -> dict:  # a subprocess: the tests using it are marked slow
    """The JAX bf16 curve: 2 CPU devices, batch split, policy ``full``, via `run_steps`."""
    return jax_on_two_devices(BF16_RUN, str(STEPS))


@pytest.mark.slow
def test_bf16_curve_tracks_float32_and_state_stays_float32(bf16_run: dict) -> None:
    assert bf16_run["state_dtypes"] == ["float32"]  # master params and AdamW moments
    float32 = torch_curve(spec_from_dict(TINY_NO_DROPOUT), "none", STEPS)
    np.testing.assert_allclose(bf16_run["losses"], float32, rtol=BF16_RTOL)
    assert bf16_run["losses"] != float32  # bf16 really ran: rounding leaves a trace


@pytest.mark.slow
def test_bf16_curve_matches_torch_autocast(bf16_run: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same converted weights and batches; torch casts per op (autocast), JAX casts the inputs."""
    autocast = functools.partial(ttrain.train_step, tools=StepTools(autocast_dtype=torch.bfloat16))
    monkeypatch.setattr(ttrain, "train_step", autocast)  # what `torch_curve` calls
    autocast_curve = torch_curve(spec_from_dict(TINY_NO_DROPOUT), "none", STEPS)
    np.testing.assert_allclose(bf16_run["losses"], autocast_curve, rtol=BF16_RTOL)
