"""DDPM noise-prediction training of the U-Net in PyTorch: ``python -m torch_impl.train``.

A thin loop over an importable step. To put this U-Net in your own loop::

    model = UNet("tiny"); model.enable_gradient_checkpointing("full")
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.0)
    loss = train_step(model, optimizer, batch)   # batch: shared_configs.training.data.Batch (numpy)

Batches, timesteps, noise and the conditioning inputs (context, class labels, text embeddings,
time ids: whichever the spec takes) come from `shared_configs.training.data` (numpy), so
`jax_impl.train` sees the very same ones for the same seed. Dropout draws from torch's global RNG,
reseeded per step from (seed, step) so that a resumed run replays the same masks.

Under torchrun, ``--distributed`` (DDP) or ``--distributed fsdp`` (FSDP2, one unit per U-Net
block) splits the global batch over processes (gloo, CPU). Checkpoints are DCP folders, each rank
writing its shards (`torch_impl.checkpoint_io`), so a run resumes on any number of processes. The
run folder, resume checks and NaN guard are framework-free (`shared_configs.training.loop`).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shared_configs import CheckpointPlan, UNetSpec, load_spec, resolve_plan
from shared_configs.training.config import TrainConfig, cli_main
from shared_configs.training.data import Batch, Dataset, check_conditioning, load_dataset, step_seed
from shared_configs.training.ddpm import Schedule, check_objective, make_schedule, sample
from shared_configs.training.loop import RunStart, manifest_for, open_run, run_loop
from shared_configs.training.outputs import write_outputs
from torch_impl.checkpoint_io import FRAMEWORK, LAYOUT, current_comm, load_checkpoint, save_checkpoint
from torch_impl.parallel import launch, wrap
from torch_impl.unet import UNet

DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with every hyperparameter explicit (torch's weight_decay default, 0.01, differs from optax's)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)


def as_tensors(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor | None]]:
    """(noisy, t, noise, conditioning by name) as torch tensors (NCHW, sharing the numpy batch's memory)."""
    conditioning = {k: None if v is None else torch.from_numpy(v) for k, v in batch.conditioning().items()}
    return torch.from_numpy(batch.noisy), torch.from_numpy(batch.t), torch.from_numpy(batch.noise), conditioning


def model_spec(model: torch.nn.Module) -> UNetSpec | None:
    """The spec of a `UNet`, of one wrapped in DDP (``.module``), or of a module that says (``.spec``)."""
    return getattr(model, "spec", None) or getattr(getattr(model, "module", None), "spec", None)


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, autocast_dtype: torch.dtype | None = None
) -> float:
    """One DDPM step: predict the noise in ``batch.noisy`` at ``batch.t``, MSE, backward, update.

    ``model`` is a `UNet` (optionally with gradient checkpointing enabled, or wrapped in DDP);
    every conditioning input the batch carries (context, class_labels, text_embeds, time_ids) is
    passed by name, and a batch without one the spec takes is refused in one line.
    ``autocast_dtype=torch.bfloat16`` runs the forward in bf16 mixed precision (weights, loss and
    optimizer stay float32). Returns the loss as a Python float.
    """
    if (spec := model_spec(model)) is not None:
        check_conditioning(spec, batch.conditioning())
    model.train()
    # First, as PyTorch's examples do: the previous step's gradients are freed (set_to_none, the
    # default) before this forward, so they never sit beside its activations.
    optimizer.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    noisy, t, noise, conditioning = as_tensors(batch)
    noisy, t, noise = noisy.to(device), t.to(device), noise.to(device)
    conditioning = {k: None if v is None else v.to(device) for k, v in conditioning.items()}
    with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        pred = model(noisy, t, **conditioning)
    loss = F.mse_loss(pred.float(), noise)
    loss.backward()
    optimizer.step()
    return loss.item()


@torch.no_grad()
def generate(model: UNet, schedule: Schedule, dataset: Dataset, cfg: TrainConfig) -> np.ndarray:
    """A grid of samples from the short ancestral sampler (dropout off)."""
    model.eval()
    spec = model.spec
    shape = (cfg.num_samples, spec.in_channels, spec.sample_size, spec.sample_size)

    def eps_fn(x: np.ndarray, t: np.ndarray, conditioning: dict[str, np.ndarray | None]) -> np.ndarray:
        inputs = {k: None if v is None else torch.from_numpy(v) for k, v in conditioning.items()}
        return model(torch.from_numpy(x), torch.from_numpy(t), **inputs).numpy()

    return sample(eps_fn, schedule, dataset, shape, cfg.sample_steps, cfg.seed)


