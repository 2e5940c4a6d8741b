"""Training in the test process: seeded models, short curves, the CLIs' flags, run folders.

Kept fast: the tiny spec, batch 4, one thread for torch, and the JAX parameters converted from a
seeded torch model (a jitted Flax init costs as much as compiling the step). The JAX tests share
one compiled step per (model, optimizer) pair: `make_optimizer` is cached, models compare equal.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import jax
import pytest
import torch

from jax_impl import checkpoint_io as jio
from jax_impl import regime as jregime
from jax_impl import step as jstep
from jax_impl import train as jtrain
from jax_impl.checkpoint_io import abstract_target
from jax_impl.convert import torch_to_flax_variables
from jax_impl.unet import UNet as FlaxUNet
from shared_configs import UNetSpec, load_spec
from shared_configs.training.config import TrainConfig, flags_of
from shared_configs.training.data import load_dataset, step_seed
from shared_configs.training.ddpm import make_schedule
from shared_configs.training.loop import manifest_for
from shared_configs.training.run_folder import LOCK
from tests.helpers.specs import TINY
from tests.helpers.tensors import count_flops
from torch_impl import checkpoint_io as tio
from torch_impl import train as ttrain
from torch_impl.step import as_tensors
from torch_impl.unet import UNet as TorchUNet

SCHEDULE = make_schedule("linear", 1000)
CFG = TrainConfig(batch_size=4, lr=1e-3, weight_decay=0.01, seed=0, sample_steps=0)
# Dropout off where torch and JAX (or processes, or devices) must draw the same masks: they do not.
TINY_NO_DROPOUT = {**TINY, "name": "tiny_nodrop", "dropout": 0.0}
TINY_BN = {**TINY, "name": "tiny_bn", "norm_kind": "batch", "dropout": 0.0}


def run_steps(
    state: jstep.TrainState,
    losses: list[float],
    dataset,
    schedule,
    cfg: TrainConfig,
    stop: int,
    model: FlaxUNet,
    tx,
    mesh=None,
) -> jstep.TrainState:
    """Steps ``len(losses) .. stop - 1`` of ``model`` (`jax_impl.step.make_step`), appending each loss."""
    step = jstep.make_step(cfg, jstep.Trainee(model), tx, dataset, schedule, mesh)
    for index in range(len(losses), stop):
        state, loss = step(state, index)
        losses.append(loss)
    return state


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


def jax_setup(spec: UNetSpec, policy: str) -> tuple[FlaxUNet, object, jstep.TrainState]:
    """The Flax model, optimizer, and train state (params, opt_state, batch_stats) converted from
    the seeded torch model."""
    model, tx = FlaxUNet(spec=spec, policy=policy), jregime.make_optimizer(CFG.lr, CFG.weight_decay)
    variables = torch_to_flax_variables(torch_model(spec).state_dict(), spec)
    return model, tx, jstep.TrainState.create(jax.tree.map(jax.numpy.asarray, variables), tx)


def jax_train(spec: UNetSpec, policy: str, steps: int) -> tuple[jstep.TrainState, list[float]]:
    model, tx, state = jax_setup(spec, policy)
    losses: list[float] = []
    state = run_steps(state, losses, load_dataset("digits", spec), SCHEDULE, CFG, steps, model, tx)
    return state, losses


def jax_curve(spec: UNetSpec, policy: str, steps: int) -> list[float]:
    return jax_train(spec, policy, steps)[1]


def step_flops(model: TorchUNet, backward: bool) -> tuple[int, dict[str, int]]:
    """`tests.helpers.tensors.count_flops` on a training batch of 2."""
    noisy, t, _, conditioning = as_tensors(load_dataset("digits", model.spec).batch(0, 2, SCHEDULE, 0))
    return count_flops(model, (noisy, t, *conditioning.values()), backward)


def float_dtypes(tree: object) -> list[str]:
    """The dtypes of the floating leaves of ``tree`` (optax's integer step count left out)."""
    return sorted({str(a.dtype) for a in jax.tree.leaves(tree) if jax.numpy.issubdtype(a.dtype, jax.numpy.floating)})


def jax_restore_target(state: object) -> object:
    """``state`` as the target of `jax_impl.checkpoint_io.load_checkpoint`: its shapes, dtypes, shardings."""
    return abstract_target(state, jax.tree.map(lambda a: a.sharding, state))


def train_argv(cfg: TrainConfig, *extra: str) -> list[str]:
    """The ``{torch_impl,jax_impl}.train`` flags that reproduce ``cfg`` (each flag is named as its
    field, the regime's and the framework's own options' flattened in; options None: none given),
    then ``extra`` (a flag given again there wins: argparse keeps the last)."""
    argv: list[str] = []
    for name, value in flags_of(cfg).items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    return [*argv, *extra]


# ---- run folders: the training CLIs in this process, and saved runs ----

MAINS = {"torch": ttrain.main, "jax": jtrain.main}
RUN = replace(CFG, steps=4, checkpoint_every=1)  # the flags of every run below, as a command line
LOSSES = [1.0, 0.5]  # the saved runs are at step 2


def cli(framework: str, args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """(exit status, stderr) of a training CLI; bad flags exit through SystemExit."""
    try:
        code = MAINS[framework](args)
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err.strip()


def saved_run(framework: str, out: Path) -> Path:
    """A run folder holding a checkpoint of step 2 (fresh weights: nothing trains)."""
    cfg, spec = replace(RUN, out=str(out)), load_spec(RUN.config)
    if framework == "torch":
        model, _, optimizer = ttrain.build(cfg)
        return tio.save_checkpoint(out, model, optimizer, manifest_for(cfg, spec, tio.FRAMEWORK, tio.LAYOUT, LOSSES))
    state = jax_setup(spec, "none")[2]
    return jio.save_checkpoint(out, state, manifest_for(cfg, spec, jio.FRAMEWORK, jio.LAYOUT, LOSSES))


def snapshot(out: Path) -> dict[str, bytes]:
    """Every file under ``out`` (temp files included), but the lock, by path: what a fault must not change."""
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != LOCK}


def assert_one_line(code: int, err: str, status: int, *parts: str) -> None:
    """``err`` ends in one error line of a training CLI, holding each of ``parts`` (the loop's own log
    lines, such as its loss off a terminal, may come before it); ``code`` is ``status``."""
    assert code == status, err
    error = err.splitlines()[-1] if err else ""
    assert error.startswith("python -m ") and ".train: error: " in error and "Traceback" not in err, err
    for part in parts:
        assert part in error, (part, err)
