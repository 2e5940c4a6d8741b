"""DDPM noise-prediction training of the U-Net in PyTorch: ``python -m torch_impl.train``.

A thin loop over an importable step. To put this U-Net in your own loop::

    model = UNet("tiny"); model.enable_gradient_checkpointing("full")
    optimizer = make_optimizer(model, lr=1e-3, weight_decay=0.0)
    loss = train_step(model, optimizer, batch)   # batch: shared_configs.training.Batch (numpy)

Batches, timesteps, noise and class contexts come from `shared_configs.training` (numpy), so
`jax_impl.train` sees the very same ones for the same seed. Dropout draws from torch's global RNG,
reseeded per step from (seed, step) so that a resumed run replays the same masks.

Under torchrun, ``--distributed`` (DDP) or ``--distributed fsdp`` (FSDP2, one unit per U-Net
block) splits the global batch over processes (gloo, CPU); either way checkpoints are saved whole,
in the single-process format, so a run resumes with or without sharding.
"""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
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
    # First, as PyTorch's examples do: the previous step's gradients are freed (set_to_none, the
    # default) before this forward, so they never sit beside its activations.
    optimizer.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    noisy, t, noise, context = (None if a is None else a.to(device) for a in as_tensors(batch))
    with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        pred = model(noisy, t, context)
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

    def eps_fn(x: np.ndarray, t: np.ndarray, context: np.ndarray | None) -> np.ndarray:
        ctx = None if context is None else torch.from_numpy(context)
        return model(torch.from_numpy(x), torch.from_numpy(t), ctx).numpy()

    return sample(eps_fn, schedule, dataset, shape, cfg.sample_steps, cfg.seed)


def _rekey(optim_state: dict[str, Any], keys: Sequence[Any]) -> dict[str, Any]:
    """``optim_state`` with the i-th parameter of its param groups (in order) keyed ``keys[i]``."""
    groups = optim_state["param_groups"]
    new = dict(zip([k for g in groups for k in g["params"]], keys, strict=True))
    return {
        "state": {new[k]: v for k, v in optim_state["state"].items()},
        "param_groups": [{**g, "params": [new[k] for k in g["params"]]} for g in groups],
    }


