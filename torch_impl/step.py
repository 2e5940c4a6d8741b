"""The PyTorch training step: `train_step(model, optimizer, batch)`, the step to put in your own loop.

One DDPM step (predict the noise, MSE, backward, update) of a `UNet` or a `ControlNetPair`, wrapped or
not, in the regime of `torch_impl.regime.step_tools`; the training CLI's loop (`torch_impl.train`), the
planner's profile (`torch_impl.profile`) and the benchmark all step it. Mirror: `jax_impl/step.py`;
docs/training.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shared_configs.training.data import Batch, check_conditioning
from torch_impl.regime import PLAIN_STEP, StepTools


def as_tensors(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor | None]]:
    """(noisy, t, noise, conditioning by name) as torch tensors (NCHW, sharing the numpy batch's memory)."""
    conditioning = {k: None if v is None else torch.from_numpy(v) for k, v in batch.conditioning().items()}
    return torch.from_numpy(batch.noisy), torch.from_numpy(batch.t), torch.from_numpy(batch.noise), conditioning


def train_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, *, tools: StepTools = PLAIN_STEP
) -> float:
    """One DDPM step (predict the noise in ``batch.noisy`` at ``batch.t``, MSE, backward, update) of a
    `UNet` or `ControlNetPair`, wrapped or not, in the regime of ``tools`` (`torch_impl.regime.step_tools`).
    Every conditioning input the batch carries is passed by name. Returns the loss as a float."""
    return step_loss(model, optimizer, batch, tools=tools).item()


def step_loss(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, *, tools: StepTools = PLAIN_STEP
) -> torch.Tensor:
    """`train_step` without reading the loss: the planner's profile runs it on fake tensors (pass no
    ``GradScaler`` there: it reads values)."""
    # the spec of a `UNet`, of one wrapped in DDP (``.module``), or of a module that says (``.spec``)
    if (spec := getattr(model, "spec", None) or getattr(getattr(model, "module", None), "spec", None)) is not None:
        check_conditioning(spec, batch.conditioning())
    model.train()
    # First, as PyTorch's examples do: the previous step's gradients are freed before this forward, so they
    # never sit beside its activations (a regime that keeps them, DreamBooth's default, zeroes them in place).
    optimizer.zero_grad(set_to_none=not tools.keep_grads)
    first = next(model.parameters())
    device, dtype = first.device, first.dtype
    noisy, t, noise, conditioning = as_tensors(batch)
    noisy, t, noise = noisy.to(device, dtype), t.to(device), noise.to(device)
    # floating inputs in the model's dtype (labels stay integer), but time_ids stay float32 as t does
    # (pixel sizes up to 2048 and more)
    conditioning = {
        k: v if v is None else v.to(device, dtype if v.is_floating_point() and k != "time_ids" else v.dtype)
        for k, v in conditioning.items()
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


def distributed_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, tools: StepTools = PLAIN_STEP
) -> float:
    """`train_step` on this rank's shard of the global batch; returns the global mean loss (DDP and
    FSDP2 average the gradients over ranks: the update is one process's on the whole batch)."""
    loss = train_step(model, optimizer, batch.shard(dist.get_rank(), dist.get_world_size()), tools=tools)
    total = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()
