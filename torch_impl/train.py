"""``python -m torch_impl.train``: DDPM noise-prediction training in PyTorch, the CLI, its loop and step.

One loop over the U-Net or, with ``--controlnet``, a ControlNet on the frozen U-Net
(`torch_impl.pair.ControlNetPair`); `train_step(model, optimizer, batch)` is the step to put in your
own loop. Batches, noise and dropout seeds are functions of (seed, step) (`shared_configs.training.data`),
the same as `jax_impl.train`'s, so a resumed run replays them. ``--distributed`` (DDP, FSDP2) runs
under torchrun; checkpoints are DCP folders (`torch_impl.checkpoint_io`); the run folder, resume
checks and NaN guard are `shared_configs.training.loop`'s. Mirror: `jax_impl/train.py`; docs/training.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shared_configs import UNetSpec, load_spec
from shared_configs.pair import ControlNetPairSpec, PairPlan, check_pair_workload, controlnet_pair, load_pair_dataset
from shared_configs.plan import CheckpointPlan
from shared_configs.training import config
from shared_configs.training.config import FrameworkCLI, TrainConfig, cli_main, options_of, used
from shared_configs.training.data import Batch, Dataset, check_conditioning, load_dataset, step_seed
from shared_configs.training.ddpm import Schedule, check_objective, make_schedule, sample
from shared_configs.training.loop import RunStart, manifest_for, open_run, run_loop
from shared_configs.training.outputs import write_outputs
from shared_configs.training.run_plan import MEASURED_STEPS, RunPlan, report, resolve_run, workload_of
from torch_impl.checkpoint_io import FRAMEWORK, LAYOUT, current_comm, load_checkpoint, save_checkpoint
from torch_impl.guard import BudgetGuard
from torch_impl.pair import ControlNetPair, trained_module
from torch_impl.parallel import launch, wrap
from torch_impl.regime import EMA, PLAIN_STEP, StepTools, apply_regime, make_optimizer, step_tools
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
            other = "--distributed (DDP/FSDP2 under torch.compile is not tested here)" if cfg.distributed else (
                "--budget-mib (the planner profiles and checks eager steps)" if cfg.budget_mib is not None
                else "--controlnet (the compiled pair is not tested here)")  # fmt: skip
            raise ValueError(f"--compile: not with {other}; drop one of them")


CLI = FrameworkCLI("torch", TorchOptions)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The flags of ``python -m torch_impl.train`` (`shared_configs.training.config.parse_args`)."""
    return config.parse_args(argv, CLI)


def run_settings(cfg: TrainConfig, device: str) -> str:
    """What the run uses on ``device`` (`shared_configs.training.config.used`): its dtype; torch's
    SDPA attention has nothing to choose."""
    return used(cfg, device) + ", torch attention SDPA"


def as_tensors(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor | None]]:
    """(noisy, t, noise, conditioning by name) as torch tensors (NCHW, sharing the numpy batch's memory)."""
    conditioning = {k: None if v is None else torch.from_numpy(v) for k, v in batch.conditioning().items()}
    return torch.from_numpy(batch.noisy), torch.from_numpy(batch.t), torch.from_numpy(batch.noise), conditioning


def model_spec(model: torch.nn.Module) -> UNetSpec | None:
    """The spec of a `UNet`, of one wrapped in DDP (``.module``), or of a module that says (``.spec``)."""
    return getattr(model, "spec", None) or getattr(getattr(model, "module", None), "spec", None)


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, *, tools: StepTools = PLAIN_STEP
) -> float:
    """One DDPM step: predict the noise in ``batch.noisy`` at ``batch.t``, MSE, backward, update.

    ``model`` is a `UNet` (optionally with gradient checkpointing enabled, or wrapped in DDP);
    every conditioning input the batch carries (context, class_labels, text_embeds, time_ids) is
    passed by name, and a batch without one the spec takes is refused in one line. The regime's
    pieces (``tools``, `torch_impl.regime.step_tools`): ``autocast_dtype`` runs the forward in that
    mixed precision (weights, loss and optimizer stay float32), ``scaler`` scales the loss
    (float16), ``ema`` is updated after the step; a model cast to bfloat16 gets its floating inputs
    in bfloat16. Returns the loss as a Python float.
    """
    return step_loss(model, optimizer, batch, tools=tools).item()


