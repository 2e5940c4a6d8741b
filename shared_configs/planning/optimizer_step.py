"""The optimizer step's temporaries: what each implementation allocates beyond the state it keeps.

torch picks the implementation per device (AdamW: ``foreach`` on CUDA, the per-parameter loop on CPU), so the
CPU profile holds the loop's temporaries. Each figure's source: `SOURCES` and docs/regimes.md. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared_configs.pair import ControlNetPairSpec
from shared_configs.planning.unit_flops import unit_ops
from shared_configs.regime import Regime
from shared_configs.spec import SpecError, UNetSpec

FLOAT32 = 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Where each figure comes from (torch 2.x, torchao 0.x source).
SOURCES = {
    ("adamw", "per-parameter"): "torch/optim/adam.py _single_tensor_adam: `denom = (exp_avg_sq.sqrt() / "
    "bias_correction2_sqrt).add_(eps)`: the sqrt and the quotient of one tensor alive together",
    ("adamw", "foreach"): "torch/optim/adam.py _multi_tensor_adam: `exp_avg_sq_sqrt = "
    "torch._foreach_sqrt(device_exp_avg_sqs)` for every trained tensor at once, alive to `_foreach_addcdiv_`: one "
    "more copy of the trained weights (the Adafactor docs: 'foreach ... uses ~ sizeof(params) more peak memory')",
    ("adamw", "fused"): "torch/optim/adam.py _fused_adam: `torch._fused_adamw_` updates weights and moments in place",
    ("adamw8bit", "torchao"): "torchao/optim/adam.py single_param_adam (compiled per tensor): the two moments "
    "dequantized to float32 (`exp_avg.float().lerp(...)`, `exp_avg_sq.float().lerp(...)`), read by the quantizing "
    "copy and the update: a bound, inductor may fuse them away",
    ("adamw8bit", "bitsandbytes"): "bitsandbytes/optim/optimizer.py Optimizer2State.update_step: "
    "`F.optimizer_update_8bit_blockwise` updates the weights and both 8-bit moments in place, in one CUDA kernel "
    "(diffusers' `--use_8bit_adam`)",
    ("adafactor", "per-parameter"): "torch/optim/_adafactor.py _single_tensor_adafactor (its default on every "
    "device): `var_estimate = row_var @ col_var`, one tensor's size, then updated in place",
    ("adafactor", "foreach"): "torch/optim/_adafactor.py _multi_tensor_adafactor: `var_estimates` of every tensor "
    "at once (only with foreach=True)",
}
# What each allocates, by `SOURCES`: copies of every trained value (all tensors at once), copies of the largest
# trained tensor (one tensor at a time).
COPIES = {
    ("adamw", "per-parameter"): (0, 2),
    ("adamw", "foreach"): (1, 0),
    ("adamw", "fused"): (0, 0),
    ("adamw8bit", "torchao"): (0, 2),
    ("adamw8bit", "bitsandbytes"): (0, 0),
    ("adafactor", "per-parameter"): (0, 1),
    ("adafactor", "foreach"): (1, 0),
}
DEFAULT = {  # torch's choice per (optimizer, device kind)
    ("adamw", "cpu"): "per-parameter",
    ("adamw", "cuda"): "foreach",
    ("adafactor", "cpu"): "per-parameter",
    ("adafactor", "cuda"): "per-parameter",
    ("adamw8bit", "cpu"): "torchao",
    ("adamw8bit", "cuda"): "torchao",
}


@dataclass(frozen=True)
class Trained:
    """The trained tensors as the optimizer sees them: values in all, the largest one's, bytes per value."""

    numel: int
    largest: int
    itemsize: int = FLOAT32


def implementation(optimizer: str, device: str, chosen: str | None = None) -> str:
    """``chosen``, checked against ``optimizer``, or torch's default on ``device`` ("cpu"/"cuda")."""
    name = chosen or DEFAULT[(optimizer, "cpu" if device == "cpu" else "cuda")]
    if (optimizer, name) not in SOURCES:
        allowed = ", ".join(i for o, i in SOURCES if o == optimizer)
        raise SpecError(f"optimizer implementation: {optimizer} runs as one of {allowed}, got {name!r}")
    return name


def temporaries(optimizer: str, name: str, trained: Trained) -> int:
    """The peak bytes the step allocates beyond weights, gradients and state (`SOURCES`)."""
    implementation(optimizer, "cpu", name)
    every, largest = COPIES[(optimizer, name)]
    itemsize = FLOAT32 if optimizer == "adamw8bit" else trained.itemsize  # 8-bit moments dequantized to float32
    return (every * trained.numel + largest * trained.largest) * itemsize


def describe(optimizer: str, name: str) -> str:
    """One line for a report: the implementation and where its figure comes from."""
    return f"{optimizer} as {name} ({SOURCES[(optimizer, name)].split(':')[0]})"


def trained_of(spec: UNetSpec | ControlNetPairSpec, regime: Regime, trained_bytes: int) -> Trained:
    """`Trained` of a step whose trained weights take ``trained_bytes``, its largest tensor from the spec."""
    itemsize = DTYPE_BYTES[regime.param_dtype]
    spec = spec.unet if isinstance(spec, ControlNetPairSpec) else spec
    ops = [op for per in unit_ops(spec, 1, 1).values() for op in per if op.cls != "attention"]
    rank = regime.lora_rank  # under LoRA, the trained tensors are the adapters
    sizes = [
        op.weights if rank is None else rank * max(op.fan_in, op.fan_out) for op in ops if rank is None or op.adapted
    ]
    return Trained(trained_bytes // itemsize, max(sizes, default=0), itemsize)
