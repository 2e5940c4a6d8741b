"""The PyTorch backend of the benchmark's worker (mirror: `benchmarks.backends.jax_bench`; docs/benchmark.md).

A row trains `torch_impl.train.train_step`, the function a user's loop calls: a warm-up step under
`FlopCounterMode` (it also makes the optimizer state), one step under `torch_impl.profile.measure_step`
(the planner's own measurement; on CPU with PyTorch's ``MemTracker`` as the check), then ``steps``
timed, uninstrumented steps. FLOPs are counted apart from memory: `FlopCounterMode`'s module
tracking keeps tensors inside checkpointed blocks alive, which would inflate their peak. ``--world-size N``:
N processes under torchrun (gloo), each sharded as ``--distributed fsdp`` trains and stepping on its slice
of the global batch; rank 0 reports, with the largest peak over the ranks.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.harness.job import OPTIMIZER, Job, cpu_name, job_spec, policy_arg, timing_stats
from shared_configs.regime import DEFAULT, LORA_TARGETS, Regime
from shared_configs.training.data import example_batch
from torch_impl import UNet
from torch_impl.flops import register_cpu_attention_flops
from torch_impl.memory import FSDP_METHOD, TRACKER_METHOD, state_tensors, storage_bytes
from torch_impl.parallel import shard_blocks
from torch_impl.profile import measure_step
from torch_impl.regime import DIFFUSERS_LORA_TARGETS, apply_regime, make_optimizer, step_tools
from torch_impl.train import train_step

Builder = Callable[[Job, Any, str], torch.nn.Module]


def resolve_device(requested: str) -> torch.device:
    if requested == "gpu" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("device: gpu requested but torch sees no CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")


def device_info(device: torch.device) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    return {"kind": "gpu" if device.type == "cuda" else "cpu", "name": name, "threads": torch.get_num_threads()}


VERSIONS = {"torch": torch.__version__}


def one_row_per_process(device: torch.device) -> bool:
    return False  # torch.cuda.reset_peak_memory_stats resets the peak between rows


def prepare(job: Job, device: torch.device) -> None:
    """Join the ranks' process group; a diffusers folder's weights first: if they do not fit, no row can run."""
    if job.world_size > 1 and not dist.is_initialized():
        if (started := int(os.environ.get("WORLD_SIZE", "1"))) != job.world_size:
            raise RuntimeError(f"world-size: the job asks for {job.world_size} processes, torchrun started {started}")
        dist.init_process_group("gloo")
    if job.source == "diffusers":
        our_unet(job, job_spec(job))


def memory_method(device: torch.device, world_size: int = 1) -> str:
    attention = "attention: F.scaled_dot_product_attention (fused kernel)"
    if device.type == "cuda":
        return (
            f"torch.cuda.max_memory_allocated (after reset_peak_memory_stats); parts from the tensor-level "
            f"tracker, allocator overhead counted as temporaries; {attention}"
        )
    return f"{attention}; peak and parts: {TRACKER_METHOD}{FSDP_METHOD if world_size > 1 else ''}"


def static_floor(job: Job) -> dict[str, int]:
    """The least any step's peak holds, from shapes on the meta device: the weights (and by default AdamW's state)."""
    with torch.device("meta"):
        model = UNet(job_spec(job))
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    floor = 3 * 4 * params + buffers if job.regime == DEFAULT else (2 if job.precision == "bf16" else 4) * params
    return {"param_count": params, "floor_bytes": floor}


def our_unet(job: Job, spec: Any) -> UNet:
    """Our U-Net with the weights every row starts from: seed 0, or the diffusers folder's."""
    if job.source == "diffusers":
        return UNet.from_diffusers(job.config)
    torch.manual_seed(0)
    return UNet(spec)


def build(job: Job, spec: Any, policy: str) -> torch.nn.Module:
    """The model a row trains, called as ``model(x, t, **conditioning)``, with ``policy`` applied."""
    model = our_unet(job, spec)
    model.enable_gradient_checkpointing(policy_arg(policy))
    return model


def in_regime(model: torch.nn.Module, regime: Regime) -> torch.nn.Module:
    """``model`` with ``regime``'s adapters (on the projections of our U-Net or diffusers') and casts."""
    return apply_regime(model, regime, LORA_TARGETS if isinstance(model, UNet) else DIFFUSERS_LORA_TARGETS)


def timed_steps(step: Callable[[], Any], device: torch.device, steps: int) -> list[float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    samples = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        samples.append(time.perf_counter() - t0)
    return samples


def measure(job: Job, policy: str, batch_size: int, device: torch.device, build: Builder = build) -> dict[str, Any]:
    """Every measured figure of one (policy, batch size) row of the model ``build`` makes."""
    spec = job_spec(job)
    # As the training loop orders them: the plan, the regime's adapters and casts, FSDP2 (--world-size),
    # then the optimizer over the shards.
    model = in_regime(build(job, spec, policy), job.regime).to(device)
    model = shard_blocks(model) if job.world_size > 1 else model
    optimizer = make_optimizer(model, OPTIMIZER.lr, OPTIMIZER.weight_decay, job.regime)
    batch = example_batch(spec, job.world_size * batch_size, job.context_length)  # this rank's slice of it
    batch = batch.shard(dist.get_rank(), job.world_size) if job.world_size > 1 else batch
    tools = step_tools(model, job.regime)
    step = functools.partial(train_step, model, optimizer, batch, tools=tools)
    held = [] if tools.ema is None else tools.ema.shadow  # the EMA copy lives through the step
    # warm-up: makes the optimizer state (and the gradients the next step's zero_grad frees); FLOPs of forward
    # + backward counted there (FlopCounterMode has no formula for the CPU attention kernel: registered)
    register_cpu_attention_flops()
    with contextlib.nullcontext(None) if job.peak_only else FlopCounterMode(display=False) as counter:
        first = timed_steps(step, device, 1)[0]
    row: dict[str, Any] = {
        "flops": None if counter is None else counter.get_total_flops(),
        **measure_step(model, optimizer, step, batch, held, check=True),
    }
    if policy not in job.timeline:
        row.pop("timeline")
    if not job.peak_only:
        row.update(timing_stats(timed_steps(step, device, job.steps)))
    row.update(
        static_bytes=storage_bytes(model.parameters()) + storage_bytes(state_tensors(optimizer)),  # this rank's
        param_count=sum(p.numel() for p in model.parameters()),  # a DTensor's numel is the whole parameter's
        first_step_s=first,  # under FlopCounterMode, so slower than a plain step
        compile_s=None,
        peak_method=memory_method(device, job.world_size),
        flops_method="torch.utils.flop_counter.FlopCounterMode (matmul, conv, attention)",
        saved_method="torch.autograd.graph.saved_tensors_hooks (distinct storages, params excluded)",
        check_method="PyTorch's own MemTracker (torch.distributed._tools.mem_tracker) watching the same step (CPU)",
    )
    peaks = [row["peak_bytes"]] * job.world_size  # every rank's own step's
    if job.world_size > 1:
        dist.all_gather_object(peaks, row["peak_bytes"])
    return row | {"world_size": job.world_size, "max_rank_peak_bytes": max(peaks)}


def release(device: torch.device) -> None:
    """Free what a failed or finished row left behind (after an OOM, before the next row)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


OOM_TYPES = (torch.OutOfMemoryError, MemoryError)
# a fresh error per raise (one instance raised again would keep every earlier raise's frames in its traceback)
simulated_oom = functools.partial(torch.OutOfMemoryError, "simulated: CUDA out of memory. Tried to allocate 1.00 GiB")