def step_loss(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, *, tools: StepTools = PLAIN_STEP
) -> torch.Tensor:
    """`train_step` without reading the loss: the planner's profile runs it on fake tensors, which
    have no values (nor can a ``GradScaler`` read one: pass none there)."""
    if (spec := model_spec(model)) is not None:
        check_conditioning(spec, batch.conditioning())
    model.train()
    # First, as PyTorch's examples do: the previous step's gradients are freed (set_to_none, the
    # default) before this forward, so they never sit beside its activations; a regime that keeps
    # them (diffusers' DreamBooth default) zeroes them in place, and they do.
    optimizer.zero_grad(set_to_none=not tools.keep_grads)
    first = next(model.parameters())
    device, dtype = first.device, first.dtype
    noisy, t, noise, conditioning = as_tensors(batch)
    noisy, t, noise = noisy.to(device, dtype), t.to(device), noise.to(device)
    # time_ids stay float32, as t does (pixel sizes up to 2048 and more)
    conditioning = {
        k: None if v is None else _to(v, device, dtype if k != "time_ids" else v.dtype) for k, v in conditioning.items()
    }
    mixed, scaler = tools.autocast_dtype, tools.scaler
    with torch.autocast(device.type, dtype=mixed or torch.bfloat16, enabled=mixed is not None):
        pred = model(noisy, t, **conditioning)
    loss = F.mse_loss(pred.float(), noise)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # skipped where the scaled gradients overflowed; the scale then drops
        scaler.update()
    if tools.ema is not None:
        tools.ema.update()
    return loss.detach()


def _to(value: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A conditioning input on ``device``, floating ones in the model's ``dtype`` (labels stay integer)."""
    return value.to(device, dtype) if value.is_floating_point() else value.to(device)


@torch.no_grad()
def generate(model: UNet | ControlNetPair, schedule: Schedule, dataset: Dataset, cfg: TrainConfig) -> np.ndarray:
    """A grid of samples from the short ancestral sampler (dropout off); a pair's conditioned on
    each class's edge map (`shared_configs.pair.ControlNetDataset`)."""
    model.eval()
    spec = model.spec
    shape = (cfg.num_samples, spec.in_channels, spec.sample_size, spec.sample_size)

    def eps_fn(x: np.ndarray, t: np.ndarray, conditioning: dict[str, np.ndarray | None]) -> np.ndarray:
        inputs = {k: None if v is None else torch.from_numpy(v) for k, v in conditioning.items()}
        return model(torch.from_numpy(x), torch.from_numpy(t), **inputs).numpy()

    return sample(eps_fn, schedule, dataset, shape, cfg.sample_steps, cfg.seed)


def step_spec(cfg: TrainConfig, spec: UNetSpec) -> UNetSpec | ControlNetPairSpec:
    """What the run's step trains: ``spec``'s U-Net, or under ``--controlnet`` the pair made from it
    (refused in one line where the ControlNet step is not planned: a BatchNorm U-Net)."""
    if not cfg.controlnet:
        return spec
    pair = controlnet_pair(spec)
    check_pair_workload(pair, False, cfg.regime)
    return pair


def build(
    cfg: TrainConfig, plan: CheckpointPlan | PairPlan | None = None
) -> tuple[UNet | ControlNetPair, torch.nn.Module, torch.optim.Optimizer]:
    """The model (seeded init, ``plan`` applied; None: ``cfg.policy``'s), the module to train and its optimizer.

    The module to train is the model, its DDP wrapper (``--distributed ddp``), or the model sharded
    in place (``fsdp``: the same object, its class swapped by `fully_shard`). ``--controlnet``: the
    `ControlNetPair` (the seed makes the U-Net, then the ControlNet's conditioning embedding), its
    optimizer over the ControlNet's parameters.
    """
    torch.manual_seed(cfg.seed)
    spec = step_spec(cfg, load_spec(cfg.config))
    if isinstance(spec, ControlNetPairSpec):
        pair = apply_regime(ControlNetPair(spec, plan if plan is not None else cfg.policy), cfg.regime)  # weights cast
        return pair, pair, make_optimizer(pair, cfg.lr, cfg.weight_decay, cfg.regime)
    model = UNet(spec, cfg.policy if plan is None else plan)  # policy None: the spec's own
    model = apply_regime(model, cfg.regime)  # adapters (lora), weights cast (pure bf16)
    # Plan first, then DDP/FSDP2: torchtitan's order, which its checkpoint *wrapper* needs (inside
    # the FSDP unit). Our shadowed forwards work in either order (see shard_blocks, tested both
    # ways), so the parallel wrapper simply stays the last transform.
    trained = wrap(model, cfg.distributed) if cfg.distributed else model
    # Made after fully_shard, which replaces the parameters by their shards (DTensors).
    return model, trained, make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.regime)


