"""FSDP2 (`fully_shard`) with our checkpointing in `torch_impl.train`: one process's curve, sharded
checkpoints (DCP) resumed on the same or another number of processes, CLI.

The torchrun tests run 2 gloo processes on the tiny spec without dropout (masks are drawn per
shard, so they would differ from one process's), batch 4, policy ``full``; each launch spends
most of its ~10 s starting interpreters and the process group, so the tests share launches.
"""

from __future__ import annotations

import importlib
import json
import shlex
import shutil
import signal
import sys
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
from shared_configs.training.config import TrainConfig
from shared_configs.training.run_folder import checkpoints
from tests.helpers.policies import checkpointed_names
from tests.helpers.processes import finish, signal_at_first_checkpoint, start, torchrun_train
from tests.helpers.tensors import rel_err
from tests.helpers.training import CFG, TINY_NO_DROPOUT, step_flops, torch_model, train_argv
from torch_impl import train as ttrain
from torch_impl.checkpoint_io import load_checkpoint
from torch_impl.parallel import shard_blocks


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> TrainConfig:
    config = tmp_path_factory.mktemp("spec") / "tiny_no_dropout.yaml"
    config.write_text(yaml.safe_dump(TINY_NO_DROPOUT))
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


def restore(out: Path, base: TrainConfig) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[float]]:
    """The latest checkpoint in ``out``, read by one process without a process group (plain model)."""
    model, _, optimizer = ttrain.build(base)
    manifest = load_checkpoint(checkpoints(out)[-1][1], model, optimizer)
    return model, optimizer, manifest.losses


def first_moments(out: Path, base: TrainConfig) -> np.ndarray:
    """AdamW's exp_avg of every parameter, concatenated: linear in the gradients."""
    state = restore(out, base)[1].state_dict()["state"]
    return torch.cat([state[i]["exp_avg"].flatten() for i in sorted(state)]).numpy()


@pytest.mark.slow
def test_fsdp_matches_one_process(base: TrainConfig, fsdp: Path, single: Path) -> None:
    """Gradients reduce-scattered as means over equal shards: the global-batch mean's update."""
    np.testing.assert_allclose(losses(fsdp), losses(single), rtol=1e-5)
    # AdamW's update hardly depends on the gradients' scale, so the curve would not show a sum
    # posing as a mean (relative error 1); the first moments, linear in the gradients, do.
    assert rel_err(first_moments(fsdp, base), first_moments(single, base)) < 1e-4


@pytest.mark.slow
def test_fsdp_stopped_by_a_signal_to_one_rank_resumes_the_curve(base: TrainConfig, fsdp: Path, tmp_path: Path) -> None:
    """SIGUSR1 to rank 1 alone, mid-run: both ranks stop after the same step (they agree each step),
    each writes its shards (DCP) and exits 138; 2 ranks resume them exactly, 1 process (no group) too."""
    part = replace(base, distributed="fsdp", steps=1000, checkpoint_every=1, out=str(tmp_path / "two"))
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = start([*launch, "-m", "torch_impl.train", *train_argv(part)])
    signal_at_first_checkpoint(proc, tmp_path / "two", signal.SIGUSR1, rank=1)
    code, lines = finish(proc)
    first = losses(tmp_path / "two")
    assert code != 0 and 1 <= len(first) < 4, (code, first)  # signalled while writing step 1 or 2
    assert [line for line in lines if "stopped by" in line] == [
        f"python -m torch_impl.train: stopped by SIGUSR1 after step {len(first)} of 1000; "
        f"checkpoint-{len(first):08d} and losses.json saved in {part.out}; resume with: torchrun --nproc-per-node 2 "
        f"-m torch_impl.train {shlex.join(train_argv(part))} --resume"
    ]  # rank 0's line only
    # torchrun's report: the first rank to exit, 138 (it stops the other if that one is still exiting).
    # Rarely that rank aborts after its stop line and checkpoint, in the C++ teardown of its process
    # group's threads ("terminate called without an active exception": -6); what it saved is checked below.
    assert any("exitcode  : 138" in line or "exitcode  : -6" in line for line in lines), lines
    shutil.copytree(tmp_path / "two", tmp_path / "one")
    assert sorted(p.name for p in (checkpoints(tmp_path / "two")[-1][1] / "state").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert torchrun_train(replace(part, steps=4, resume=True)) == losses(fsdp)  # same ranks: exact
    assert restore(tmp_path / "one", base)[2] == first
    resumed = ttrain.train(replace(base, steps=4, resume=True, out=str(tmp_path / "one")))  # 2 ranks -> 1
    assert resumed[: len(first)] == first
    np.testing.assert_allclose(resumed, losses(fsdp), rtol=1e-5)


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
        plain_total, forward_per_module = step_flops(model, backward=True)[0], step_flops(model, backward=False)[1]
        if plan_first:
            model.enable_gradient_checkpointing("full")
        shard_blocks(model)
        if not plan_first:
            model.enable_gradient_checkpointing("full")
        assert isinstance(model.mid, FSDPModule)
        assert checkpointed_names(model) == model.block_names()
        total, _ = step_flops(model, backward=True)
    assert total - plain_total == sum(forward_per_module[name] for name in model.block_names())


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("argv, mode", [([], None), (["--distributed"], "ddp"), (["--distributed", "fsdp"], "fsdp")])
def test_distributed_flag(framework: str, argv: list[str], mode: str | None) -> None:
    assert importlib.import_module(f"{framework}_impl.train").parse_args(argv).distributed == mode


def test_fsdp_outside_torchrun_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert ttrain.main(["--distributed", "fsdp", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("python -m torch_impl.train: error: --distributed fsdp: launch with torchrun"), err
    assert "\n" not in err
