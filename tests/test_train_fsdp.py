"""FSDP2 (`fully_shard`) with our checkpointing in `torch_impl.train`: one process's curve, resume, CLI.

The torchrun tests run 2 gloo processes on the tiny spec without dropout (masks are drawn per
shard, so they would differ from one process's), batch 4, policy ``full``; each launch spends
most of its ~10 s starting interpreters and the process group, so the tests share launches.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import set_checkpoint_early_stop

from shared_configs import load_spec
from shared_configs.training import TrainConfig, parse_args
from tests.test_torch_checkpointing import _flops
from tests.test_train import CFG, _one_thread, torch_model  # noqa: F401  (_one_thread: autouse fixture)
from tests.utils import TINY, rel_err, torchrun_train
from torch_impl import train as ttrain
from torch_impl.checkpointing import checkpointed_names


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> TrainConfig:
    config = tmp_path_factory.mktemp("spec") / "tiny_no_dropout.yaml"
    config.write_text(yaml.safe_dump({**TINY, "dropout": 0.0}))
    return replace(CFG, config=str(config), policy="full", steps=4)


@pytest.fixture(scope="module")
def single(base: TrainConfig, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of one process on the whole global batch."""
    out = tmp_path_factory.mktemp("one")
    ttrain.train(replace(base, out=str(out)))
    return out


@pytest.fixture(scope="module")
def fsdp(base: TrainConfig, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output folder of 2 processes under FSDP2, each on half the global batch, uninterrupted."""
    out = tmp_path_factory.mktemp("fsdp")
    torchrun_train(replace(base, distributed="fsdp", out=str(out)))
    return out


def losses(out: Path) -> list[float]:
    return json.loads((out / "losses.json").read_text())


def first_moments(out: Path) -> np.ndarray:
    """AdamW's exp_avg of every parameter, concatenated: linear in the gradients."""
    state = torch.load(out / ttrain.CHECKPOINT, weights_only=True)["optimizer"]["state"]
    return torch.cat([state[i]["exp_avg"].flatten() for i in sorted(state)]).numpy()


def test_fsdp_matches_one_process(fsdp: Path, single: Path) -> None:
    """Gradients reduce-scattered as means over equal shards: the global-batch mean's update."""
    np.testing.assert_allclose(losses(fsdp), losses(single), rtol=1e-5)
    # AdamW's update hardly depends on the gradients' scale, so the curve would not show a sum
    # posing as a mean (relative error 1); the first moments, linear in the gradients, do.
    assert rel_err(first_moments(fsdp), first_moments(single)) < 1e-4


def test_fsdp_resume_continues_the_curve(base: TrainConfig, fsdp: Path, tmp_path: Path) -> None:
    part = replace(base, distributed="fsdp", steps=2, out=str(tmp_path))
    first = torchrun_train(part)
    # Saved in the single-process format: a plain model and optimizer load it as they are.
    model, _, optimizer = ttrain.build(base)
    assert ttrain.load_checkpoint(tmp_path / ttrain.CHECKPOINT, model, optimizer) == (2, first)
    assert torchrun_train(replace(part, steps=4, resume=True)) == losses(fsdp)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("plan_first", [True, False], ids=["plan_then_shard", "shard_then_plan"])
@pytest.mark.usefixtures("one_rank_group")
def test_checkpointing_survives_fully_shard(plan_first: bool) -> None:
    """Either order: the backward recomputes exactly every block's forward (FLOPs counted)."""
    model = torch_model(load_spec("tiny"))
    model.eval()  # FLOPs do not depend on dropout
    with set_checkpoint_early_stop(False):  # the recompute is then exactly the block's forward
        plain_total, forward_per_module = _flops(model, backward=True)[0], _flops(model, backward=False)[1]
        if plan_first:
            model.enable_gradient_checkpointing("full")
        ttrain.shard_blocks(model)
        if not plan_first:
            model.enable_gradient_checkpointing("full")
        assert isinstance(model.mid, FSDPModule)
        assert checkpointed_names(model) == model.block_names()
        total, _ = _flops(model, backward=True)
    assert total - plain_total == sum(forward_per_module[name] for name in model.block_names())


@pytest.mark.parametrize("argv, mode", [([], None), (["--distributed"], "ddp"), (["--distributed", "fsdp"], "fsdp")])
def test_distributed_flag(argv: list[str], mode: str | None) -> None:
    assert parse_args(argv, "torch_impl").distributed == mode


def test_jax_refuses_fsdp(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(["--distributed"], "jax_impl").distributed == "ddp"
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--distributed", "fsdp"], "jax_impl")
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --distributed fsdp: jax_impl.train") and "\n" not in err, err


def test_fsdp_outside_torchrun_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert ttrain.main(["--distributed", "fsdp", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --distributed fsdp: launch with torchrun") and "\n" not in err, err
