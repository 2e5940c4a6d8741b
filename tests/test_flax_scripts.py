"""diffusers v0.39.0's Flax training scripts (tests/data/diffusers_v0_39), patched by docs/examples/flax/*.diff, in
the old Flax stack (.venv-flax: .ci/flax-env builds it) on a tiny Stable Diffusion built here
(tests/helpers/flax_scripts.py), on the CPU. Per script: the patch applies with ``patch -p1`` and adds at most 8
lines; the unpatched script's first loss equals the patched one's (1e-5: diffusers' Flax U-Net is not its PyTorch
one, docs/flax_users.md); at a budget halfway between the step's compiled peaks under ``full`` and ``none``, the
plan's compiled peak fits and the loss curve equals the unbudgeted run's (1e-6 over 6 steps); the saved U-Net or
ControlNet loads in diffusers 0.39's Flax class and, with outputs within 1e-5 of the drop-in's, in diffusers' current
PyTorch class. Heavy: minutes each.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_impl
from tests.helpers.flax_scripts import BATCH, SIZE
from tests.helpers.tensors import rel_err

ROOT = Path(__file__).parents[1]
PYTHON = ROOT / ".venv-flax" / "bin" / "python"
pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(not PYTHON.exists(), reason=".venv-flax is absent: .ci/flax-env builds the old Flax stack"),
]
STEPS = 6
ARGS = {
    "train_text_to_image_flax": "--train_data_dir {root}/images --train_batch_size {batch}",
    "train_dreambooth_flax": "--instance_data_dir {root}/instance --instance_prompt abc --with_prior_preservation "
    "--class_data_dir {root}/class --class_prompt def --num_class_images {half} --train_batch_size {half}",
    "train_controlnet_flax": "--train_data_dir {root}/controlnet_data --load_from_disk --image_column image "
    "--caption_column text --conditioning_image_column conditioning_image --train_batch_size {batch} --report_to tb",
}
SAVED = {"train_text_to_image_flax": "unet", "train_dreambooth_flax": "unet", "train_controlnet_flax": ""}
_LOSS = re.compile(r"Loss: ([0-9.e+-]+)\)")
_PLAN = re.compile(r"remat budget: plan (\S+); the compiled step peaks at ([0-9.]+) MiB of the ([0-9.]+) MiB budget")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The tiny pipeline, data and hub stand-ins, and the environment the scripts run in (nothing downloaded)."""
    root = tmp_path_factory.mktemp("flax_scripts")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(root / "hf"), "HF_HUB_CACHE": str(root / "hub")}
    env |= {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "cse_barrier" not in f)
    cmd = [str(PYTHON), "-m", "tests.helpers.flax_scripts", "build", str(root)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return root, env


def _run(env: dict[str, str], script: Path, args: list[str], peaks: bool = False) -> str:
    """The script's output (stdout and stderr) in the old stack; its traceback's end when it fails."""
    run = {**env, "PEAKS": "1"} if peaks else env
    cmd = [str(PYTHON), "-m", "tests.helpers.flax_scripts", "run", str(script), *args]
    done = subprocess.run(cmd, env=run, capture_output=True, text=True, cwd=script.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def _losses(out: str) -> list[float]:
    return [float(v) for v in _LOSS.findall(out)]


@pytest.mark.parametrize("name", list(ARGS))
def test_patched_script_trains_to_the_budget(name: str, pipeline: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    root, env = pipeline
    diff = ROOT / "docs/examples/flax" / f"{name}.diff"
    added = [line for line in diff.read_text().splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert len(added) <= 8, added
    shutil.copy(ROOT / "tests/data/diffusers_v0_39" / f"{name}.py", tmp_path)
    subprocess.run(["patch", "-p1", "-i", str(diff)], cwd=tmp_path, check=True, capture_output=True)
    common = ["--pretrained_model_name_or_path", str(root / "sd"), "--resolution", str(SIZE), "--seed", "0"]
    common += ARGS[name].format(root=root, batch=BATCH, half=BATCH // 2).split()
    original = _run(
        env,
        ROOT / "tests/data/diffusers_v0_39" / f"{name}.py",
        [*common, "--max_train_steps", "1", "--output_dir", str(tmp_path / "o")],
    )
    six = [*common, "--max_train_steps", str(STEPS)]
    plain = _run(env, tmp_path / f"{name}.py", [*six, "--output_dir", str(tmp_path / "plain")], peaks=True)
    peaks = json.loads(plain.split("PEAKS ", 1)[1].splitlines()[0])
    assert peaks["full"] < peaks["none"], peaks
    budget = (peaks["none"] + peaks["full"]) / 2 / 2**20
    out = tmp_path / "budget"
    budgeted = _run(env, tmp_path / f"{name}.py", [*six, "--output_dir", str(out), "--remat_budget_mib", f"{budget}"])
    plan, compiled, said_budget = _PLAN.search(budgeted).groups()
    curve, reference = _losses(budgeted), _losses(plain)
    print(
        f"\n{name}: +{len(added)} lines; compiled peaks none {peaks['none'] / 2**20:.2f} MiB, full "
        f"{peaks['full'] / 2**20:.2f} MiB; budget {budget:.2f} MiB: plan {plan} at {compiled} MiB; first loss "
        f"{_losses(original)[0]} unpatched, {reference[0]} patched; curve {reference}; budgeted {curve}"
    )
    assert float(compiled) <= float(said_budget) and abs(float(said_budget) - budget) < 0.05
    assert abs(reference[0] - _losses(original)[0]) <= 1e-5 * abs(reference[0])
    assert len(curve) == len(reference) == STEPS
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(curve, reference, strict=True)), (curve, reference)
    _check_saved(out / SAVED[name], name == "train_controlnet_flax", env)


def _check_saved(folder: Path, controlnet: bool, env: dict[str, str]) -> None:
    """The trained model's folder in diffusers 0.39's Flax class (every parameter) and in diffusers' current
    PyTorch class (its outputs equal the drop-in's, 1e-5)."""
    import diffusers

    cls = "FlaxControlNetModel" if controlnet else "FlaxUNet2DConditionModel"
    load = f"import jax, diffusers; print(len(jax.tree.leaves(diffusers.{cls}.from_pretrained({str(folder)!r})[1])))"
    done = subprocess.run([str(PYTHON), "-c", load], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 4, SIZE // 8, SIZE // 8)).astype(np.float32)
    t, context = np.array([3, 517], np.int32), rng.normal(size=(2, 16, 32)).astype(np.float32)
    inputs: tuple[Any, ...] = (x, t, context)
    if controlnet:
        inputs += (rng.uniform(size=(2, 3, SIZE, SIZE)).astype(np.float32),)
        torch_net = diffusers.ControlNetModel.from_pretrained(folder).eval()
        model, params = jax_impl.FlaxControlNetModel.from_pretrained(folder)
    else:
        torch_net = diffusers.UNet2DConditionModel.from_pretrained(folder).eval()
        model, params = jax_impl.FlaxUNet2DConditionModel.from_pretrained(folder)
    assert int(done.stdout.split()[-1]) == len(jax.tree.leaves(params))
    ours = jax.jit(model.apply)({"params": params}, *inputs)
    with torch.no_grad():
        theirs = torch_net(*map(torch.from_numpy, inputs), return_dict=False)
    if controlnet:  # the residuals: ours NHWC, PyTorch's NCHW
        for a, b in zip(
            [*ours.down_block_res_samples, ours.mid_block_res_sample], [*theirs[0], theirs[1]], strict=True
        ):
            assert rel_err(jnp.transpose(a, (0, 3, 1, 2)), b.numpy()) < 1e-5
    else:
        assert rel_err(ours.sample, theirs[0].numpy()) < 1e-5
