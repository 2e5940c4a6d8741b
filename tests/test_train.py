"""Training loops: checkpointing leaves the loss curve unchanged, torch == JAX, learning, resume, CLI.

Kept fast: the tiny spec, batch 4, one thread for torch, and the JAX parameters converted from a
seeded torch model (a jitted Flax init costs as much as compiling the step). The JAX tests share
one compiled step per (model, optimizer) pair: `make_optimizer` is cached, models compare equal.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import flax.serialization
import jax
import numpy as np
import pytest
import torch
import yaml

from jax_impl import train as jtrain
from jax_impl.convert import torch_to_flax_variables
from jax_impl.unet import UNet as FlaxUNet
from shared_configs import UNetSpec, load_spec, spec_from_dict
from shared_configs.training import TrainConfig, load_dataset, make_schedule, speed_line, step_seed
from tests.utils import TINY, torchrun_train
from torch_impl import train as ttrain
from torch_impl.unet import UNet as TorchUNet

SCHEDULE = make_schedule("linear", 1000)
CFG = TrainConfig(batch_size=4, lr=1e-3, weight_decay=0.01, seed=0, sample_steps=0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops on a shared 2-core box: threads only contend
    yield
    torch.set_num_threads(threads)


def torch_model(spec: UNetSpec, policy: str = "none", seed: int = 0) -> TorchUNet:
    torch.manual_seed(seed)
    model = TorchUNet(spec)
    model.enable_gradient_checkpointing(policy)
    return model


def torch_train(spec: UNetSpec, policy: str, steps: int) -> tuple[TorchUNet, list[float]]:
    """The seeded torch model after ``steps`` steps (running statistics included), and its losses."""
    model = torch_model(spec, policy)
    optimizer = ttrain.make_optimizer(model, CFG.lr, CFG.weight_decay)
    dataset, losses = load_dataset("digits", spec), []
    for step in range(steps):
        torch.manual_seed(step_seed(CFG.seed, step))
        losses.append(ttrain.train_step(model, optimizer, dataset.batch(step, CFG.batch_size, SCHEDULE, CFG.seed)))
    return model, losses


def torch_curve(spec: UNetSpec, policy: str, steps: int) -> list[float]:
    return torch_train(spec, policy, steps)[1]


def jax_setup(spec: UNetSpec, policy: str) -> tuple[FlaxUNet, object, jtrain.TrainState]:
    """The Flax model, optimizer, and train state (params, opt_state, batch_stats) converted from
    the seeded torch model."""
    model, tx = FlaxUNet(spec=spec, policy=policy), jtrain.make_optimizer(CFG.lr, CFG.weight_decay)
    variables = torch_to_flax_variables(torch_model(spec).state_dict(), spec)
    return model, tx, jtrain.TrainState.create(jax.tree.map(jax.numpy.asarray, variables), tx)


def jax_train(spec: UNetSpec, policy: str, steps: int) -> tuple[jtrain.TrainState, list[float]]:
    model, tx, state = jax_setup(spec, policy)
    losses: list[float] = []
    state = jtrain.run_steps(state, losses, load_dataset("digits", spec), SCHEDULE, CFG, steps, model, tx)
    return state, losses


def jax_curve(spec: UNetSpec, policy: str, steps: int) -> list[float]:
    return jax_train(spec, policy, steps)[1]


@pytest.mark.parametrize("curve", [torch_curve, jax_curve], ids=["torch", "jax"])
def test_checkpointing_keeps_the_loss_curve(curve) -> None:
    spec = load_spec("tiny")
    assert spec.dropout > 0  # dropout is on: the masks must be replayed on recompute
    plain, full = curve(spec, "none", 20), curve(spec, "full", 20)
    np.testing.assert_allclose(full, plain, rtol=1e-6)


def test_torch_and_jax_loss_curves_agree() -> None:
    spec = spec_from_dict({**TINY, "name": "tiny_nodrop", "dropout": 0.0})
    np.testing.assert_allclose(jax_curve(spec, "none", 10), torch_curve(spec, "none", 10), rtol=1e-4)


def test_loss_halves_on_digits(tmp_path: Path) -> None:
    cfg = TrainConfig(batch_size=16, steps=80, lr=2e-3, out=str(tmp_path), sample_steps=2, num_samples=2)
    losses = ttrain.train(cfg)
    assert np.mean(losses[-10:]) <= 0.5 * np.mean(losses[:5]), (losses[:5], losses[-10:])
    assert {p.name for p in tmp_path.iterdir()} == {"checkpoint.pt", "loss.png", "samples.png", "losses.json"}


def test_torch_resume_continues_the_curve(tmp_path: Path) -> None:
    whole = ttrain.train(TrainConfig(**{**vars(CFG), "steps": 6, "out": str(tmp_path / "a")}))
    part = TrainConfig(**{**vars(CFG), "steps": 3, "out": str(tmp_path / "b")})
    assert ttrain.train(part) == whole[:3]
    assert ttrain.train(TrainConfig(**{**vars(part), "steps": 6, "resume": True})) == whole


def test_jax_resume_continues_the_curve(tmp_path: Path) -> None:
    spec = load_spec("tiny")  # the same model and optimizer as above: the compiled step is reused
    model, tx, state = jax_setup(spec, "none")
    dataset, whole = load_dataset("digits", spec), []
    jtrain.run_steps(jax.tree.map(jax.numpy.copy, state), whole, dataset, SCHEDULE, CFG, 6, model, tx)  # donated
    losses: list[float] = []
    half = jtrain.run_steps(state, losses, dataset, SCHEDULE, CFG, 3, model, tx)
    spec_dict, path = spec.model_dump(mode="json"), tmp_path / jtrain.CHECKPOINT
    jtrain.save_checkpoint(path, half, 3, losses, spec_dict)
    restored, step, losses = jtrain.load_checkpoint(path, jax_setup(spec, "none")[2], spec_dict)  # a fresh structure
    assert step == 3 and restored.batch_stats == {}
    jtrain.run_steps(restored, losses, dataset, SCHEDULE, CFG, 6, model, tx)
    assert losses == whole


def test_jax_checkpoint_without_batch_stats_loads(tmp_path: Path) -> None:
    """A GroupNorm checkpoint from before the loop carried ``batch_stats`` restores as before."""
    spec = load_spec("tiny")
    state, spec_dict, path = jax_setup(spec, "none")[2], spec.model_dump(mode="json"), tmp_path / jtrain.CHECKPOINT
    jtrain.save_checkpoint(path, state, 2, [1.0, 0.5], spec_dict)
    blob = flax.serialization.msgpack_restore(path.read_bytes())
    del blob["batch_stats"]  # the old format: params, opt_state, step, losses, spec
    path.write_bytes(flax.serialization.msgpack_serialize(blob))
    restored, step, losses = jtrain.load_checkpoint(path, state, spec_dict)
    assert (step, losses, restored.batch_stats) == (2, [1.0, 0.5], {})
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, restored.params, state.params)))


@pytest.mark.parametrize("main", [ttrain.main, jtrain.main], ids=["torch", "jax"])
@pytest.mark.parametrize(
    "argv",
    [["--steps", "0"], ["--lr", "x"], ["--config", "nope"], ["--policy", "bogus"], ["--data", "mnist"], ["--resume"]],
)
def test_bad_input_is_one_line(main, argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main([*argv, "--out", str(tmp_path / "none")])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err


JAX_DATA_PARALLEL = """
import json, jax, numpy as np
from jax_impl import train as jtrain
from jax_impl.unet import UNet
from shared_configs import load_spec
from shared_configs.training import TrainConfig, load_dataset, make_schedule
cfg = TrainConfig(batch_size=4, lr=1e-3, weight_decay=0.01, seed=0, sample_steps=0)
spec = load_spec("tiny")
model, tx = UNet(spec=spec, policy="balanced"), jtrain.make_optimizer(cfg.lr, cfg.weight_decay)
state = jtrain.init_state(model, tx, seed=0)
data, schedule = load_dataset("digits", spec, 0), make_schedule("linear", 1000)
curves = {}
for name, mesh in (("single", None), ("sharded", jtrain.data_parallel_mesh(cfg.batch_size))):
    losses = []
    jtrain.run_steps(jax.tree.map(jax.numpy.copy, state), losses, data, schedule, cfg, 2, model, tx, mesh=mesh)
    curves[name] = losses
