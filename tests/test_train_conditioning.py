"""Training and benchmarking the conditioned families: class labels (class-conditional DDPM) and
SDXL's text_time inputs (text_embeds, time_ids) reach both training steps and the benchmark.

The batches carry whatever the spec's forward takes (`shared_configs.training.data.Conditioner`); torch and
JAX, from converted weights, train to the same losses on them; a batch without an input its spec
takes is one line naming it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from jax_impl import step as jstep
from shared_configs import UNetSpec
from shared_configs.inputs import input_specs
from shared_configs.training.data import CONDITIONING, load_dataset
from tests.helpers.processes import rows_of, run_compare
from tests.helpers.specs import variant
from tests.helpers.tensors import rel_err
from tests.helpers.training import CFG, SCHEDULE, jax_curve, jax_setup, torch_curve, torch_model
from torch_impl import train as ttrain

# Trainable tiny variants: dropout off (torch and JAX draw different masks); the class-conditional
# one with out_channels == in_channels, as the noise-prediction objective needs.
SPECS = {
    "class_cond": {"in_channels": 4, "dropout": 0.0},
    "class_timestep_concat": {"dropout": 0.0},
    "sdxl_style": {"dropout": 0.0},
}


def _spec(family: str) -> UNetSpec:
    return variant(family, **SPECS[family])


@pytest.mark.parametrize("family", list(SPECS))
def test_batches_carry_every_input_the_spec_takes(family: str) -> None:
    spec = _spec(family)
    dataset = load_dataset("digits", spec)
    batch = dataset.batch(3, 4, SCHEDULE, seed=0)
    wanted = input_specs(spec, 4, context_len=1)
    for name in CONDITIONING:
        got = batch.conditioning()[name]
        assert (got is None) == (wanted[name] is None), name
        if got is not None:
            assert got.shape == wanted[name].shape and str(got.dtype) == wanted[name].dtype, name
    again = dataset.batch(3, 4, SCHEDULE, seed=0)  # a function of (seed, step)
    for a, b in zip(batch.conditioning().values(), again.conditioning().values(), strict=True):
        assert a is b is None or np.array_equal(a, b)
    if spec.class_embedding is not None and spec.class_embedding.num_classes:
        np.testing.assert_array_equal(batch.class_labels, batch.labels % spec.class_embedding.num_classes)
    halves = [batch.shard(rank, 2) for rank in (0, 1)]
    for name in CONDITIONING:
        if (whole := getattr(batch, name)) is not None:
            np.testing.assert_array_equal(np.concatenate([getattr(h, name) for h in halves]), whole)


def test_time_ids_are_sdxl_sizes_and_crops() -> None:
    spec = variant("sdxl_style", addition_embedding={"time_id_dim": 4, "input_dim": 38, "num_time_ids": 6})
    dataset = load_dataset("digits", spec)
    ids = dataset.batch(0, 8, SCHEDULE, seed=0).time_ids
    size = 8 * spec.sample_size  # pixels of the latent
    assert np.all(ids[:, 4:] == size) and np.all(ids[:, 2:4] <= size // 4) and np.all(ids[:, :2] >= size // 2)
    fixed = dataset.conditioning(np.arange(3))["time_ids"]  # sampling: a whole, uncropped image
    np.testing.assert_array_equal(fixed, [[size, size, 0, 0, size, size]] * 3)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["class_cond", "sdxl_style"])
def test_torch_and_jax_train_the_same_on_conditioned_batches(family: str) -> None:
    spec = _spec(family)
    torch_losses, jax_losses = torch_curve(spec, "none", 2), jax_curve(spec, "none", 2)
    assert rel_err(jax_losses, torch_losses) <= 1e-4, (jax_losses, torch_losses)


@pytest.mark.parametrize("name", ["class_labels", "time_ids"])
def test_a_batch_missing_an_input_is_one_line(name: str) -> None:
    spec = _spec("class_cond" if name == "class_labels" else "sdxl_style")
    batch = replace(load_dataset("digits", spec).batch(0, 2, SCHEDULE, 0), **{name: None})
    model = torch_model(spec)
    with pytest.raises(ValueError, match=f"^batch: spec '{spec.name}' takes {name} but the batch has none") as err:
        ttrain.train_step(model, ttrain.make_optimizer(model, 1e-3, 0.0), batch)
    assert "\n" not in str(err.value)
    flax_model, tx, state = jax_setup(spec, "none")
    with pytest.raises(ValueError, match=f"^batch: spec '{spec.name}' takes {name} but the batch has none"):
        jstep.train_step(state, jstep.arrays(batch), jax.random.key(0), model=flax_model, tx=tx)


def test_an_input_the_spec_does_not_take_is_refused() -> None:
    spec = _spec("class_cond")
    batch = load_dataset("digits", spec).batch(0, 2, SCHEDULE, 0)
    model = torch_model(spec)
    extra = replace(batch, text_embeds=np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"^batch: spec 'class_cond' takes no text_embeds but the batch has one"):
        ttrain.train_step(model, ttrain.make_optimizer(model, 1e-3, 0.0), extra)


@pytest.mark.slow
@pytest.mark.parametrize("family, framework", [("class_cond", "jax"), ("sdxl_style", "torch")])
def test_the_benchmark_runs_a_conditioned_spec(family: str, framework: str, tmp_path: Path) -> None:
    """Each framework's benchmark on one conditioned spec (both on both took 2.5 min of CI; the
    conditioning inputs come from the one `example_batch`, each model's use of them is parity-tested)."""
    config = tmp_path / f"{family}.yaml"
    config.write_text(yaml.safe_dump(_spec(family).model_dump(mode="json")))
    args = ["--config", str(config), "--framework", framework, "--batch-size", "2", "--steps", "1"]
    proc, doc = run_compare([*args, "--policies", "full", "--device", "cpu", "--timeline", "off"], tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert doc is not None
    rows = rows_of(doc, framework)
    assert {r["status"] for r in rows.values()} == {"ok"}, rows
    # At batch 2 the peak can be the static memory; what autodiff keeps shows the plan at work.
    assert rows["full"]["saved_bytes"] < rows["none"]["saved_bytes"]


def test_the_cli_trains_a_class_conditional_spec(tmp_path: Path) -> None:
    """The whole torch loop, sampling included (the sampler conditions on classes too)."""
    config = tmp_path / "class_cond.yaml"
    config.write_text(yaml.safe_dump(_spec("class_cond").model_dump(mode="json")))
    cfg = replace(CFG, config=str(config), steps=2, sample_steps=2, num_samples=2, out=str(tmp_path / "run"))
    losses = ttrain.train(cfg)
    assert len(losses) == 2 and all(np.isfinite(losses))
