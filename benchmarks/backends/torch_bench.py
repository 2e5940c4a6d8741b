"""The PyTorch training step, measured: `torch_impl.train.train_step`, the function a user's loop
calls (``zero_grad()`` first, forward, MSE, backward, AdamW). Imported by the worker.

Per row: a warm-up step under `FlopCounterMode` (it also makes the optimizer state), one step
under the memory instruments (`torch_impl.memory`: the peak, its breakdown and timeline,
the allocator's peak, the bytes saved for backward), on CPU one step under PyTorch's own
``MemTracker`` (the independent check), then ``steps`` timed, uninstrumented steps. FLOPs are
counted apart from memory because `FlopCounterMode`'s module tracking keeps tensors inside
checkpointed blocks alive, which would inflate their peak.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.backends import torch_ranks
from benchmarks.harness.job import (
    OPTIMIZER,
    Job,
    cpu_name,
    job_spec,
    policy_arg,
    timing_stats,
)
from shared_configs.regime import DEFAULT, LORA_TARGETS, Regime
from shared_configs.training.data import batch_bytes, step_arrays
from torch_impl import UNet
from torch_impl.flops import register_cpu_attention_flops
from torch_impl.memory import (
    FSDP_METHOD,
    TRACKER_METHOD,
    AllocatorPeak,
    SavedBytesCounter,
    StepTracker,
    memtracker,
)
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


def versions() -> dict[str, str]:
    return {"torch": torch.__version__}


def one_row_per_process(device: torch.device) -> bool:
    return False  # torch.cuda.reset_peak_memory_stats resets the peak between rows


def prepare(job: Job, device: torch.device) -> None:
    """Join the ranks' process group (``--world-size``); a diffusers folder's weights are loaded
    once first: if they do not fit, no row can run."""
    torch_ranks.init(job)
    if job.source == "diffusers":
        our_unet(job, job_spec(job))


def memory_method(device: torch.device, world_size: int = 1) -> str:
    attention = "attention: F.scaled_dot_product_attention (fused kernel)"
    if device.type == "cuda":
        return (
            f"torch.cuda.max_memory_allocated (after reset_peak_memory_stats); parts from the tensor-level tracker, "
            f"allocator overhead counted as temporaries; {attention}"
        )
    fsdp = FSDP_METHOD if world_size > 1 else ""
    return f"{attention}; peak and parts: {TRACKER_METHOD}{fsdp}"


def static_floor(job: Job) -> dict[str, int]:
    """What every step's peak holds at least, from parameter shapes alone (the model built on the
    meta device: no memory, no weights read): float32 parameters and buffers, and AdamW's two
    moments per parameter; in another regime the weights alone, in its weight dtype (a frozen base
    or another optimizer holds less state)."""
    with torch.device("meta"):
        model = UNet(job_spec(job))
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    if job.regime != DEFAULT:
        return {"param_count": params, "floor_bytes": 2 * params if job.precision == "bf16" else 4 * params}
    return {"param_count": params, "floor_bytes": 3 * 4 * params + buffers}


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step: Callable[[], Any], device: torch.device, steps: int) -> list[float]:
    samples = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return samples


def counted_step(step: Callable[[], Any], device: torch.device) -> tuple[float, int]:
    """Run one step under `FlopCounterMode`: (seconds, FLOPs of forward + backward)."""
    register_cpu_attention_flops()  # FlopCounterMode has no formula for the CPU attention kernel
    flops = FlopCounterMode(display=False)
    with flops:
        seconds = timed_steps(step, device, 1)[0]
    return seconds, flops.get_total_flops()


def memory_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: Callable[[], Any],
    device: torch.device,
    batch: Any,
    held: list[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """One step under the memory instruments: the peak, its parts and timeline; on CPU also the
    allocator's peak and PyTorch's MemTracker (the check), all watching the same step.

    The numpy batch is host memory the step reads: part of the peak on CPU; on a GPU the step's
    copies of it are device memory made in the forward (counted as activations). ``held``: other
    training state alive throughout (an EMA copy). The step runs eagerly: compiled code (torchao's
    8-bit AdamW step) cannot run under a tensor-tracking mode.
    """
    held = held or []
    saved = SavedBytesCounter(exclude=[*model.parameters(), *model.buffers()])
    tracker = StepTracker(model, optimizer, batch_bytes(batch) if device.type == "cpu" else 0, held)
    eager = torch.compiler.set_stance("force_eager")
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        with eager, tracker, saved:
            step()
        _sync(device)
        allocator_peak, check = torch.cuda.max_memory_allocated(device), {}
    else:
        stand_ins = [torch.from_numpy(a) for a in step_arrays(batch)] + held
        with eager, AllocatorPeak() as allocator, memtracker(model, optimizer, stand_ins) as check, tracker, saved:
            step()
        # The allocator's events show the blocks the step allocates, not the frees of older ones:
        # its peak sits on what persists (parameters, optimizer state, the batch), unless the step's
        # start (the previous gradients still alive) is higher.
        held = tracker.result.breakdown
        persistent = held["params"] + held["optimizer"] + held["input"]
        allocator_peak = max(tracker.result.baseline, persistent + allocator.peak)
    result = tracker.result
    breakdown = dict(result.breakdown)
    peak = result.peak
    if device.type == "cuda":  # the allocator's peak is the figure; what tensors do not explain is scratch
        breakdown["temporary"] += max(0, allocator_peak - peak)
        peak = max(peak, allocator_peak)
    return {
        "peak_bytes": peak,
        "tracker_peak_bytes": result.peak,
        "allocator_peak_bytes": allocator_peak,
        "memtracker_peak_bytes": check.get("peak"),
        "saved_bytes": saved.bytes,
        "timeline": result.timeline,
        **{f"{kind}_bytes": value for kind, value in breakdown.items()},
    }


def measure(job: Job, policy: str, batch_size: int, device: torch.device, build: Builder = build) -> dict[str, Any]:
    """Every measured figure of one (policy, batch size) row of the model ``build`` makes."""
    spec = job_spec(job)
    # The plan first, then FSDP2 (--world-size), as the training loop orders them.
    # The regime's adapters and casts, then FSDP2; the optimizer after sharding: over the shards.
    model = torch_ranks.shard(job, in_regime(build(job, spec, policy), job.regime).to(device))
    optimizer = make_optimizer(model, OPTIMIZER.lr, OPTIMIZER.weight_decay, job.regime)
    batch = torch_ranks.rank_batch(spec, batch_size, job)
    tools = step_tools(model, job.regime)
    step = functools.partial(train_step, model, optimizer, batch, tools=tools)
    held = [] if tools.ema is None else tools.ema.shadow
    # warm-up: makes the optimizer state (and the gradients the next step's zero_grad frees)
    first, flops = (timed_steps(step, device, 1)[0], None) if job.peak_only else counted_step(step, device)
    row: dict[str, Any] = {"flops": flops, **memory_step(model, optimizer, step, device, batch, held)}
    if policy not in job.timeline:
        row.pop("timeline")
    if not job.peak_only:
        row.update(timing_stats(timed_steps(step, device, job.steps)))
    row.update(
        static_bytes=torch_ranks.static_bytes(model, optimizer),
        param_count=sum(p.numel() for p in model.parameters()),  # a DTensor's numel is the whole parameter's
        first_step_s=first,  # under FlopCounterMode, so slower than a plain step
        compile_s=None,
        peak_method=memory_method(device, job.world_size),
        flops_method="torch.utils.flop_counter.FlopCounterMode (matmul, conv, attention)",
        saved_method="torch.autograd.graph.saved_tensors_hooks (distinct storages, params excluded)",
        check_method="PyTorch's own MemTracker (torch.distributed._tools.mem_tracker) watching the same step (CPU)",
    )
    return torch_ranks.gather(job, row)


def release(device: torch.device) -> None:
    """Free what a failed or finished row left behind (after an OOM, before the next row)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def oom_types() -> tuple[type[BaseException], ...]:
    return (torch.OutOfMemoryError, MemoryError)


def simulated_oom() -> BaseException:
    return torch.OutOfMemoryError("simulated: CUDA out of memory. Tried to allocate 1.00 GiB")
