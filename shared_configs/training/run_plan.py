"""A run's checkpoint plan, resolved once by both training loops (`resolve_run`): ``--policy``'s, or under
``--budget-mib N`` the planner's for the run's own workload per rank (`workload_of`), handed over as a
`CheckpointPlan` built from the solver's assignment (`plan_of`). A resume at the same budget keeps the run's
recorded plan. The loops measure their first `closed_loop.MEASURED_STEPS` steps and print `RunPlan.peak_line`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from shared_configs.pair import ControlNetPairSpec, PairPlan, split_pair_plan
from shared_configs.planning.pipeline import Workload, plan, predict_policy
from shared_configs.planning.solver import Solution
from shared_configs.planning.units import FULL, PLAIN, resolve_any
from shared_configs.sizes import MIB
from shared_configs.spec import UNetSpec
from shared_configs.training.config import TrainConfig
from shared_configs.training.loop import RunStart
from shared_configs.vocabulary import CheckpointPlan, resolve_plan

# `shared_configs.training.data.Conditioner`: the training context is one token per image.
TRAIN_CONTEXT_LENGTH = 1


@dataclass(frozen=True)
class RunPlan:
    """The run's plan under its budget and what the planner's profile predicts of it (per rank)."""

    plan: CheckpointPlan | PairPlan
    budget_bytes: int
    predicted_peak_bytes: int
    peak_at: str
    world_size: int
    distributed: str
    kept: bool  # the run's own plan, read from its record on resume (not planned again)

    @property
    def policy(self) -> str:
        return self.plan.policy

    def plan_line(self, framework: str) -> str:
        how = "the run's own plan, kept on resume" if self.kept else "planned for this run"
        ranks = f" per rank of {self.world_size} ({self.distributed})" if self.world_size > 1 else ""
        predicted = f"{framework} predicted peak {self.predicted_peak_bytes / MIB:.1f} MiB (at {self.peak_at})"
        return f"budget {self.budget_bytes / MIB:.1f} MiB{ranks}: policy {self.policy} ({how}); {predicted}"

    def peak_line(self, measured_bytes: int, instrument: str) -> str:
        err = self.predicted_peak_bytes / measured_bytes - 1
        return (
            f"budget {self.budget_bytes / MIB:.1f} MiB: measured peak {measured_bytes / MIB:.1f} MiB "
            f"({instrument}), predicted {self.predicted_peak_bytes / MIB:.1f} MiB "
            f"(prediction {100 * err:+.1f}%)"
        )


def resolve_run(
    cfg: TrainConfig,
    spec: UNetSpec | ControlNetPairSpec,
    framework: str,
    world_size: int,
    run: RunStart,
    show: bool = True,
    attention_chunk: int | None = Workload.attention_chunk,
) -> tuple[TrainConfig, CheckpointPlan | PairPlan, RunPlan | None]:
    """The plan of a run of ``spec`` (a pair for ``--controlnet``): ``cfg.policy``'s, or under ``--budget-mib`` the
    planner's (said on stderr where ``show``); ``run``: where it starts; ``attention_chunk``: JAX's, resolved.
    Returns the config the run records, the plan the model is built with and the `RunPlan` (None: no budget)."""
    if cfg.budget_bytes is None:
        return cfg, resolve_any(spec, cfg.policy), None  # a bad policy is refused here
    then = (run.manifest.run if run.manifest is not None else {}).get("config", {})
    work, mode = workload_of(cfg, spec, world_size, attention_chunk), cfg.distributed or "ddp"
    kept = then.get("budget_mib") == cfg.budget_mib and then.get("policy") is not None
    if kept:
        solution = predict_policy(work, then["policy"], framework, world_size, mode)[0]
    else:
        solution = plan(work, cfg.budget_bytes, framework, world_size, mode).solution
    pred = solution.prediction
    budget = RunPlan(plan_of(spec, solution), cfg.budget_bytes, pred.peak_bytes, pred.peak_unit, world_size, mode, kept)
    if show:
        report(budget.plan_line(framework))
    return replace(cfg, policy=budget.policy), budget.plan, budget  # the policy recorded


def workload_of(
    cfg: TrainConfig,
    spec: UNetSpec | ControlNetPairSpec,
    world_size: int,
    attention_chunk: int | None = Workload.attention_chunk,
) -> Workload:
    """What the run's step trains, per rank: its spec, its share of the batch, its regime, its inputs."""
    unet = spec.unet if isinstance(spec, ControlNetPairSpec) else spec
    context = TRAIN_CONTEXT_LENGTH if unet.cross_attention_dim is not None else Workload.context_length
    return Workload(
        spec, cfg.batch_size // world_size, cfg.regime, context_length=context, attention_chunk=attention_chunk
    )


def plan_of(spec: UNetSpec | ControlNetPairSpec, solution: Solution) -> CheckpointPlan | PairPlan:
    """The solver's plan as a value, from its assignment (a pair's: split from its policy string)."""
    if isinstance(spec, ControlNetPairSpec):
        return split_pair_plan(spec, solution.policy)
    chosen = {name: choice for name, choice in solution.assignment.items() if choice != PLAIN}
    # each recompute choice but full is save=OP,OP (`choice_of`): the op classes it keeps
    unit_save = tuple((name, tuple(c.removeprefix("save=").split(","))) for name, c in chosen.items() if c != FULL)
    return resolve_plan(spec, CheckpointPlan(solution.policy, tuple(chosen), unit_save=unit_save))


def report(line: str) -> None:
    """A budget line, on stderr beside the training's other lines."""
    print(line, file=sys.stderr, flush=True)
