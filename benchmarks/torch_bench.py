"""One PyTorch training step (forward, MSE loss, backward, AdamW), measured. Imported by the worker.

Per row: a warm-up step under `FlopCounterMode` (it also creates gradients and optimizer state),
one step under the memory instruments (peak bytes, saved-for-backward bytes) and ``steps`` timed,
uninstrumented steps. FLOPs are counted apart from memory because `FlopCounterMode`'s module
tracking keeps tensors inside checkpointed blocks alive, which would inflate their peak.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import Job, cpu_name, job_spec, policy_arg, timing_stats
from benchmarks.torch_memory import AllocatorPeak, LiveBytesTracker, SavedBytesCounter, storage_bytes
from torch_impl import UNet

try:  # FlopCounterMode has no formula for the CPU attention kernel; torch_impl teaches it one
    from torch_impl.flops import register_cpu_attention_flops
except ImportError:  # pragma: no cover
    register_cpu_attention_flops = None

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TIMESTEPS = 1000


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


def memory_method(device: torch.device) -> str:
    if device.type == "cuda":
        return "torch.cuda.max_memory_allocated (after reset_peak_memory_stats)"
    return (
        "live tensor-storage bytes (TorchDispatchMode tracker); allocator_peak_bytes from torch.profiler memory events"
    )


def make_batch(spec: Any, batch_size: int, context_length: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Deterministic inputs: NCHW noise, integer timesteps, context if the spec cross-attends."""
    g = torch.Generator().manual_seed(0)
    shape = (batch_size, spec.in_channels, spec.sample_size, spec.sample_size)
    batch = {
        "x": torch.randn(shape, generator=g),
        "t": torch.randint(0, TIMESTEPS, (batch_size,), generator=g).float(),
        "target": torch.randn((batch_size, spec.out_channels, spec.sample_size, spec.sample_size), generator=g),
        "context": None,
    }
    if spec.cross_attention_dim is not None:
        batch["context"] = torch.randn((batch_size, context_length, spec.cross_attention_dim), generator=g)
    return {k: None if v is None else v.to(device, dtype if k != "t" else torch.float32) for k, v in batch.items()}


def our_unet(job: Job, spec: Any) -> UNet:
    """Our U-Net with the weights every row starts from: seed 0, or the diffusers folder's."""
    if job.source == "diffusers":
        return UNet.from_diffusers(job.config)
    torch.manual_seed(0)
    return UNet(spec)


def build(job: Job, spec: Any, policy: str) -> torch.nn.Module:
    """The model a row trains, called as ``model(x, t, context)``, with ``policy`` applied."""
    model = our_unet(job, spec)
    model.enable_gradient_checkpointing(policy_arg(policy))
    return model


Builder = Callable[[Job, Any, str], torch.nn.Module]


def trainable(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """``model`` on ``device`` in ``dtype``, in train mode, and its AdamW."""
    model = model.to(device=device, dtype=dtype).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def make_step(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: dict) -> Callable[[], None]:
    dtype = next(model.parameters()).dtype
    # bfloat16 parameters still meet float32 timestep features (as in Flax, where dtypes
    # promote); autocast does that cast. A no-op in float32.
    autocast = torch.autocast(batch["x"].device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step() -> None:
        # Gradients stay allocated between steps (set_to_none=False), so they are static memory,
        # as the split into static and dynamic bytes assumes.
        opt.zero_grad(set_to_none=False)
        with autocast:
            out = model(batch["x"], batch["t"], batch["context"])
        F.mse_loss(out.float(), batch["target"].float()).backward()
        opt.step()

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def static_tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    params = list(model.parameters())
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "params": params,
        "grads": [p.grad for p in params if p.grad is not None],
        "opt": state,
        "buffers": list(model.buffers()),
    }


def counted_step(step: Callable[[], None], device: torch.device) -> tuple[float, int]:
    """Run one step under `FlopCounterMode`: (seconds, FLOPs of forward + backward)."""
    if register_cpu_attention_flops is not None:
        register_cpu_attention_flops()
    flops = FlopCounterMode(display=False)
    with flops:
        seconds = timed_steps(step, device, 1)[0]
    return seconds, flops.get_total_flops()


def memory_step(
    model: torch.nn.Module, step: Callable[[], None], device: torch.device, existing: list
) -> dict[str, int]:
    """Peak bytes (tensor-level and, on CPU, allocator-level) and saved-for-backward bytes of one step."""
    saved = SavedBytesCounter(exclude=[*model.parameters(), *model.buffers()])
    if device.type == "cuda":  # the allocator's own peak: nothing lower-level to compare it with
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        with saved:
            step()
        _sync(device)
        peak = allocator_peak = torch.cuda.max_memory_allocated(device)
    else:
        with AllocatorPeak() as allocator, LiveBytesTracker(existing) as tracker, saved:
            step()
        peak = tracker.peak
        allocator_peak = tracker.baseline + allocator.peak
    return {"peak_bytes": peak, "allocator_peak_bytes": allocator_peak, "saved_bytes": saved.bytes}


def timed_steps(step: Callable[[], None], device: torch.device, steps: int) -> list[float]:
    samples = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return samples


def measure(job: Job, policy: str, batch_size: int, device: torch.device, build: Builder = build) -> dict[str, Any]:
    """Every measured figure of one (policy, batch size) row of the model ``build`` makes."""
    spec = job_spec(job)
    dtype = DTYPES[job.dtype]
    model, opt = trainable(build(job, spec, policy), dtype, device)
    batch = make_batch(spec, batch_size, job.context_length, dtype, device)
    step = make_step(model, opt, batch)
    # warm-up: creates grads and optimizer state
    first, flops = (timed_steps(step, device, 1)[0], None) if job.peak_only else counted_step(step, device)
    groups = static_tensors(model, opt)
    inputs = [v for v in batch.values() if v is not None]
    static = sum(storage_bytes(groups[k]) for k in ("params", "grads", "opt", "buffers"))
    row: dict[str, Any] = {
        "flops": flops,
        **memory_step(model, step, device, [t for g in groups.values() for t in g] + inputs),
    }
    if not job.peak_only:
        row.update(timing_stats(timed_steps(step, device, job.steps)))
    input_bytes = storage_bytes(inputs)
    row.update(
        static_bytes=static,
        input_bytes=input_bytes,
        activation_bytes=row["peak_bytes"] - static - input_bytes,
        param_count=sum(p.numel() for p in groups["params"]),
        first_step_s=first,  # under FlopCounterMode, so slower than a plain step
        compile_s=None,
        peak_method=memory_method(device),
        flops_method="torch.utils.flop_counter.FlopCounterMode (matmul, conv, attention)",
        saved_method="torch.autograd.graph.saved_tensors_hooks (distinct storages, params excluded)",
    )
    return row


def release(device: torch.device) -> None:
    """Free what a failed or finished row left behind (after an OOM, before the next row)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def oom_types() -> tuple[type[BaseException], ...]:
    return (torch.OutOfMemoryError, MemoryError)


def simulated_oom() -> BaseException:
    return torch.OutOfMemoryError("simulated: CUDA out of memory. Tried to allocate 1.00 GiB")
