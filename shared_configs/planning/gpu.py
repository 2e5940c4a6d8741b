"""What a CUDA training step holds that a CPU shapes profile does not (``--device cuda``): autocast's float32 norms,
padded logsumexp, cuBLAS workspaces, the allocator's rounding and fragmentation, the CUDA context, the optimizer's
temporaries. Each term and its source: docs/regimes.md "What a GPU holds". No torch import.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from shared_configs.arch import down_blocks, up_blocks
from shared_configs.pair import CONTROLNET, ControlNetPairSpec
from shared_configs.planning import optimizer_step
from shared_configs.planning.budget import Cost, Profile, predict, with_static_bytes
from shared_configs.planning.unit_flops import HIDDEN, Op, in_encoder, unit_ops
from shared_configs.planning.units import PLAIN, StepSpec, block_layers
from shared_configs.regime import Regime
from shared_configs.sizes import KIB, MIB
from shared_configs.spec import UNetSpec

# c10/cuda/CUDACachingAllocator.cpp: kMinBlockSize, kLargeBuffer (the segment of a 1-10 MiB request; PyTorch's
# "CUDA semantics" notes describe the same pools).
MIN_BLOCK = 512
LARGE_BUFFER = 20 * MIB
# Sources of the next four (pytorch#40989, #89027, #86509): docs/regimes.md "What a GPU holds".
FRAGMENTATION = 1.11  # peak reserved over peak allocated
CUBLAS_WORKSPACE = 2 * 4096 * KIB + 8 * 16 * KIB  # CublasHandlePool.cpp's ":4096:2:16:8"
CUBLAS_WORKSPACE_HOPPER = 32 * MIB
# cudaMemGetInfo's used bytes after one tensor with lazy module loading (torch's default), less its segment.
CONTEXT_LAZY = 287_047_680 - LARGE_BUFFER
LSE_BYTES = 4  # the logsumexp is float32 whatever the compute dtype
MEM_EFFICIENT_QUERY_BLOCK = 32  # the memory-efficient kernel pads its logsumexp's queries to this
AUTOCAST_EXTRA = 2  # float32 (4 B) where CPU autocast keeps 2-byte bfloat16/float16


def round_size(size: int) -> int:
    """The bytes the caching allocator hands out for a request (what ``memory_allocated`` counts)."""
    return max(MIN_BLOCK, MIN_BLOCK * math.ceil(size / MIN_BLOCK))


def _heads(spec: UNetSpec, unit: str) -> int:
    """Attention heads of an attention unit (``down.1.attentions.0``, ``mid.attentions.0``)."""
    block = unit.split(".attentions.")[0]
    levels = {b.name: b.level for b in (*down_blocks(spec), *up_blocks(spec))}
    return spec.attention_shape(block, levels.get(block, -1))[0]


def _per_attention(
    spec: UNetSpec, batch_size: int, context_length: int, nbytes: Callable[[int, int, int], int]
) -> dict[str, int]:
    """Per unit, ``nbytes(heads, queries, keys per sample)`` summed over its attentions (from their q and k
    projections' rows)."""
    out: Counter[str] = Counter()
    for unit, ops in unit_ops(spec, batch_size, context_length).items():
        for i, op in enumerate(ops):
            if op.cls == "attention":
                out[unit] += nbytes(_heads(spec, unit), ops[i - 3].rows // batch_size, ops[i - 2].rows // batch_size)
    return dict(out)


def logsumexp_bytes(spec: UNetSpec, batch_size: int, context_length: int = 77, block: int = 1) -> dict[str, int]:
    """Per unit, the float32 logsumexp its fused attentions keep, queries padded to a multiple of ``block``."""
    return _per_attention(
        spec,
        batch_size,
        context_length,
        lambda heads, queries, _: LSE_BYTES * batch_size * heads * block * math.ceil(queries / block),
    )


def probabilities_bytes(spec: UNetSpec, batch_size: int, regime: Regime, context_length: int = 77) -> dict[str, int]:
    """Per unit, what an unfused attention keeps beyond a fused one: softmax output and half cast, less the LSE."""
    per_element = 4 + (2 if regime.autocast else 0)  # autocast's half copy
    return _per_attention(
        spec,
        batch_size,
        context_length,
        lambda heads, queries, keys: batch_size * heads * queries * (per_element * keys - LSE_BYTES),
    )


def _norms(unit: str, ops: list[Op]) -> Iterable[tuple[int, bool]]:
    """(input elements, SiLU follows) of each GroupNorm/LayerNorm of a unit, read off the op that consumes it:
    3x3 convs (norm + SiLU), proj_in, the first of q/k/v and the feed-forward's first matmul (a norm)."""
    if ".resnets." in unit:
        yield from ((op.rows * op.fan_in // 9, True) for op in (ops[0], ops[2]))
    elif unit == "head":
        yield ops[0].rows * ops[0].fan_in // 9, True
    elif ".attentions." in unit:
        for i, op in enumerate(ops):
            first_of_qkv = op.branch and op.adapted and op.source == HIDDEN and not (i and ops[i - 1].branch)
            proj_in = i == 0 and not op.branch
            feed_forward = op.cls == "matmul" and op.fan_out == 8 * op.fan_in
            if first_of_qkv or proj_in or feed_forward:
                yield op.rows * op.fan_in, False


def autocast_bytes(spec: UNetSpec, batch_size: int, context_length: int = 77) -> dict[str, int]:
    """Per leaf unit, what CUDA autocast's float32 norms keep beyond CPU autocast's half-precision ones."""
    extra = {
        u: sum(AUTOCAST_EXTRA * n * (2 if silu else 1) for n, silu in _norms(u, ops))
        for u, ops in unit_ops(spec, batch_size, context_length).items()
    }
    return {u: n for u, n in extra.items() if n}


def kept_bytes(
    spec: StepSpec, batch_size: int, regime: Regime, context_length: int = 77, unfused: bool = False
) -> dict[str, int]:
    """Per leaf unit, what a plain unit keeps on a GPU beyond the CPU profile: autocast's float32 norms,
    fp32's padded logsumexp, ``unfused``: the probabilities. ControlNet: the frozen U-Net's encoder keeps none."""
    if isinstance(spec, ControlNetPairSpec):
        unet = kept_bytes(spec.unet, batch_size, regime, context_length, unfused)
        encoder = {u: v for u, v in unet.items() if in_encoder(u)}
        return {CONTROLNET + u: v for u, v in encoder.items()} | {u: v for u, v in unet.items() if u not in encoder}
    out: Counter[str] = Counter()
    if regime.autocast:  # CUDA autocast's float32 norms
        out.update(autocast_bytes(spec, batch_size, context_length))
    if regime.precision == "fp32":
        padded = logsumexp_bytes(spec, batch_size, context_length, MEM_EFFICIENT_QUERY_BLOCK)
        plain = logsumexp_bytes(spec, batch_size, context_length)
        out.update({u: padded[u] - plain[u] for u in padded if padded[u] > plain[u]})
    if unfused:
        out.update(probabilities_bytes(spec, batch_size, regime, context_length))
    return dict(out)


def workspace_bytes(hopper: bool = False) -> int:
    """cuBLAS's workspace and cuBLASLt's (counted at the same size: a bound), one stream."""
    return 2 * (CUBLAS_WORKSPACE_HOPPER if hopper else CUBLAS_WORKSPACE)


# State tensors per trained parameter tensor: AdamW's two moments; 8-bit AdamW's two code tensors
# and their two scale tensors; Adafactor's row and column factors (a bound for its vectors).
STATE_TENSORS = {"adamw": 2, "adamw8bit": 4, "adafactor": 2}
SAVED_PER_OP = 4  # a bound on what one conv/matmul/attention/norm keeps or holds (input, cast, stats)


def tensor_count(spec: UNetSpec, regime: Regime) -> int:
    """A bound on the tensors alive at a step's peak: parameters, gradients, state, EMA, `SAVED_PER_OP` per op."""
    ops = unit_ops(spec, 1, 1)
    weighted = sum(op.cls != "attention" for unit_ops_ in ops.values() for op in unit_ops_)
    norms = sum(1 for unit, unit_ops_ in ops.items() for _ in _norms(unit, unit_ops_))
    params = 2 * (weighted + norms)
    adapted = sum(op.adapted for unit_ops_ in ops.values() for op in unit_ops_)
    trained = params if regime.lora_rank is None else 2 * adapted
    per_trained = 1 + STATE_TENSORS[regime.optimizer] + (1 if regime.ema else 0)
    every_op = sum(len(unit_ops_) for unit_ops_ in ops.values()) + norms
    return params + trained + trained * per_trained + SAVED_PER_OP * every_op


def rounding_bound(spec: StepSpec, regime: Regime) -> int:
    """What the 512-byte rounding can add at the peak: 511 B per `tensor_count` (the ControlNet step: twice)."""
    if isinstance(spec, ControlNetPairSpec):
        return 2 * rounding_bound(spec.unet, regime)
    return (MIN_BLOCK - 1) * tensor_count(spec, regime)


@dataclass(frozen=True)
class Device:
    """The GPU a flavour is for (Hopper: 32 MiB cuBLAS workspaces)."""

    hopper: bool = False
    context: int = CONTEXT_LAZY  # the CUDA context's bytes
    unfused_attention: bool = False  # the step's attention keeps its probabilities (no SDPA, no xformers)
    optimizer_impl: str | None = None  # how the optimizer runs (`optimizer_step.SOURCES`); None: torch's default


DEVICES = {"cuda": Device(), "cuda-sm90": Device(hopper=True)}


def optimizer_delta(profile: Profile, spec: StepSpec, regime: Regime, chosen: str | None = None) -> int:
    """What the CUDA optimizer step's temporaries (its default, or ``chosen``) add to the CPU's per-parameter loop."""
    trained = optimizer_step.trained_of(spec, regime, profile.grad_bytes)
    cpu = optimizer_step.temporaries(regime.profiled.optimizer, "per-parameter", trained)
    name = optimizer_step.implementation(regime.optimizer, "cuda", chosen)
    return optimizer_step.temporaries(regime.optimizer, name, trained) - cpu


def gpu_profile(profile: Profile, spec: StepSpec, regime: Regime, device: Device = Device()) -> Profile:
    """``profile`` as ``max_memory_allocated`` sees it on ``device``: `kept_bytes` per unit (kept when plain,
    alive in its backward when recomputed), `optimizer_delta` at its step, workspaces and rounding throughout."""
    leaves = kept_bytes(spec, profile.batch_size, regime, profile.context_length, device.unfused_attention)
    blocks = block_layers(spec)
    units: dict[str, dict[str, Cost]] = {}
    for unit, per in profile.units.items():
        # a whole block keeps what its layers and samplers do
        d = sum(v for k, v in leaves.items() if k.startswith(unit + ".")) if unit in blocks else leaves.get(unit, 0)
        units[unit] = {
            c: replace(v, keep=v.keep + d, fwd_peak=v.fwd_peak + d, bwd_peak=v.bwd_peak + d)
            if c == PLAIN
            else replace(v, bwd_peak=v.bwd_peak + d)
            for c, v in per.items()
        }
    delta = optimizer_delta(profile, spec, regime, device.optimizer_impl)
    flavoured = replace(profile, units=units, opt_peak=max(profile.opt_peak + delta, 0) if profile.opt_peak else 0)
    return with_static_bytes(flavoured, workspace_bytes(device.hopper) + rounding_bound(spec, regime))


@dataclass(frozen=True)
class GpuEstimate:
    """A policy's peak on a GPU as allocated, reserved and ``nvidia-smi`` (``device_bytes``) read it, and each term
    beside the CPU's; as JSON, `dataclasses.asdict`."""

    cpu_peak_bytes: int
    allocated_bytes: int
    reserved_bytes: int
    device_bytes: int
    peak_at: str
    terms: dict[str, int]


def estimate(
    profile: Profile,
    spec: StepSpec,
    regime: Regime,
    assignment: dict[str, str],
    device: Device = Device(),
    extend: Callable[[Profile, str], Profile] | None = None,
) -> GpuEstimate:
    """``assignment``'s peak on ``device``: allocated, times `FRAGMENTATION` (reserved), plus the context
    (``nvidia-smi``). ``extend`` adds what runs beside the U-Net ("cpu" or "cuda", `planning.whole`)."""
    extend = extend or (lambda p, _kind: p)
    on_cpu = extend(profile, "cpu")
    flavoured = extend(gpu_profile(profile, spec, regime, device), "cuda")
    cpu, gpu = predict(on_cpu, spec, assignment), predict(flavoured, spec, assignment)
    reserved = round(gpu.peak_bytes * FRAGMENTATION)
    static = round(profile.scale * (workspace_bytes(device.hopper) + rounding_bound(spec, regime)))
    name = optimizer_step.implementation(regime.optimizer, "cuda", device.optimizer_impl)
    # the peak moved to (or stayed at) the optimizer step: all it adds over the CPU's peak is that step's
    at_step = gpu.peak_bytes - cpu.peak_bytes - static if gpu.peak_unit == "optimizer" else 0
    terms = {
        # at the flavour's peak, which may sit at another unit than the CPU estimate's
        "activations (autocast norms, attention)": gpu.peak_bytes - cpu.peak_bytes - static - at_step,
        f"optimizer step ({name}, over the CPU's peak)": at_step,
        "cuBLAS + cuBLASLt workspaces": workspace_bytes(device.hopper),
        "rounding (bound)": rounding_bound(spec, regime),
        "fragmentation (reserved - allocated)": reserved - gpu.peak_bytes,
        "CUDA context": device.context,
    }
    return GpuEstimate(cpu.peak_bytes, gpu.peak_bytes, reserved, reserved + device.context, gpu.peak_unit, terms)


def device_budget(budget: int, device: Device = Device()) -> int:
    """The allocated peak a step may reach to fit ``budget`` bytes as ``nvidia-smi`` counts them."""
    return int((budget - device.context) / FRAGMENTATION)
