"""`torch_impl.BudgetGuard` on two processes (torchrun, gloo, CPU): the ranks judge, plan, retry and refuse
together, and a model sharded by FSDP2 (``fully_shard``) is planned per rank.

Each test starts one torchrun of this module (``python -m tests.test_guard_processes CASE OUT``); each rank
writes what it saw to OUT. The module's profile cache is handed down in the environment (`plan_cache`), and
the planner's worker check of each plan is stood in for by the profile's prediction.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from shared_configs.planning import pipeline
from shared_configs.planning.pipeline import Workload, predict_policy
from shared_configs.regime import Regime
from shared_configs.training.data import example_batch
from tests.helpers.guard import checking_by_prediction, plan_cache  # noqa: F401 (fixtures)
from tests.helpers.guard_script import BATCH, SPEC, TOKENS, Script, largest_difference, run, sizes
from torch_impl import BudgetGuard
from torch_impl.guard_retry import from_rank0
from torch_impl.step import as_tensors

pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.usefixtures("plan_cache")]
FSDP_BATCH = 8  # per rank: activations above what FSDP2's gathers hold beyond the planner's per-rank share


def torchrun(case: str, out: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """``case`` on 2 ranks: what each rank wrote, and the guard's lines on stderr."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "tests.test_guard_processes", case, str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the module's profile cache (`plan_cache`) among them
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("guard:")]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)], lines


def test_two_processes_re_plan_together(tmp_path: Path) -> None:
    """Accelerate's DDP: rank 1's step holds 0.4 MiB more; both ranks judge the larger peak (one all-reduce)
    and put on rank 0's plan before the same step."""
    ranks, _ = torchrun("re-plan", tmp_path)
    assert ranks[0]["history"] == ranks[1]["history"], ranks  # the same peaks judged, plans, steps
    assert "tightened" in [r["action"] for r in ranks[0]["history"]], ranks[0]
    _print("two ranks re-plan", ranks[0]["history"])


def test_an_error_on_one_rank_is_one_retry_on_both_and_one_that_cannot_join_is_refused_on_both(
    tmp_path: Path,
) -> None:
    """Accelerate's DDP, accumulation 2; an out-of-memory error on rank 1 only, after the backward of its
    micro-step 1 (rank 0 learns it at the end of its call) and of micro-step 4 (rank 0 learns it before its
    optimizer step; micro-step 3 replayed on both): both ranks run the step again under one plan and every
    weight equals the unguarded two-process run's. Then rank 1 fails inside its optimizer step: every rank
    refuses, in one line each, and re-raises."""
    ranks, lines = torchrun("retry", tmp_path)
    assert ranks[0]["history"] == ranks[1]["history"], ranks
    assert [r["action"] for r in ranks[0]["history"]].count("out of memory") == 2, ranks[0]
    assert [r["difference"] for r in ranks] == [0.0, 0.0] and all(r["losses_equal"] for r in ranks), ranks
    retried = [x for x in lines if "running it again under" in x]
    assert sum(x.startswith("guard: rank 0: step 1: rank 1 ran out of memory under") for x in retried) == 1, lines
    assert sum(x.startswith("guard: rank 1: step 1: ran out of memory under") for x in retried) == 1, lines
    refused = [x for x in lines if "not run again" in x]
    assert len(refused) == 2 and all(r["refused"] for r in ranks), lines
    assert any(x.startswith("guard: rank 0: step 1: rank 1 ran out of memory") for x in refused), refused
    assert all(
        x.endswith("optimizer step had begun (some weights may be updated already); re-raising") for x in refused
    )
    _print(f"two ranks retry (largest weight difference {ranks[0]['difference']})", ranks[0]["history"])
    print(*retried, *refused, sep="\n")