@contextmanager
def measured_peak(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, ema: EMA | None = None
) -> Iterator[dict[str, int]]:
    """The peak bytes of the step run in the block (``found["peak"]`` at exit): `torch_impl.memory.step_peak`,
    the numpy batch (read, not allocated, by the step) and an EMA copy counted as the planner's profile counts them."""
    from torch_impl.memory import step_peak  # here: `import torch_impl` stays light

    with step_peak(model, optimizer, _reads(batch, ema)) as found:
        yield found


def world_size(cfg: TrainConfig) -> int:
    """The processes the run's batch is split over (torchrun's WORLD_SIZE under ``--distributed``)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if cfg.distributed else 1


def _peak_meter(
    cfg: TrainConfig,
    model: UNet | ControlNetPair,
    opt: torch.optim.Optimizer,
    budget: RunPlan | None,
    first: int,
    tools: StepTools,
) -> tuple[Callable[[int, Batch, Callable[[], float]], float], BudgetGuard | None]:
    """``measured(step, batch, run_step)``: runs the step; with a ``budget``, the first
    `MEASURED_STEPS` from ``first`` measured, then rank 0 prints their peak beside the prediction.

    One process: the steps run under a `BudgetGuard` (returned too), which measures the first steps
    and those after each change, re-plans when the step holds more than the model's and runs a step
    that ran out of memory again under a plan that recomputes more. Under ``--distributed`` each
    rank measures its own share of the batch under `measured_peak` (the ranks would have to agree
    on a new plan: not done), and prints nothing but the peak."""
    rank, world, peaks = dist.get_rank() if cfg.distributed else 0, world_size(cfg), []
    guard = None
    if budget is not None and not cfg.distributed:
        context = workload_of(cfg, step_spec(cfg, model.spec), 1).context_length
        guard = BudgetGuard(model, budget.budget_bytes, batch_size=cfg.batch_size, regime=cfg.regime,
                            policy=budget.policy, context_length=context)  # fmt: skip

    def measure(batch: Batch, run_step: Callable[[], float]) -> tuple[float, list[int]]:
        if guard is not None:  # the tensors the step reads, for its CPU tracker (as `measured_peak` counts them)
            seen = len(guard.history)
            loss = guard.run(lambda _reads: run_step(), _reads(batch, tools.ema))
            return loss, [r.measured for r in guard.history[seen:] if r.measured is not None]
        with measured_peak(model, opt, batch.shard(rank, world), tools.ema) as found:
            loss = run_step()
        return loss, [found["peak"]]

    def measured(step: int, batch: Batch, run_step: Callable[[], float]) -> float:
        if budget is None or (guard is None and step >= first + MEASURED_STEPS):
            return run_step()
        loss, new = measure(batch, run_step)
        done = len(peaks) >= MEASURED_STEPS
        peaks.extend(new)
        if rank == 0 and not done and new and (len(peaks) >= MEASURED_STEPS or step + 1 == cfg.steps):
            where = f"max of steps {first + 1}-{step + 1}" if step > first else f"step {step + 1}"
            ranks = f", rank 0 of {world}" if cfg.distributed else ""
            how = PEAK_INSTRUMENTS[next(model.parameters()).device.type]
            report(budget.peak_line(max(peaks[:MEASURED_STEPS]), f"{how}; {where}{ranks}"))
        return loss

    return measured, guard


def _reads(batch: Batch, ema: EMA | None) -> list[torch.Tensor]:
    """The tensors a step reads but does not make: the batch's arrays (shared, not copied) and an EMA copy."""
    noisy, t, noise, conditioning = as_tensors(batch)
    return [noisy, t, noise, *(c for c in conditioning.values() if c is not None), *([] if ema is None else ema.shadow)]