print(json.dumps({"devices": len(jax.devices()), **curves}))
"""


def test_jax_data_parallel_matches_one_device() -> None:
    """2 CPU devices, batch split, params replicated: the same loss curve as one device (dropout on)."""
    import json
    import os
    import subprocess
    import sys

    # LLVM at -O0 halves XLA:CPU compile times; the computation is unchanged.
    flags = "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
    env = {**os.environ, "XLA_FLAGS": flags}
    out = subprocess.run([sys.executable, "-c", JAX_DATA_PARALLEL], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == 2
    np.testing.assert_allclose(result["sharded"], result["single"], rtol=1e-5)


def test_torch_ddp_matches_one_process(tmp_path: Path) -> None:
    """torchrun, 2 processes, gloo: each rank trains on half the global batch, DDP averages the
    gradients, so the loss curve equals one process on the whole batch (dropout off: masks are
    drawn per shard)."""
    config = tmp_path / "tiny_no_dropout.yaml"
    config.write_text(yaml.safe_dump({**TINY, "dropout": 0.0}))
    one = replace(CFG, config=str(config), steps=3, out=str(tmp_path / "one"))
    single = ttrain.train(one)
    ddp = torchrun_train(replace(one, distributed="ddp", out=str(tmp_path / "ddp")))
    np.testing.assert_allclose(ddp, single, rtol=1e-5)


def test_speed_line_leaves_out_the_first_step() -> None:
    line = speed_line("jax tiny full", np.array([30.0, 1.0, 4.0, 2.0]))
    assert line == (
        "jax tiny full: 4 step(s); first 30.00 s (compile/warm-up); then median 2.000 s/step = 0.50 steps/s over 3"
    )
    assert speed_line("t", np.array([3.0])) == "t: 1 step(s); first 3.00 s (compile/warm-up)"