def test_a_fully_shard_model_is_planned_per_rank_and_kept_within_budget(tmp_path: Path) -> None:
    """Our U-Net sharded by FSDP2, one unit per block (`torch_impl.parallel.shard_blocks`): the guard plans one
    rank's share (``distributed="fsdp"``, 2 ranks: the first plan's prediction is `predict_policy`'s per rank),
    both ranks keep one history, and from the guard's last change each step's peak on each rank is within the
    budget (60% of the way from `full`'s per-rank peak to `none`'s)."""
    ranks, _ = torchrun("fsdp", tmp_path)
    assert ranks[0]["history"] == ranks[1]["history"], ranks
    history, budget = ranks[0]["history"], ranks[0]["budget"]
    assert history[0]["predicted"] == ranks[0]["per_rank"] < ranks[0]["one_process"], ranks[0]
    last = max(i for i, r in enumerate(history) if r["measured"] is None)
    after = [r["measured"] for r in history[last:] if r["measured"] is not None]
    assert after and max(after) <= budget, history
    _print(f"fully_shard, budget {budget / 2**20:.3f} MiB", history)


def _print(title: str, history: list[dict[str, Any]]) -> None:
    mib = 2**20
    rows = (
        f"{r['step']} {r['action']} {r['plan']} {r['predicted'] / mib:.3f}/{(r['measured'] or 0) / mib:.3f}"
        for r in history
    )
    print(f"\n{title}:", *rows, sep="\n  ")


def _re_plan(rank: int) -> dict[str, Any]:
    script = Script()  # accelerate joins the torchrun group (gloo) and wraps the U-Net in DDP
    script.extra = (400 << 10) * rank
    budget = from_rank0(lambda: sizes(script.trained))  # one profile, rank 0's
    guard = BudgetGuard(script.trained, budget, batch_size=BATCH, context_length=TOKENS)
    run(script, guard, 5)
    return {"history": guard.history}


def _retry(rank: int) -> dict[str, Any]:
    plain = Script(accumulation=2)
    expected = run(plain, None, 4)
    script = Script(accumulation=2)
    budget = from_rank0(lambda: sizes(script.trained))
    guard = BudgetGuard(script.trained, budget, batch_size=BATCH, context_length=TOKENS)
    bodies = iter(range(1, 100))  # the body's runs on this rank: micro-steps 1, 1 again, 2, 3, 4 fail on rank 1
    script.fail = lambda: next(bodies) in (1, 5) and rank == 1
    losses = run(script, guard, 4)
    found = {"history": guard.history, "losses_equal": losses == expected}
    found["difference"] = largest_difference(script.weights(), plain.weights())
    refusing = Script()
    guard = BudgetGuard(refusing.trained, budget, batch_size=BATCH, context_length=TOKENS, policy="full")

    def failing_step(opt: torch.optim.Optimizer, *_: Any) -> None:
        if rank == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")

    refusing.optimizer.optimizer.register_step_pre_hook(failing_step)
    try:
        run(refusing, guard, 1)
    except torch.OutOfMemoryError:
        return found | {"refused": True}
    return found | {"refused": False}


def _fsdp(rank: int) -> dict[str, Any]:
    from torch_impl import UNet
    from torch_impl.parallel import shard_blocks

    torch.manual_seed(0)
    model = shard_blocks(UNet(SPEC))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    noisy, t, noise, conditioning = as_tensors(example_batch(SPEC, FSDP_BATCH, TOKENS, seed=rank))
    work = Workload(SPEC, FSDP_BATCH, Regime(), TOKENS)
    budget = from_rank0(lambda: sizes(model, batch=FSDP_BATCH, world_size=2, distributed="fsdp"))
    guard = BudgetGuard(model, budget, batch_size=FSDP_BATCH, context_length=TOKENS)

    def step() -> None:
        optimizer.zero_grad()
        F.mse_loss(model(noisy, t, **conditioning), noise).backward()
        optimizer.step()

    for _ in range(5):
        guard.run(step)
    first = guard.history[0].plan
    per_rank, alone = (
        from_rank0(lambda ranks=ranks: predict_policy(work, first, "torch", *ranks)[0].prediction.peak_bytes)
        for ranks in ((2, "fsdp"), (1,))
    )
    return {"history": guard.history, "budget": budget, "per_rank": per_rank, "one_process": alone}


CASES = {"re-plan": _re_plan, "retry": _retry, "fsdp": _fsdp}

if __name__ == "__main__":  # one rank: python -m tests.test_guard_processes CASE OUT
    pipeline.run_worker = checking_by_prediction(pipeline.run_worker)
    torch.set_num_threads(1)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    found = CASES[sys.argv[1]](torch.distributed.get_rank())
    found["history"] = [dataclasses.asdict(r) for r in found["history"]]
    Path(sys.argv[2], f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(found))
