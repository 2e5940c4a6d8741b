"""The PyTorch step under ``torch.compile``: the rows of ``benchmarks.compare --compile`` (docs/compile.md).

Framework ``compiled``, beside the eager ``torch`` rows, in its own worker: our U-Net with the row's
plan traced into the graph, ``torch.compile(model)``, trained by `torch_impl.train.train_step`. The
first step compiles (``compile_s``), a second warms up, one runs under
`torch_impl.profile.measure_step` without the tensor tracker (a dispatch mode would make Dynamo run
the model eagerly): the allocator's peak, as the eager rows' ``allocator_peak_bytes``. A row
``budget@P``: no plan, AOTAutograd's ``activation_memory_budget`` at P's compiled saved bytes over
``none``'s (both measured earlier in this process).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from benchmarks.backends import torch_bench
from benchmarks.backends.torch_bench import build, in_regime, timed_steps
from benchmarks.harness.job import OPTIMIZER, Job, job_spec, timing_stats
from shared_configs.training.data import example_batch
from torch_impl.compat import activation_memory_budget
from torch_impl.memory import state_tensors, storage_bytes
from torch_impl.profile import measure_step
from torch_impl.regime import make_optimizer, step_tools
from torch_impl.train import train_step

BASE = torch_bench  # the worker takes what this module does not define from there
BUDGET = "budget@"  # a row "budget@P": activation_memory_budget at plan P's saved bytes
PEAK_METHOD = {
    "cpu": "the CPU allocator's peak during the step (torch.profiler memory events) above what the step "
    "keeps (params, optimizer state, inputs), or the bytes alive at its start if higher",
    "cuda": "torch.cuda.max_memory_allocated (after reset_peak_memory_stats)",
}
# Saved bytes of the compiled rows measured so far in this process: (batch size, policy) -> bytes.
_SAVED: dict[tuple[int, str], int] = {}


def measure(job: Job, policy: str, batch_size: int, device: torch.device) -> dict[str, Any]:
    """Every figure of one compiled row (see the module's docstring)."""
    spec = job_spec(job)
    target = policy.removeprefix(BUDGET) if policy.startswith(BUDGET) else None
    ratio = 1.0  # budget@target: the activation_memory_budget at plan target's saved bytes over none's
    if target is not None:
        none, saved = _SAVED.get((batch_size, "none")), _SAVED.get((batch_size, target))
        if not none or saved is None:
            raise RuntimeError(f"{BUDGET}{target}: needs the compiled rows none and {target} (one failed)")
        ratio = min(1.0, saved / none)
    model = in_regime(build(job, spec, "none" if target is not None else policy), job.regime).to(device)
    optimizer = make_optimizer(model, OPTIMIZER.lr, OPTIMIZER.weight_decay, job.regime)
    batch = example_batch(spec, batch_size, job.context_length)
    with activation_memory_budget(ratio):  # every row compiles afresh
        step = functools.partial(
            train_step, torch.compile(model), optimizer, batch, tools=step_tools(model, job.regime)
        )
        compile_s, warm_s = timed_steps(step, device, 2)  # the first compiles the forward and backward graphs
        row = measure_step(model, optimizer, step, batch, tracked=False)
        row.update(timing_stats(timed_steps(step, device, job.steps)))
    if target is None:
        _SAVED[(batch_size, policy)] = row["saved_bytes"]
    return row | {
        "compile_s": compile_s,
        "first_step_s": warm_s,
        "activation_memory_budget": ratio,
        "static_bytes": storage_bytes([*model.parameters(), *model.buffers(), *state_tensors(optimizer)]),
        "param_count": sum(p.numel() for p in model.parameters()),
        "peak_method": f"torch.compile(model), default inductor; {PEAK_METHOD[device.type]}",
        "saved_method": "torch.autograd.graph.saved_tensors_hooks around the compiled step (params excluded)",
    }