def full_state(model: UNet, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Model and optimizer state dicts in the single-process format, whatever the sharding.

    Under FSDP2 a collective: every rank calls it, the shards are gathered onto rank 0 (the only
    rank whose result holds tensors) and the optimizer's parameter names become torch's indices.
    """
    if not isinstance(model, FSDPModule):
        return model.state_dict(), optimizer.state_dict()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    if not optim_state:  # cpu_offload: ranks other than 0 get empty dicts
        return model_state, optim_state
    return model_state, _rekey(optim_state, range(len(list(model.parameters()))))


def load_full_state(
    model: UNet, optimizer: torch.optim.Optimizer, model_state: dict[str, Any], optim_state: dict[str, Any]
) -> None:
    """Inverse of `full_state`: every rank passes the full state dicts, FSDP2 keeps its shard."""
    if not isinstance(model, FSDPModule):
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optim_state)
        return
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=options)
    names = [name for name, _ in model.named_parameters()]  # the optimizer's order (make_optimizer)
    set_optimizer_state_dict(model, optimizer, _rekey(optim_state, names), options=options)


def save_checkpoint(path: Path, model: UNet, optimizer: torch.optim.Optimizer, step: int, losses: list[float]) -> None:
    """Weights, optimizer state, step and loss history, written atomically by rank 0 (all ranks call it)."""
    model_state, optim_state = full_state(model, optimizer)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    state = {
        "model": model_state,
        "optimizer": optim_state,
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
    load_full_state(model, optimizer, state["model"], state["optimizer"])
    return int(state["step"]), list(state["losses"])


def build(cfg: TrainConfig) -> tuple[UNet, torch.nn.Module, torch.optim.Optimizer]:
    """The model (seeded init, checkpoint policy applied), the module to train and its optimizer.

    The module to train is the model, its DDP wrapper (``--distributed ddp``), or the model sharded
    in place (``fsdp``: the same object, its class swapped by `fully_shard`).
    """
    torch.manual_seed(cfg.seed)
    model = UNet(load_spec(cfg.config))
    model.enable_gradient_checkpointing(cfg.policy)  # "none" resolves to an empty plan
    # Plan first, then DDP/FSDP2: torchtitan's order, which its checkpoint *wrapper* needs (inside
    # the FSDP unit). Our shadowed forwards work in either order (see shard_blocks, tested both
    # ways), so the parallel wrapper simply stays the last transform.
    trained = _distributed(model, cfg.distributed) if cfg.distributed else model
    # Made after fully_shard, which replaces the parameters by their shards (DTensors).
    return model, trained, make_optimizer(model, cfg.lr, cfg.weight_decay)


def shard_blocks(model: UNet) -> UNet:
    """FSDP2 on CPU: one unit per U-Net block (``down.0`` ... ``mid`` ... ``up.N``), then the root.

    The root unit holds the rest (conv_in/out, time embedding, final norm). Checkpointing may be
    enabled before or after: `fully_shard` swaps the class but keeps the instance ``forward`` that
    `apply_plan` shadows, and its all-gather/free hooks run in ``Module.__call__``, around that
    forward. So a recompute calls the plain forward without re-gathering: FSDP's pre-backward hook
    has already unsharded the block's parameters when autograd reaches the recompute.
    """
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # explicit: the default mesh follows CUDA
    for name in model.block_names():
        fully_shard(model.get_submodule(name), mesh=mesh)
    return fully_shard(model, mesh=mesh)


PARALLEL = {"ddp": DistributedDataParallel, "fsdp": shard_blocks}


def _distributed(model: UNet, mode: str) -> torch.nn.Module:
    """DDP or FSDP2 over gloo (CPU) when launched by torchrun; every rank holds the same seeded init."""
    if "RANK" not in os.environ:
        raise ValueError(
            f"--distributed {mode}: launch with torchrun, e.g. torchrun --nproc-per-node 2 -m torch_impl.train"
        )
    dist.init_process_group("gloo")
    return PARALLEL[mode](model)


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
    """Run (or resume) training as ``cfg`` says; returns the loss of every step from step 0."""
    model, trained, optimizer = build(cfg)
    rank = dist.get_rank() if cfg.distributed else 0
    dataset = load_dataset(cfg.data, model.spec, cfg.seed)
    schedule = make_schedule(cfg.schedule, cfg.timesteps)
    ckpt = Path(cfg.out) / CHECKPOINT
    start, losses = load_checkpoint(ckpt, model, optimizer) if cfg.resume else (0, [])
    with progress_bar(cfg.steps, start, f"torch {model.spec.name} {cfg.policy}") as update:
        for step in range(start, cfg.steps):
            batch = dataset.batch(step, cfg.batch_size, schedule, cfg.seed)
            torch.manual_seed(step_seed(cfg.seed, step))  # dropout masks depend on (seed, step) only
            if cfg.distributed:
                losses.append(distributed_step(trained, optimizer, batch, cfg))
            else:
                losses.append(train_step(model, optimizer, batch, DTYPES[cfg.dtype]))
            update(losses[-1])
            if (step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps:
                save_checkpoint(ckpt, model, optimizer, step + 1, losses)
    # Under FSDP2 each forward all-gathers from every rank: all sample while the group lives.
    sampling = cfg.sample_steps > 0 and (rank == 0 or cfg.distributed == "fsdp")
    samples = generate(model, schedule, dataset, cfg) if sampling else None
    if cfg.distributed:
        dist.barrier()
        # Drop DDP (and its reducer) while the process group lives: otherwise the group is
        # destroyed from the reducer's destructor, which joins gloo's worker thread while holding
        # the GIL that thread needs to free its tensors: a deadlock at exit.
        del trained
        dist.destroy_process_group()
    if rank != 0:
        return losses
    save_plots(cfg.out, losses, samples, f"torch_impl {model.spec.name}, policy {cfg.policy}")
    atomic_write(Path(cfg.out) / "losses.json", json.dumps(losses).encode())
    return losses


def main(argv: list[str] | None = None) -> int:
    return cli_main(train, argv, "torch_impl")


if __name__ == "__main__":
    sys.exit(main())
