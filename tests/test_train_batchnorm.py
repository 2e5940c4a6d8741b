"""``norm_kind: batch`` in `jax_impl.train`: the step carries ``batch_stats`` and matches torch.

One JAX compile of the step (policy ``full``, per pytest worker) serves the torch comparison,
sampling and the resume test; the 2-device run compiles its own, with backend optimisation off.
Dropout is off: torch and JAX draw different masks.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from flax import traverse_util

from jax_impl import step as jstep
from jax_impl import train as jtrain
from jax_impl.checkpoint_io import FRAMEWORK, LAYOUT, load_checkpoint, save_checkpoint
from jax_impl.convert import flax_to_torch
from shared_configs import spec_from_dict
from shared_configs.training.data import load_dataset
from shared_configs.training.loop import manifest_for
from tests.helpers.processes import jax_on_two_devices
from tests.helpers.tensors import rel_err
from tests.helpers.training import (
    CFG,
    SCHEDULE,
    TINY_BN,
    jax_restore_target,
    jax_setup,
    jax_train,
    run_steps,
    torch_train,
)
from torch_impl import train as ttrain
from torch_impl.unet import UNet as TorchUNet

STEPS = 5
SPEC = spec_from_dict(TINY_BN)

DATA_PARALLEL = """
import json, sys, numpy as np
from flax import traverse_util
import jax
from jax_impl.parallel import make_mesh
from shared_configs import spec_from_dict
from shared_configs.training.data import load_dataset
from tests.helpers.training import CFG, SCHEDULE, TINY_BN, jax_setup, run_steps
SPEC, STEPS = spec_from_dict(TINY_BN), int(sys.argv[1])
model, tx, state = jax_setup(SPEC, "none")
result, data = {"devices": len(jax.devices())}, load_dataset("digits", SPEC)
flat = lambda s: {"/".join(k): np.asarray(v).tolist() for k, v in traverse_util.flatten_dict(s.batch_stats).items()}
for name, mesh in (("single", None), ("sharded", make_mesh(CFG.batch_size))):
    losses = []
    start = jax.tree.map(lambda a: a.copy(), state)  # each step donates the state it is given
    first = run_steps(start, losses, data, SCHEDULE, CFG, 1, model, tx, mesh=mesh)
    stats = flat(first)
    end = run_steps(first, losses, data, SCHEDULE, CFG, STEPS, model, tx, mesh=mesh)
    result[name] = {"losses": losses, "first": stats, "end": flat(end)}
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def jax_run() -> tuple[jstep.TrainState, list[float]]:
    return jax_train(SPEC, "full", STEPS)


