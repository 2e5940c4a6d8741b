"""Training to a memory budget (``--budget-mib N``): the run's plan, and its predicted peak beside the measured one.

`plan_run` plans for the run itself, through the planner's library call
(`shared_configs.planning.planner.plan`): the run's spec at its sample size, the batch each rank (or
device) trains, its regime, the one-token context the training data gives, JAX's attention chunk, the world
size and ``--distributed`` mode. A resume with the budget its run was planned for keeps the run's
own plan (its record holds the resolved policy), so the profile cache changing in between changes
nothing. The frameworks' loops measure the peak of their first `MEASURED_STEPS` steps with their
own instrument and print `RunPlan.peak_line`. No torch or jax import.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shared_configs.defaults import resolve_chunk
from shared_configs.planning.planner import DEVICE, Workload, plan, predict_policy
from shared_configs.spec import UNetSpec
from shared_configs.training.config import TrainConfig
from shared_configs.units import MIB

# The first step makes AdamW's state; the second runs with it, as the profile's steps did.
MEASURED_STEPS = 2
# `shared_configs.training.data.Conditioner`: the training context is one token per image.
TRAIN_CONTEXT_LENGTH = 1


@dataclass(frozen=True)
class RunPlan:
    """The run's plan under its budget and what the planner's profile predicts of it (per rank)."""

    policy: str
    budget_bytes: int
    predicted_peak_bytes: int
    peak_at: str
    world_size: int
    distributed: str
    kept: bool  # the run's own plan, read from its record on resume (not planned again)

    def plan_line(self, framework: str) -> str:
        how = "the run's own plan, kept on resume" if self.kept else "planned for this run"
        ranks = f" per rank of {self.world_size} ({self.distributed})" if self.world_size > 1 else ""
        predicted = f"{framework} predicted peak {self.predicted_peak_bytes / MIB:.1f} MiB (at {self.peak_at})"
        return f"budget {self.budget_bytes / MIB:.1f} MiB{ranks}: policy {self.policy} ({how}); {predicted}"

    def peak_line(self, measured_bytes: int, instrument: str) -> str:
        err = self.predicted_peak_bytes / measured_bytes - 1
        return (f"budget {self.budget_bytes / MIB:.1f} MiB: measured peak {measured_bytes / MIB:.1f} MiB "
                f"({instrument}), predicted {self.predicted_peak_bytes / MIB:.1f} MiB "
                f"(prediction {100 * err:+.1f}%)")  # fmt: skip


def workload_of(cfg: TrainConfig, spec: UNetSpec, world_size: int) -> Workload:
    """What the run's step trains, per rank: its spec, its share of the batch, its regime, its inputs."""
    context = TRAIN_CONTEXT_LENGTH if spec.cross_attention_dim is not None else Workload.context_length
    chunk = resolve_chunk(cfg.attention_chunk, DEVICE)  # jax_impl.train resolved "auto" on its device already
    return Workload(spec, cfg.batch_size // world_size, cfg.regime, context_length=context, attention_chunk=chunk)


def plan_run(
    cfg: TrainConfig, spec: UNetSpec, framework: str, world_size: int, saved: Mapping[str, Any] | None
) -> RunPlan:
    """The plan of a ``--budget-mib`` run in ``framework`` ("torch" or "jax"); ``saved``: the record
    of the run being resumed (`shared_configs.training.config.run_record`), if any."""
    if cfg.budget_mib is None:
        raise ValueError("--budget-mib: required to plan a run")
    work, mode = workload_of(cfg, spec, world_size), cfg.distributed or "ddp"
    budget = int(cfg.budget_mib * MIB)
    then = (saved or {}).get("config", {})
    kept = then.get("budget_mib") == cfg.budget_mib and then.get("policy") is not None
    if kept:
        solution = predict_policy(work, then["policy"], framework, world_size, mode)[0]
    else:
        solution = plan(work, budget, framework, world_size, mode).solution
    pred = solution.prediction
    return RunPlan(solution.policy, budget, pred.peak_bytes, pred.peak_unit, world_size, mode, kept)


def report(line: str) -> None:
    """A budget line, on stderr beside the training's other lines."""
    print(line, file=sys.stderr, flush=True)
