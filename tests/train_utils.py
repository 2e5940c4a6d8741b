"""Helpers of the training tests (a plain module, not a test module): seeded models, short curves.

Kept fast: the tiny spec, batch 4, one thread for torch, and the JAX parameters converted from a
seeded torch model (a jitted Flax init costs as much as compiling the step). The JAX tests share
one compiled step per (model, optimizer) pair: `make_optimizer` is cached, models compare equal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import jax
import pytest
import torch

from jax_impl import checkpoint_io as jio
from jax_impl import regime as jregime
from jax_impl import train as jtrain
from jax_impl.checkpoint_io import abstract_target
from jax_impl.convert import torch_to_flax_variables
from jax_impl.unet import UNet as FlaxUNet
from shared_configs import UNetSpec, load_spec
from shared_configs.training.config import TrainConfig
from shared_configs.training.data import load_dataset, step_seed
from shared_configs.training.ddpm import make_schedule
from shared_configs.training.loop import manifest_for
from shared_configs.training.run_folder import LOCK, checkpoints
from tests.utils import FAST_COMPILE, TINY, count_flops
from torch_impl import checkpoint_io as tio
from torch_impl import train as ttrain
from torch_impl.unet import UNet as TorchUNet

SCHEDULE = make_schedule("linear", 1000)
CFG = TrainConfig(batch_size=4, lr=1e-3, weight_decay=0.01, seed=0, sample_steps=0)
# Dropout off where torch and JAX (or processes, or devices) must draw the same masks: they do not.
TINY_NO_DROPOUT = {**TINY, "name": "tiny_nodrop", "dropout": 0.0}
TINY_BN = {**TINY, "name": "tiny_bn", "norm_kind": "batch", "dropout": 0.0}


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
    model, tx = FlaxUNet(spec=spec, policy=policy), jregime.make_optimizer(CFG.lr, CFG.weight_decay)
    variables = torch_to_flax_variables(torch_model(spec).state_dict(), spec)
    return model, tx, jtrain.TrainState.create(jax.tree.map(jax.numpy.asarray, variables), tx)


def jax_train(spec: UNetSpec, policy: str, steps: int) -> tuple[jtrain.TrainState, list[float]]:
    model, tx, state = jax_setup(spec, policy)
    losses: list[float] = []
    state = jtrain.run_steps(state, losses, load_dataset("digits", spec), SCHEDULE, CFG, steps, model, tx)
    return state, losses


def jax_curve(spec: UNetSpec, policy: str, steps: int) -> list[float]:
    return jax_train(spec, policy, steps)[1]


def step_flops(model: TorchUNet, backward: bool) -> tuple[int, dict[str, int]]:
    """`tests.utils.count_flops` on a training batch of 2."""
    noisy, t, _, conditioning = ttrain.as_tensors(load_dataset("digits", model.spec).batch(0, 2, SCHEDULE, 0))
    return count_flops(model, (noisy, t, *conditioning.values()), backward)


def float_dtypes(tree: object) -> list[str]:
    """The dtypes of the floating leaves of ``tree`` (optax's integer step count left out)."""
    return sorted({str(a.dtype) for a in jax.tree.leaves(tree) if jax.numpy.issubdtype(a.dtype, jax.numpy.floating)})


def jax_restore_target(state: object) -> object:
    """``state`` as the target of `jax_impl.checkpoint_io.load_checkpoint`: its shapes, dtypes, shardings."""
    return abstract_target(state, jax.tree.map(lambda a: a.sharding, state))


def two_devices_env() -> dict[str, str]:
    """This environment with 2 forced CPU devices and XLA's backend optimisation off (`FAST_COMPILE`)."""
    flags = [f"--{k}={str(v).lower()}" for k, v in FAST_COMPILE.items()]
    return {**os.environ, "XLA_FLAGS": " ".join(["--xla_force_host_platform_device_count=2", *flags])}


def jax_on_two_devices(script: str, *args: str) -> dict:
    """``python -c script *args`` on 2 forced CPU devices, compiled with backend optimisation off
    (`FAST_COMPILE`: values unchanged, ~4x faster); its last stdout line, parsed as JSON."""
    cmd, root = [sys.executable, "-c", script, *args], Path(__file__).parents[1]
    out = subprocess.run(cmd, env=two_devices_env(), cwd=root, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == 2
    return result


# ---- run folders: the training CLIs in this process, and saved runs ----

MAINS = {"torch": ttrain.main, "jax": jtrain.main}
RUN = replace(CFG, steps=4, checkpoint_every=1)  # the flags of every run below, as a command line
LOSSES = [1.0, 0.5]  # the saved runs are at step 2


def argv(cfg: TrainConfig, *extra: str) -> list[str]:
    """The training CLI's flags for ``cfg`` (no sampling), then ``extra``."""
    flags = ["--batch-size", cfg.batch_size, "--lr", cfg.lr, "--weight-decay", cfg.weight_decay, "--seed", cfg.seed]
    flags += ["--steps", cfg.steps, "--checkpoint-every", cfg.checkpoint_every, "--sample-steps", 0, "--out", cfg.out]
    return [str(f) for f in flags] + list(extra)


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
    """``err`` is one error line of a training CLI, holding each of ``parts``; ``code`` is ``status``."""
    assert code == status, err
    assert err.startswith("python -m ") and ".train: error: " in err and "\n" not in err and "Traceback" not in err, err
    for part in parts:
        assert part in err, (part, err)


# ---- real runs in their own process, signalled from outside ----


def start(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A training run in a process group of its own (killed as a group if the test fails)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip


def signal_at_first_checkpoint(proc: subprocess.Popen[str], out: Path, sig: int, rank: int | None = None) -> None:
    """Send ``sig`` to ``proc`` (or to its child of torchrun rank ``rank``) once ``out`` holds a
    checkpoint or one being written: the loop runs (so the stop is after step 1, or 2 if missed)."""
    deadline = time.monotonic() + 300
    while not (checkpoints(out) or list(out.glob(".checkpoint-*.tmp"))):
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"no checkpoint in {out}: {proc.communicate()[1][-2000:]}")
        time.sleep(0.02)
    os.kill(proc.pid if rank is None else rank_pid(proc.pid, rank), sig)


def rank_pid(launcher: int, rank: int) -> int:
    """The pid of torchrun's worker of ``rank`` (its environment says RANK)."""
    children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    environ = {int(c): Path(f"/proc/{c}/environ").read_bytes().split(b"\0") for c in children}
    (pid,) = [c for c, env in environ.items() if f"RANK={rank}".encode() in env]
    return pid


def finish(proc: subprocess.Popen[str], timeout: float = 300) -> tuple[int, list[str]]:
    """(exit status, the non-blank lines of stderr) of a run `start` started."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, [line for line in err.splitlines() if line.strip()]
