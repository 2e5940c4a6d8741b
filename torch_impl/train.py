"""DDPM noise-prediction training of the U-Net in PyTorch: ``python -m torch_impl.train``.

A thin loop over an importable step. To put this U-Net in your own loop::

    model = UNet("tiny"); model.enable_gradient_checkpointing("full")
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.0)
    loss = train_step(model, optimizer, batch)   # batch: shared_configs.training.Batch (numpy)

Batches, timesteps, noise and class contexts come from `shared_configs.training` (numpy), so
`jax_impl.train` sees the very same ones for the same seed. Dropout draws from torch's global RNG,
reseeded per step from (seed, step) so that a resumed run replays the same masks.
"""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from shared_configs import load_spec
from shared_configs.training import (
    Batch,
    Dataset,
    Schedule,
    TrainConfig,
    atomic_write,
    cli_main,
    load_dataset,
    make_schedule,
    progress_bar,
    sample,
    save_plots,
    step_seed,
)
from torch_impl.unet import UNet

CHECKPOINT = "checkpoint.pt"
DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with every hyperparameter explicit (torch's weight_decay default, 0.01, differs from optax's)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)


def as_tensors(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(noisy, t, noise, context) as torch tensors (NCHW, shared memory with the numpy batch)."""
    context = None if batch.context is None else torch.from_numpy(batch.context)
    return torch.from_numpy(batch.noisy), torch.from_numpy(batch.t), torch.from_numpy(batch.noise), context


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, autocast_dtype: torch.dtype | None = None
) -> float:
    """One DDPM step: predict the noise in ``batch.noisy`` at ``batch.t``, MSE, backward, update.

    ``model`` is a `UNet` (optionally with gradient checkpointing enabled, or wrapped in DDP);
    ``autocast_dtype=torch.bfloat16`` runs the forward in bf16 mixed precision (weights, loss and
    optimizer stay float32). Returns the loss as a Python float.
    """
    model.train()
    noisy, t, noise, context = as_tensors(batch)
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        pred = model(noisy, t, context)
    loss = F.mse_loss(pred.float(), noise)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.item()


@torch.no_grad()
def generate(model: UNet, schedule: Schedule, dataset: Dataset, cfg: TrainConfig) -> np.ndarray:
    """A grid of samples from the short ancestral sampler (dropout off)."""
    model.eval()
    spec = model.spec
    shape = (cfg.num_samples, spec.in_channels, spec.sample_size, spec.sample_size)

    def eps_fn(x: np.ndarray, t: np.ndarray, context: np.ndarray | None) -> np.ndarray:
        ctx = None if context is None else torch.from_numpy(context)
        return model(torch.from_numpy(x), torch.from_numpy(t), ctx).numpy()

    return sample(eps_fn, schedule, dataset, shape, cfg.sample_steps, cfg.seed)


def save_checkpoint(path: Path, model: UNet, optimizer: torch.optim.Optimizer, step: int, losses: list[float]) -> None:
    """Weights, optimizer state, step and loss history, written atomically."""
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "step": step,
        "losses": losses,
        "spec": model.spec.model_dump(mode="json"),
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write(path, buf.getvalue())


def load_checkpoint(path: Path, model: UNet, optimizer: torch.optim.Optimizer) -> tuple[int, list[float]]:
    """Restore ``model`` and ``optimizer`` in place; returns (step, losses so far)."""
    if not path.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {path}")
    state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    if state["spec"] != model.spec.model_dump(mode="json"):
        raise ValueError(f"--resume: {path} was trained with spec {state['spec']['name']!r}, not this --config")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"]), list(state["losses"])


def build(cfg: TrainConfig) -> tuple[UNet, torch.optim.Optimizer]:
    """The model (seeded init, checkpoint policy applied) and its optimizer."""
    torch.manual_seed(cfg.seed)
    model = UNet(load_spec(cfg.config))
    model.enable_gradient_checkpointing(cfg.policy)  # "none" resolves to an empty plan
    return model, make_optimizer(model, cfg.lr, cfg.weight_decay)


def _distributed(model: UNet) -> tuple[torch.nn.Module, int, int]:
    """DDP over gloo (CPU) when launched by torchrun; every rank holds the same seeded init."""
    if "RANK" not in os.environ:
        raise ValueError("--distributed: launch with torchrun, e.g. torchrun --nproc-per-node 2 -m torch_impl.train")
    dist.init_process_group("gloo")
    return DistributedDataParallel(model), dist.get_rank(), dist.get_world_size()


def distributed_step(ddp: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, cfg: TrainConfig) -> float:
    """`train_step` on this rank's shard of the global batch; returns the global mean loss.

    DDP averages gradients over ranks, so with equal shards the update equals a single process's
    on the whole batch (dropout masks differ, being drawn per shard).
    """
    loss = train_step(ddp, optimizer, batch.shard(dist.get_rank(), dist.get_world_size()), DTYPES[cfg.dtype])
    total = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def train(cfg: TrainConfig) -> list[float]:
    """Run (or resume) training as ``cfg`` says; returns the loss of every step from step 0."""
    model, optimizer = build(cfg)
    ddp, rank = (_distributed(model)[:2]) if cfg.distributed else (model, 0)
    dataset = load_dataset(cfg.data, model.spec, cfg.seed)
    schedule = make_schedule(cfg.schedule, cfg.timesteps)
    ckpt = Path(cfg.out) / CHECKPOINT
    start, losses = load_checkpoint(ckpt, model, optimizer) if cfg.resume else (0, [])
    with progress_bar(cfg.steps, start, f"torch {model.spec.name} {cfg.policy}") as update:
        for step in range(start, cfg.steps):
            batch = dataset.batch(step, cfg.batch_size, schedule, cfg.seed)
            torch.manual_seed(step_seed(cfg.seed, step))  # dropout masks depend on (seed, step) only
            if cfg.distributed:
                losses.append(distributed_step(ddp, optimizer, batch, cfg))
            else:
                losses.append(train_step(model, optimizer, batch, DTYPES[cfg.dtype]))
            update(losses[-1])
            if rank == 0 and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps):
                save_checkpoint(ckpt, model, optimizer, step + 1, losses)
    if cfg.distributed:
        dist.barrier()
        # Drop DDP (and its reducer) while the process group lives: otherwise the group is
        # destroyed from the reducer's destructor, which joins gloo's worker thread while holding
        # the GIL that thread needs to free its tensors: a deadlock at exit.
        del ddp
        dist.destroy_process_group()
    if rank != 0:
        return losses
    samples = generate(model, schedule, dataset, cfg) if cfg.sample_steps > 0 else None
    save_plots(cfg.out, losses, samples, f"torch_impl {model.spec.name}, policy {cfg.policy}")
    atomic_write(Path(cfg.out) / "losses.json", json.dumps(losses).encode())
    return losses


def main(argv: list[str] | None = None) -> int:
    return cli_main(train, argv, "torch_impl")


if __name__ == "__main__":
    sys.exit(main())
