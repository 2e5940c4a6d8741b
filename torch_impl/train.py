"""``python -m torch_impl.train``: DDPM noise-prediction training in PyTorch, the CLI and its loop.

One loop over the U-Net or, with ``--controlnet``, a `torch_impl.pair.ControlNetPair`, stepping
`torch_impl.step`'s step. Batches, noise and dropout seeds are functions of (seed, step), so a resumed
run replays them. ``--distributed`` (DDP, FSDP2) runs under torchrun. Mirror: `jax_impl/train.py`;
docs/training.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from shared_configs import load_spec
from shared_configs.pair import PairPlan, load_step_dataset, step_spec
from shared_configs.planning.closed_loop import MEASURED_STEPS
from shared_configs.training import config
from shared_configs.training.config import FrameworkCLI, TrainConfig, cli_main, options_of, used
from shared_configs.training.data import Dataset, step_seed
from shared_configs.training.ddpm import Schedule, check_objective, make_schedule, sample
from shared_configs.training.loop import RunStart, manifest_for, open_run, run_loop
from shared_configs.training.outputs import write_outputs
from shared_configs.training.run_plan import RunPlan, report, resolve_run, workload_of
from shared_configs.vocabulary import CheckpointPlan
from torch_impl.checkpoint_io import FRAMEWORK, LAYOUT, current_comm, load_checkpoint, save_checkpoint
from torch_impl.guard import BudgetGuard
from torch_impl.memory import step_peak
from torch_impl.pair import ControlNetPair, step_model, trained_module
from torch_impl.parallel import launch, wrap
from torch_impl.regime import apply_regime, make_optimizer, step_tools
from torch_impl.step import distributed_step, train_step
from torch_impl.unet import UNet

PEAK_INSTRUMENTS = {
    "cpu": "live tensor storages (torch_impl.memory.step_peak), the batch included",
    "cuda": "torch.cuda.max_memory_reserved in one process (the guard's), max_memory_allocated per rank",
}
COMPILE_HELP = (
    "train torch.compile(model) (the plan's checkpoints traced into the graph; docs/compile.md); "
    "the first step's seconds, compile included, are printed apart"
)


@dataclass(frozen=True)
class TorchOptions:
    """The flags only ``torch_impl.train`` has (`shared_configs.training.config.Options`)."""

    compile: bool = False  # the step's model is torch.compile(model) (the JAX step is always jitted)

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--compile", action="store_true", help=COMPILE_HELP)

    def check(self, cfg: TrainConfig) -> None:
        if self.compile and (cfg.distributed or cfg.budget_mib is not None or cfg.controlnet):
            other = (
                "--distributed (DDP/FSDP2 under torch.compile is not tested here)"
                if cfg.distributed
                else (
                    "--budget-mib (the planner profiles and checks eager steps)"
                    if cfg.budget_mib is not None
                    else "--controlnet (the compiled pair is not tested here)"
                )
            )
            raise ValueError(f"--compile: not with {other}; drop one of them")


CLI = FrameworkCLI("torch", TorchOptions)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    return config.parse_args(argv, CLI)


def run_settings(cfg: TrainConfig, device: str) -> str:
    """What the run uses on ``device`` (its dtype); torch's SDPA attention has nothing to choose."""
    return used(cfg, device) + ", torch attention SDPA"


@torch.no_grad()
def generate(model: UNet | ControlNetPair, schedule: Schedule, dataset: Dataset, cfg: TrainConfig) -> np.ndarray:
    """A grid of samples from the short ancestral sampler (dropout off; a pair's on each class's edge map)."""
    model.eval()
    spec = model.spec
    shape = (cfg.num_samples, spec.in_channels, spec.sample_size, spec.sample_size)

    def eps_fn(x: np.ndarray, t: np.ndarray, conditioning: dict[str, np.ndarray | None]) -> np.ndarray:
        inputs = {k: None if v is None else torch.from_numpy(v) for k, v in conditioning.items()}
        return model(torch.from_numpy(x), torch.from_numpy(t), **inputs).numpy()

    return sample(eps_fn, schedule, dataset, shape, cfg.sample_steps, cfg.seed)


