"""Training loops: checkpointing leaves the loss curve unchanged, torch == JAX, learning, resume, CLI.

Kept fast: the tiny spec, batch 4, one thread for torch, JAX parameters converted from a seeded
torch model (see `tests.helpers.training`). Run folders, checkpoints and their faults: test_train_runs.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields, replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from jax_impl import train as jtrain
from shared_configs import load_spec, spec_from_dict
from shared_configs.training.config import TrainConfig
from shared_configs.training.ddpm import make_schedule
from shared_configs.training.outputs import speed_line
from tests.helpers.processes import torchrun_train
from tests.helpers.training import CFG, TINY_NO_DROPOUT, jax_curve, torch_curve
from torch_impl import train as ttrain


@pytest.mark.slow_for("jax")
@pytest.mark.parametrize("curve", [torch_curve, jax_curve], ids=["torch", "jax"])
def test_checkpointing_keeps_the_loss_curve(curve) -> None:
    spec = load_spec("tiny")
    assert spec.dropout > 0  # dropout is on: the masks must be replayed on recompute
    plain, full = curve(spec, "none", 10), curve(spec, "full", 10)
    np.testing.assert_allclose(full, plain, rtol=1e-6)


@pytest.mark.slow
def test_torch_and_jax_loss_curves_agree() -> None:
    spec = spec_from_dict(TINY_NO_DROPOUT)
    np.testing.assert_allclose(jax_curve(spec, "none", 10), torch_curve(spec, "none", 10), rtol=1e-4)


@pytest.mark.slow
def test_loss_halves_on_digits(tmp_path: Path) -> None:
    cfg = TrainConfig(batch_size=16, steps=80, lr=2e-3, out=str(tmp_path), sample_steps=2, num_samples=2)
    losses = ttrain.train(cfg)
    assert np.mean(losses[-10:]) <= 0.5 * np.mean(losses[:5]), (losses[:5], losses[-10:])
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {".lock", "checkpoint-00000080", "loss.png", "samples.png", "losses.json"}


# The whole loop in-process; JAX's compiles its init and step from scratch (minutes on a loaded box):
# heavy, JAX's resume being checked in the default run by tests/test_train_jax_processes.py.
@pytest.mark.parametrize("framework", [ttrain, pytest.param(jtrain, marks=pytest.mark.heavy)], ids=["torch", "jax"])
def test_resume_continues_the_curve(framework, tmp_path: Path) -> None:
    """Through the whole loop: a checkpoint (DCP / orbax) at step 2, resumed to 4, equals 4 straight."""
    cfg = replace(CFG, steps=4, checkpoint_every=2)
    whole = framework.train(replace(cfg, out=str(tmp_path / "whole")))
    part = replace(cfg, steps=2, out=str(tmp_path / "part"))
    assert framework.train(part) == whole[:2]
    assert framework.train(replace(part, steps=4, resume=True)) == whole
    assert json.loads((tmp_path / "part" / "losses.json").read_text()) == whole  # JAX writes it too


@pytest.mark.parametrize("main", [ttrain.main, jtrain.main], ids=["torch", "jax"])
@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--steps", "0"], "--steps"),
        (["--lr", "x"], "--lr"),
        (["--lr", "inf"], "--lr"),
        (["--lr", "nan"], "--lr"),
        (["--weight-decay", "-1"], "--weight-decay"),
        (["--seed", "-1"], "--seed"),
        (["--timesteps", "10"], "--timesteps 10"),
        (["--resume", "--overwrite"], "--overwrite"),
        (["--config", "nope"], "nope"),
        (["--policy", "bogus"], "bogus"),
        (["--data", "mnist"], "--data"),
        (["--resume"], "--resume"),
    ],
)
def test_bad_input_is_one_line(main, argv: list[str], flag: str, tmp_path: Path, capsys) -> None:
    try:
        code = main([*argv, "--out", str(tmp_path / "none")])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m ") and ".train: error: " in err and "\n" not in err and flag in err, err


def test_short_linear_schedule_names_the_smallest_valid_timesteps(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        ttrain.main(["--timesteps", "20"])
    assert exit_.value.code == 2 and "the smallest valid value is 21" in capsys.readouterr().err
    make_schedule("linear", 21)  # betas up to 0.952: accepted
    make_schedule("cosine", 2)  # clipped to 0.999: any length is valid


@pytest.mark.slow
def test_torch_ddp_matches_one_process(tmp_path: Path) -> None:
    """torchrun, 2 processes, gloo: each rank trains on half the global batch, DDP averages the
    gradients, so the loss curve equals one process on the whole batch (dropout off: masks are
    drawn per shard)."""
    config = tmp_path / "tiny_no_dropout.yaml"
    config.write_text(yaml.safe_dump(TINY_NO_DROPOUT))
    one = replace(CFG, config=str(config), steps=3, out=str(tmp_path / "one"))
    single = ttrain.train(one)
    ddp = torchrun_train(replace(one, distributed="ddp", out=str(tmp_path / "ddp")))
    np.testing.assert_allclose(ddp, single, rtol=1e-5)


def _flags(options: type) -> set[str]:
    """The flags of a framework's own options (`shared_configs.training.config.Options`), one per field."""
    return {"--" + f.name.replace("_", "-") for f in fields(options)}


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_the_docs_flag_table_is_the_help(framework: str, capsys: pytest.CaptureFixture[str]) -> None:
    train = {"torch": ttrain, "jax": jtrain}[framework]
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    flags = set(re.findall(r"(--[a-z][a-z-]+)", capsys.readouterr().out)) - {"--help"}
    docs = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    table = {line.split("`")[1] for line in docs.splitlines() if line.startswith("| `--")}
    jax_only, torch_only = _flags(jtrain.JaxOptions), _flags(ttrain.TorchOptions)
    launch = {"--coordinator", "--num-processes", "--process-id"}
    assert jax_only == {"--attention-chunk", "--jax-cache", *launch} and torch_only == {"--compile"}
    assert flags == (table - torch_only if framework == "jax" else table - jax_only)


def test_speed_line_leaves_out_the_first_step() -> None:
    line = speed_line("jax tiny full", np.array([30.0, 1.0, 4.0, 2.0]))
    assert line == (
        "jax tiny full: 4 step(s); first 30.00 s (compile/warm-up); then median 2.000 s/step = 0.50 steps/s over 3"
    )
    assert speed_line("t", np.array([3.0])) == "t: 1 step(s); first 3.00 s (compile/warm-up)"
