"""Data parallelism and FSDP in torch: DDP or FSDP2 (`fully_shard`) over gloo, launched by torchrun.

``--distributed fsdp`` shards with FSDP2, one unit per U-Net block; either way each rank trains on
its slice of the global batch, and the checkpoint plan is applied first. Mirror: `jax_impl.parallel`.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from shared_configs.training.config import TrainConfig
from torch_impl.unet import UNet


def shard_blocks(model: UNet) -> UNet:
    """FSDP2 on CPU: one unit per U-Net block, then the root (the rest).

    Checkpointing may be enabled before or after: `fully_shard` keeps the instance ``forward`` that
    `apply_plan` shadows, and its all-gather hooks run in ``Module.__call__`` around it; the
    pre-backward hook has unsharded the block's parameters when autograd reaches the recompute.
    """
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # explicit: the default mesh follows CUDA
    for name in model.block_names():
        fully_shard(model.get_submodule(name), mesh=mesh)
    return fully_shard(model, mesh=mesh)


PARALLEL = {"ddp": DistributedDataParallel, "fsdp": shard_blocks}


def wrap(model: UNet, mode: str) -> torch.nn.Module:
    """DDP or FSDP2 over gloo (CPU); every rank holds the same seeded init."""
    dist.init_process_group("gloo")
    return PARALLEL[mode](model)


def launch(cfg: TrainConfig) -> int:
    """This process's rank, after checking the launch suits ``--distributed`` (before any work)."""
    if not cfg.distributed:
        return 0
    if "RANK" not in os.environ:
        raise ValueError(
            f"--distributed {cfg.distributed}: launch with torchrun, "
            "e.g. torchrun --nproc-per-node 2 -m torch_impl.train"
        )
    world = int(os.environ["WORLD_SIZE"])
    if cfg.batch_size % world:
        raise ValueError(f"--batch-size {cfg.batch_size}: does not split evenly over {world} processes")
    return int(os.environ["RANK"])