def build(
    cfg: TrainConfig, plan: CheckpointPlan | PairPlan | None = None
) -> tuple[UNet | ControlNetPair, torch.nn.Module, torch.optim.Optimizer]:
    """The model (seeded, ``plan`` or ``cfg.policy`` applied), the module to train (DDP/FSDP2's) and its optimizer."""
    torch.manual_seed(cfg.seed)
    spec = step_spec(load_spec(cfg.config), cfg.controlnet, cfg.regime)  # the U-Net, or the ControlNet pair
    # adapters (lora), weights cast (pure bf16; a pair's); policy None: the spec's own
    model = apply_regime(step_model(spec, cfg.policy if plan is None else plan), cfg.regime)
    # Plan first, then DDP/FSDP2, torchtitan's order (ours works in either: see shard_blocks).
    trained = wrap(model, cfg.distributed) if cfg.distributed else model
    # Made after fully_shard, which replaces the parameters by their shards (DTensors).
    return model, trained, make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.regime)


def world_size(cfg: TrainConfig) -> int:
    """The processes the run's batch is split over (torchrun's WORLD_SIZE under ``--distributed``)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if cfg.distributed else 1


def _peak_meter(
    cfg: TrainConfig,
    model: UNet | ControlNetPair,
    opt: torch.optim.Optimizer,
    budget: RunPlan | None,
    first: int,
    rank: int,
) -> tuple[Callable[[int, Callable[[], float]], float], BudgetGuard | None]:
    """``measured(step, run_step)`` runs the step; with a ``budget``, the first `MEASURED_STEPS` from ``first``
    are measured and rank 0 prints their peak beside the prediction. One process: under a `BudgetGuard`
    (returned too); ``--distributed``: each rank's share under `torch_impl.memory.step_peak`."""
    peaks: list[int] = []
    guard = None
    if budget is not None and not cfg.distributed:
        context = workload_of(cfg, step_spec(model.spec, cfg.controlnet, cfg.regime), 1).context_length
        guard = BudgetGuard(
            model,
            budget.budget_bytes,
            batch_size=cfg.batch_size,
            regime=cfg.regime,
            policy=budget.policy,
            optimizers=[opt],
            context_length=context,
        )

    def measured(step: int, run_step: Callable[[], float]) -> float:
        if budget is None or (guard is None and step >= first + MEASURED_STEPS):
            return run_step()
        if guard is not None:
            seen = len(guard.history)
            loss = guard.run(run_step)
            new = [r.measured for r in guard.history[seen:] if r.measured is not None]
        else:  # the batch and an EMA copy are counted where the step reads them
            with step_peak(model, opt) as found:
                loss = run_step()
            new = [found["peak"]]
        done = len(peaks) >= MEASURED_STEPS
        peaks.extend(new)
        if rank == 0 and not done and new and (len(peaks) >= MEASURED_STEPS or step + 1 == cfg.steps):
            where = f"max of steps {first + 1}-{step + 1}" if step > first else f"step {step + 1}"
            ranks = f", rank 0 of {world_size(cfg)}" if cfg.distributed else ""
            how = PEAK_INSTRUMENTS[next(model.parameters()).device.type]
            report(budget.peak_line(max(peaks[:MEASURED_STEPS]), f"{how}; {where}{ranks}"))
        return loss

    return measured, guard