def _flat(tree: object) -> dict[str, np.ndarray]:
    return {"/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(tree).items()}


def _assert_torch_stats(state: jstep.TrainState, tmodel: TorchUNet, steps: int, mean_atol: float) -> None:
    """Flax's running statistics against torch's, up to the running-variance convention.

    torch averages the unbiased batch variance, Flax the biased one. From var = 1, after N steps
    var = d + (sum of batch terms), d = (1 - m)^N, and torch's terms are n/(n-1) times Flax's,
    n = B*H*W at the norm's resolution (8x8 or 4x4 here).
    """
    converted, ref = flax_to_torch(state.params, SPEC, state.batch_stats), tmodel.state_dict()
    decay = (1 - SPEC.norm_momentum) ** steps
    sizes = [CFG.batch_size * s * s for s in (SPEC.sample_size, SPEC.sample_size // 2)]
    names = [k for k in ref if k.endswith("running_mean")]
    assert len(names) > 5
    for name in names:
        np.testing.assert_allclose(converted[name].numpy(), ref[name].numpy(), atol=mean_atol, err_msg=name)
        var, tvar = (d[name.replace("mean", "var")].numpy() for d in (converted, ref))
        assert np.abs(tvar - 1).max() > 1e-2  # the statistics moved
        err = min(np.abs(decay + (var - decay) * n / (n - 1) - tvar).max() for n in sizes)
        assert err <= 2e-5, (name, err)


@pytest.mark.slow
def test_jax_batchnorm_curve_and_running_stats_match_torch(jax_run: tuple) -> None:
    """Same converted weights and batches; JAX under ``full`` remat updates batch_stats once per step.

    After one step (identical weights) the running means agree to 1e-5 (measured 2e-8). Later
    means carry the biases of the convs just before a BatchNorm: it cancels them, so their exact
    gradient is 0, AdamW turns each framework's float32 noise there into steps of up to ``lr``, and
    the running mean follows (measured 6e-4 after 5 steps). Loss and variances do not see them
    (measured: loss 9e-7 relative, variance 3e-6 to 1.1e-5 with the package versions of 2026-12-03: float32
    noise of the two frameworks' kernels, about 100 ulps of a variance near 1).
    """
    tmodel, tlosses = torch_train(SPEC, "none", 1)
    _assert_torch_stats(jax_train(SPEC, "full", 1)[0], tmodel, 1, mean_atol=1e-5)
    tmodel, tlosses = torch_train(SPEC, "none", STEPS)
    state, losses = jax_run
    np.testing.assert_allclose(losses, tlosses, rtol=1e-4)
    assert losses[-1] < 0.9 * losses[0]  # it trains
    _assert_torch_stats(state, tmodel, STEPS, mean_atol=STEPS * CFG.lr * SPEC.norm_momentum * 4)


@pytest.mark.slow
def test_jax_batchnorm_samples_use_the_running_stats(jax_run: tuple) -> None:
    """`generate` is eval mode: torch's sampler with the same statistics (Flax's, converted) agrees."""
    state, _ = jax_run
    cfg, dataset = dataclasses.replace(CFG, sample_steps=2, num_samples=2), load_dataset("digits", SPEC)
    samples = jtrain.generate(jstep.Trainee(jax_setup(SPEC, "full")[0]), state, SPEC, SCHEDULE, dataset, cfg)
    tmodel = TorchUNet(SPEC)
    tmodel.load_state_dict(flax_to_torch(state.params, SPEC, state.batch_stats, num_batches_tracked=STEPS))
    ref = ttrain.generate(tmodel, SCHEDULE, dataset, cfg)
    assert rel_err(samples, ref) <= 1e-4


@pytest.mark.slow
def test_jax_batchnorm_resume_continues_the_curve(jax_run: tuple, tmp_path: Path) -> None:
    model, tx, state = jax_setup(SPEC, "full")  # equal to the fixture's: its compiled step is reused
    dataset, losses = load_dataset("digits", SPEC), []
    half = run_steps(state, losses, dataset, SCHEDULE, CFG, 2, model, tx)
    path = save_checkpoint(tmp_path, half, manifest_for(CFG, SPEC, FRAMEWORK, LAYOUT, losses))
    restored, manifest = load_checkpoint(path, jax_restore_target(jax_setup(SPEC, "full")[2]))  # fresh stats
    assert (manifest.step, manifest.losses) == (2, losses)
    assert _flat(restored.batch_stats).keys() == _flat(half.batch_stats).keys()
    for key, value in _flat(restored.batch_stats).items():
        np.testing.assert_array_equal(value, _flat(half.batch_stats)[key], err_msg=key)
    end = run_steps(restored, losses, dataset, SCHEDULE, CFG, STEPS, model, tx)
    whole, whole_losses = jax_run
    assert losses == whole_losses
    for key, value in _flat(end.batch_stats).items():
        np.testing.assert_array_equal(value, _flat(whole.batch_stats)[key], err_msg=key)


@pytest.mark.heavy
def test_jax_batchnorm_data_parallel_matches_one_device() -> None:
    """2 CPU devices, batch split: BatchNorm normalises with global-batch statistics (jit inserts
    the reductions), so the loss curve and the running statistics equal one device's."""
    result = jax_on_two_devices(DATA_PARALLEL, str(STEPS))
    single, sharded = result["single"], result["sharded"]
    np.testing.assert_allclose(sharded["losses"], single["losses"], rtol=1e-5)
    assert sharded["end"].keys() == single["end"].keys() and len(single["end"]) > 10
    for key, value in sharded["first"].items():  # after one step (the same weights): equal
        np.testing.assert_allclose(value, single["first"][key], rtol=1e-5, atol=1e-6, err_msg=key)
    for key, value in sharded["end"].items():  # later, means see the noise of BN-cancelled biases (above)
        atol = STEPS * CFG.lr * SPEC.norm_momentum * 4 if key.endswith("mean") else 1e-5
        np.testing.assert_allclose(value, single["end"][key], rtol=1e-5, atol=atol, err_msg=key)