def build(
    cfg: TrainConfig, plan: CheckpointPlan | None = None
) -> tuple[UNet, torch.nn.Module, torch.optim.Optimizer]:
    """The model (seeded init, ``plan`` applied; None: ``cfg.policy``), the module to train and its optimizer.

    The module to train is the model, its DDP wrapper (``--distributed ddp``), or the model sharded
    in place (``fsdp``: the same object, its class swapped by `fully_shard`).
    """
    torch.manual_seed(cfg.seed)
    model = UNet(load_spec(cfg.config), cfg.policy if plan is None else plan)  # policy None: the spec's own
    # Plan first, then DDP/FSDP2: torchtitan's order, which its checkpoint *wrapper* needs (inside
    # the FSDP unit). Our shadowed forwards work in either order (see shard_blocks, tested both
    # ways), so the parallel wrapper simply stays the last transform.
    trained = wrap(model, cfg.distributed) if cfg.distributed else model
    # Made after fully_shard, which replaces the parameters by their shards (DTensors).
    return model, trained, make_optimizer(model, cfg.lr, cfg.weight_decay)


def distributed_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, cfg: TrainConfig) -> float:
    """`train_step` on this rank's shard of the global batch; returns the global mean loss.

    DDP all-reduces and FSDP2 reduce-scatters the gradients as means over ranks, so with equal
    shards the update equals a single process's on the whole batch (dropout masks differ, being
    drawn per shard).
    """
    loss = train_step(model, optimizer, batch.shard(dist.get_rank(), dist.get_world_size()), DTYPES[cfg.dtype])
    total = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train(cfg: TrainConfig) -> list[float]:
    """Run (or resume) training as ``cfg`` says; returns the loss of every step from step 0.

    Everything that can refuse the run (spec, objective, policy, launch, run folder, resume
    record) is checked before the model is built.
    """
    spec = load_spec(cfg.config)
    check_objective(spec)
    plan = resolve_plan(spec, cfg.policy)  # once: a bad policy is refused here; None: the spec's own
    rank = launch(cfg)
    with open_run(cfg, spec, FRAMEWORK, LAYOUT, owner=rank == 0) as run:
        model, trained, optimizer = build(cfg, plan)
        try:
            losses, samples = _train(cfg, run, model, trained, optimizer)
        finally:
            if cfg.distributed:
                # Drop DDP (and its reducer) while the process group lives: otherwise the group is
                # destroyed from the reducer's destructor, which joins gloo's worker thread while
                # holding the GIL that thread needs to free its tensors: a deadlock at exit.
                del trained
                dist.destroy_process_group()
        if rank == 0:
            write_outputs(cfg.out, losses, samples, f"torch_impl {spec.name}, policy {plan.policy}")
    return losses


def _train(
    cfg: TrainConfig, run: RunStart, model: UNet, trained: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[list[float], np.ndarray | None]:
    """The steps from the run's start (resumed, its checkpoint checked first), then the samples."""
    if run.checkpoint is not None:
        load_checkpoint(run.checkpoint, model, optimizer)
    dataset, schedule = load_dataset(cfg.data, model.spec, cfg.seed), make_schedule(cfg.schedule, cfg.timesteps)

    def step_fn(state: None, step: int) -> tuple[None, float]:
        batch = dataset.batch(step, cfg.batch_size, schedule, cfg.seed)
        torch.manual_seed(step_seed(cfg.seed, step))  # dropout masks depend on (seed, step) only
        if cfg.distributed:
            return state, distributed_step(trained, optimizer, batch, cfg)
        return state, train_step(model, optimizer, batch, DTYPES[cfg.dtype])

    def save_fn(state: None, losses: list[float]) -> None:
        save_checkpoint(run.out, model, optimizer, manifest_for(cfg, model.spec, FRAMEWORK, LAYOUT, losses))

    losses = run.losses
    run_loop(cfg, None, losses, step_fn, save_fn, f"torch {model.spec.name} {model.plan.policy}", current_comm())
    # Under FSDP2 each forward all-gathers from every rank: all sample while the group lives.
    rank = dist.get_rank() if cfg.distributed else 0
    sampling = cfg.sample_steps > 0 and (rank == 0 or cfg.distributed == "fsdp")
    samples = generate(model, schedule, dataset, cfg) if sampling else None
    if cfg.distributed:
        dist.barrier()
    return losses, samples


def main(argv: list[str] | None = None) -> int:
    return cli_main(train, argv, "torch_impl")


if __name__ == "__main__":
    sys.exit(main())