def distributed_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, tools: StepTools = PLAIN_STEP
) -> float:
    """`train_step` on this rank's shard of the global batch; returns the global mean loss.

    DDP all-reduces and FSDP2 reduce-scatters the gradients as means over ranks, so with equal
    shards the update equals a single process's on the whole batch (dropout masks differ, being
    drawn per shard).
    """
    loss = train_step(model, optimizer, batch.shard(dist.get_rank(), dist.get_world_size()), tools=tools)
    total = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train(cfg: TrainConfig) -> list[float]:
    """Run (or resume) training as ``cfg`` says; returns the loss of every step from step 0.

    Everything that can refuse the run (spec, objective, launch, run folder, resume record,
    policy or budget) is checked before the model is built.
    """
    spec = load_spec(cfg.config)
    check_objective(spec)
    trains = step_spec(cfg, spec)  # the U-Net, or the ControlNet pair
    rank = launch(cfg)
    with open_run(cfg, spec, FRAMEWORK, LAYOUT, owner=rank == 0) as run:
        # every rank plans a budget: the profile cache's lock lets one profile
        cfg, plan, budget = resolve_run(cfg, trains, CLI.name, world_size(cfg), run, show=rank == 0)
        model, trained, optimizer = build(cfg, plan)
        try:
            losses, samples = _train(cfg, run, model, trained, optimizer, budget)
        finally:
            if cfg.distributed:
                # Drop DDP (and its reducer) while the process group lives: otherwise the group is
                # destroyed from the reducer's destructor, which joins gloo's worker thread while
                # holding the GIL that thread needs to free its tensors: a deadlock at exit.
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
    budget: RunPlan | None = None,
) -> tuple[list[float], np.ndarray | None]:
    """The steps from the run's start (resumed, its checkpoint checked first), then the samples;
    with a ``budget``, the peak of the first steps measured and printed beside its prediction."""
    tools = step_tools(model, cfg.regime)  # train_step's regime pieces
    extra = tools.state()
    held = trained_module(model)  # what a checkpoint holds: the model, or a pair's ControlNet
    if run.checkpoint is not None:
        load_checkpoint(run.checkpoint, held, optimizer, extra)
    dataset, schedule = _dataset(cfg, model), make_schedule(cfg.schedule, cfg.timesteps)
    measured, guard = _peak_meter(cfg, model, optimizer, budget, len(run.losses), tools)
    # --compile: only the step runs compiled (the plan's checkpoints traced into its graph);
    # checkpoints and samples use the model itself, which shares the compiled one's parameters.
    compiled = options_of(cfg, TorchOptions).compile
    stepped = torch.compile(model) if compiled else model
    first = len(run.losses)

    def step_fn(state: None, step: int) -> tuple[None, float]:
        batch = dataset.batch(step, cfg.batch_size, schedule, cfg.seed)
        torch.manual_seed(step_seed(cfg.seed, step))  # dropout masks depend on (seed, step) only
        if cfg.distributed:
            return state, measured(step, batch, lambda: distributed_step(trained, optimizer, batch, tools))
        start = time.perf_counter()
        loss = measured(step, batch, lambda: train_step(stepped, optimizer, batch, tools=tools))
        if compiled and step == first:  # (--compile is one process)
            report(f"torch.compile: first step {time.perf_counter() - start:.1f} s (compile included)")
        return state, loss

    def save_fn(state: None, losses: list[float]) -> None:
        # under a guard: its plan in force (a resume starts from it) and its history, in the record
        now = cfg if guard is None else replace(cfg, policy=guard.plan)
        manifest = manifest_for(now, model.spec, FRAMEWORK, LAYOUT, losses)
        if guard is not None:  # steps counted from the run's start (the guard counts its own from 1)
            earlier = run.manifest.run.get("guard", []) if run.manifest is not None else []
            manifest.run["guard"] = [*earlier, *({**asdict(r), "step": first + r.step} for r in guard.history)]
        save_checkpoint(run.out, held, optimizer, manifest, extra)

    losses = run.losses
    rank = dist.get_rank() if cfg.distributed else 0
    settings = "" if rank else run_settings(cfg, "cpu")
    name = model.pair_spec.name if isinstance(model, ControlNetPair) else model.spec.name
    title = f"torch {name} {model.plan.policy}"
    run_loop(cfg, None, losses, step_fn, save_fn, title, current_comm(), settings)
    # Under FSDP2 each forward all-gathers from every rank: all sample while the group lives.
    sampling = cfg.sample_steps > 0 and (rank == 0 or cfg.distributed == "fsdp")
    samples = generate(model, schedule, dataset, cfg) if sampling else None
    if cfg.distributed:
        dist.barrier()
    return losses, samples


def _dataset(cfg: TrainConfig, model: UNet | ControlNetPair) -> Dataset:
    """The run's data; a pair's with each sample's conditioning image."""
    if isinstance(model, ControlNetPair):
        return load_pair_dataset(cfg.data, model.pair_spec, cfg.seed)
    return load_dataset(cfg.data, model.spec, cfg.seed)


def main(argv: list[str] | None = None) -> int:
    return cli_main(train, argv, CLI)


if __name__ == "__main__":
    sys.exit(main())