def train(cfg: TrainConfig) -> list[float]:
    """Run (or resume) training as ``cfg`` says; returns every step's loss. Refusals come before the model is built."""
    spec = load_spec(cfg.config)
    check_objective(spec)
    trains = step_spec(spec, cfg.controlnet, cfg.regime)  # the U-Net, or the ControlNet pair
    rank = launch(cfg)
    with open_run(cfg, spec, FRAMEWORK, LAYOUT, owner=rank == 0) as run:
        # every rank plans a budget: the profile cache's lock lets one profile
        cfg, plan, budget = resolve_run(cfg, trains, CLI.name, world_size(cfg), run, show=rank == 0)
        model, trained, optimizer = build(cfg, plan)
        try:
            losses, samples = _train(cfg, run, model, trained, optimizer, rank, budget)
        finally:
            if cfg.distributed:
                # Drop DDP while the process group lives: destroyed from the reducer's destructor, the
                # group joins gloo's worker thread holding the GIL that thread needs (a deadlock at exit).
                del trained
                dist.destroy_process_group()
        if rank == 0:
            write_outputs(cfg.out, losses, samples, f"torch_impl {trains.name}, policy {plan.policy}")
    return losses


def _train(
    cfg: TrainConfig,
    run: RunStart,
    model: UNet | ControlNetPair,
    trained: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    budget: RunPlan | None = None,
) -> tuple[list[float], np.ndarray | None]:
    """The steps from the run's start (resumed, its checkpoint checked first) on this ``rank``, then the samples."""
    tools = step_tools(model, cfg.regime)  # train_step's regime pieces
    extra, held = tools.state(), trained_module(model)  # held: what a checkpoint holds (a pair's ControlNet)
    if run.checkpoint is not None:
        load_checkpoint(run.checkpoint, held, optimizer, extra)
    spec = model.pair_spec if isinstance(model, ControlNetPair) else model.spec  # what the step trains
    dataset, schedule = load_step_dataset(cfg.data, spec, cfg.seed), make_schedule(cfg.schedule, cfg.timesteps)
    first = len(run.losses)
    measured, guard = _peak_meter(cfg, model, optimizer, budget, first, rank)
    # --compile: only the step runs compiled (one process); checkpoints and samples use the model (the same
    # parameters). --distributed: each rank steps its shard of the batch.
    compiled = options_of(cfg, TorchOptions).compile
    stepped = torch.compile(trained) if compiled else trained
    step_once = distributed_step if cfg.distributed else train_step

    def step_fn(state: None, step: int) -> tuple[None, float]:
        batch = dataset.batch(step, cfg.batch_size, schedule, cfg.seed)
        torch.manual_seed(step_seed(cfg.seed, step))  # dropout masks depend on (seed, step) only
        start = time.perf_counter()
        loss = measured(step, lambda: step_once(stepped, optimizer, batch, tools=tools))
        if compiled and step == first:  # (--compile is one process)
            report(f"torch.compile: first step {time.perf_counter() - start:.1f} s (compile included)")
        return state, loss

    def save_fn(state: None, losses: list[float]) -> None:
        # under a guard: its plan in force (a resume starts from it) and its history, in the record
        manifest = manifest_for(
            cfg if guard is None else replace(cfg, policy=guard.plan), model.spec, FRAMEWORK, LAYOUT, losses
        )
        if guard is not None:  # steps counted from the run's start (the guard counts its own from 1)
            earlier = run.manifest.run.get("guard", []) if run.manifest is not None else []
            manifest.run["guard"] = [*earlier, *({**asdict(r), "step": first + r.step} for r in guard.history)]
        save_checkpoint(run.out, held, optimizer, manifest, extra)

    losses = run.losses  # a fresh list each time it is read
    settings = "" if rank else run_settings(cfg, "cpu")
    run_loop(cfg, None, losses, step_fn, save_fn, f"torch {spec.name} {model.plan.policy}", current_comm(), settings)
    # Under FSDP2 each forward all-gathers from every rank: all sample while the group lives.
    sampling = cfg.sample_steps > 0 and (rank == 0 or cfg.distributed == "fsdp")
    samples = generate(model, schedule, dataset, cfg) if sampling else None
    if cfg.distributed:
        dist.barrier()
    return losses, samples


def main(argv: list[str] | None = None) -> int:
    return cli_main(train, argv, CLI)


if __name__ == "__main__":
    sys.exit(main())
