"""``--controlnet`` on both training CLIs: the ControlNet trained against the frozen U-Net, each
sample's edge map as the conditioning image. A pair plan keeps the loss curve and a resume continues
it (torch, through the loop); torch and JAX train to the same losses from the same weights (the
torch pair converted); the JAX loop's resume continues its own curve; ``--budget-mib`` runs the torch
steps under the `BudgetGuard` of the pair; what does not combine is one line.

Kept fast: tiny (8x8), batch 4, 2-4 steps; JAX compiles the pair's step once for all its runs (the
same model and optimizer objects), with XLA's backend optimisation off (tests/conftest.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from shared_configs.pair import controlnet_pair, load_step_dataset
from shared_configs.training.data import control_image, load_dataset
from shared_configs.training.run_folder import checkpoints
from tests.helpers.training import CFG, SCHEDULE, TINY_NO_DROPOUT, assert_one_line, cli, train_argv
from torch_impl import train as ttrain

PAIR_CFG = replace(CFG, controlnet=True, steps=4, checkpoint_every=2)
MIXED = "controlnet.down.0,up.1;controlnet.mid.resnets.1,controlnet.down.1.attentions.0,up.0/save=conv,matmul"


def test_the_conditioning_image_is_each_samples_edge_map() -> None:
    """Against a hand-made image: a bright square's border is the map, upsampled, on every channel."""
    spec = controlnet_pair("tiny").controlnet  # 3 channels at 8x the sample
    image = -np.ones((1, 4, 8, 8), np.float32)
    image[:, :, 2:5, 2:5] = 1.0
    edges = np.zeros((8, 8), np.float32)
    edges[1, 2:5] = edges[2:5, 1] = 1  # jumps up to the square (to the right / below)
    edges[2:5, 4] = edges[4, 2:5] = 1  # jumps down from it
    cond = control_image(image, spec)
    assert cond.shape == (1, 3, 64, 64) and cond.dtype == np.float32
    for channel in cond[0]:
        np.testing.assert_array_equal(channel, np.kron(edges, np.ones((8, 8))))
    data = load_step_dataset("digits", controlnet_pair("tiny"))
    first, again = data.batch(3, 4, SCHEDULE, 0), data.batch(3, 4, SCHEDULE, 0)
    np.testing.assert_array_equal(first.controlnet_cond, again.controlnet_cond)  # a function of (seed, step)
    plain = load_dataset("digits", controlnet_pair("tiny").unet).batch(3, 4, SCHEDULE, 0)
    np.testing.assert_array_equal(first.noisy, plain.noisy)  # the U-Net's batch as it was


@pytest.mark.slow
def test_a_pair_plan_keeps_the_curve_and_a_resume_continues_it(tmp_path: Path) -> None:
    """tiny has dropout (in the ControlNet): a plan recomputing units of both networks must replay it."""
    whole = ttrain.train(replace(PAIR_CFG, out=str(tmp_path / "whole")))
    part = replace(PAIR_CFG, steps=2, policy=MIXED, out=str(tmp_path / "part"))
    np.testing.assert_allclose(ttrain.train(part), whole[:2], rtol=1e-6)
    np.testing.assert_allclose(ttrain.train(replace(part, steps=4, resume=True)), whole, rtol=1e-6)
    manifest = json.loads((checkpoints(tmp_path / "part")[-1][1] / "manifest.json").read_text())
    assert manifest["run"]["config"]["controlnet"] is True and manifest["run"]["config"]["policy"] == MIXED


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize(
    ("flags", "parts"),
    [
        (["--trainable", "lora:4"], ["--trainable", "not lora:4"]),
        (["--distributed"], ["--distributed: --controlnet trains in one process"]),
        (["--policy", "controlnet.up.0"], ["unknown unit 'controlnet.up.0'", "controlnet.mid"]),
    ],
)
def test_what_does_not_combine_is_one_line(
    framework: str, flags: list[str], parts: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--controlnet", "--steps", "1", "--out", str(tmp_path), *flags]
    code, err = cli(framework, args, capsys)
    assert_one_line(code, err, 2, *parts)
    assert not any(tmp_path.iterdir()) or not checkpoints(tmp_path)


def test_a_controlnet_run_does_not_resume_a_u_net_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = replace(CFG, steps=1, out=str(tmp_path))
    ttrain.train(cfg)
    capsys.readouterr()
    code, err = cli("torch", train_argv(replace(cfg, steps=2), "--controlnet", "--resume"), capsys)
    assert_one_line(code, err, 2, "the command line differs from the run", ": --controlnet True (run: False)")


@pytest.mark.slow
def test_torch_and_jax_controlnet_curves_agree_and_jax_resumes(tmp_path: Path) -> None:
    """The torch CLI's loop against the JAX pair's step from the same weights (the torch pair
    converted: `jax_impl.convert`), dropout off; then the JAX CLI stopped at step 2 and resumed to 3
    continues the curve of its own init (`jax_impl.pair.init_pair`), stepped here without the CLI."""
    import jax

    from jax_impl import regime
    from jax_impl import step as jstep
    from jax_impl import train as jtrain
    from jax_impl.convert import torch_to_flax
    from jax_impl.pair import ControlNetPair, init_pair, pair_trainee
    from shared_configs.defaults import defaults
    from shared_configs.training.ddpm import make_schedule

    config = tmp_path / "tiny_nodrop.yaml"
    config.write_text(yaml.safe_dump(TINY_NO_DROPOUT))
    cfg = replace(PAIR_CFG, config=str(config), steps=3, out=str(tmp_path / "torch"))
    torch_losses = ttrain.train(cfg)
    pair, _, _ = ttrain.build(cfg)  # the seeded pair the torch run started from
    spec = pair.pair_spec
    # the JAX loop's model and optimizer (equal objects: one compile for every run below)
    model = ControlNetPair(spec=spec, policy="none", attention_chunk=defaults("cpu").attention_chunk)
    tx = regime.make_optimizer(cfg.lr, cfg.weight_decay, cfg.regime)
    params = torch_to_flax(pair.controlnet.state_dict(), spec.controlnet)
    state = jstep.TrainState.create({"params": jax.tree.map(jax.numpy.asarray, params)}, tx)
    unet = jax.tree.map(jax.numpy.asarray, torch_to_flax(pair.unet.state_dict(), spec.unet))
    dataset, schedule = load_step_dataset(cfg.data, spec, cfg.seed), make_schedule(cfg.schedule, cfg.timesteps)

    def curve(state: jstep.TrainState, unet_params: object, steps: int) -> list[float]:
        step, losses = jstep.make_step(cfg, pair_trainee(model, unet_params), tx, dataset, schedule), []
        for index in range(steps):
            state, loss = step(state, index)
            losses.append(loss)
        return losses

    jax_losses = curve(state, unet, 3)
    print(f"\ntorch {torch_losses}\njax   {jax_losses}")
    np.testing.assert_allclose(jax_losses, torch_losses, rtol=1e-4)

    own = curve(*init_pair(model, tx, cfg.seed, cfg.regime), 3)
    part = replace(cfg, steps=2, out=str(tmp_path / "jax"))
    np.testing.assert_allclose(jtrain.train(part), own[:2], rtol=1e-6)
    np.testing.assert_allclose(jtrain.train(replace(part, steps=3, resume=True)), own, rtol=1e-6)
