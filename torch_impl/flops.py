"""FLOP counting that sees attention on CPU too.

`torch.utils.flop_counter` has formulas for the CUDA attention kernels but not for the CPU one
(`_scaled_dot_product_flash_attention_for_cpu`), so on CPU every attention matmul counts as zero.
`register_cpu_attention_flops` adds the same formulas for the CPU kernel and its backward.
"""

from __future__ import annotations

import torch
from torch.utils import flop_counter

_aten = torch.ops.aten
_CPU_FORWARD = _aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward


def _forward(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)


def _backward(grad_out_shape, query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def register_cpu_attention_flops() -> None:
    """Idempotent: teach `FlopCounterMode` the CPU attention kernel's forward and backward."""
    for op, formula in ((_CPU_FORWARD, _forward), (_CPU_BACKWARD, _backward)):
        if op not in flop_counter.flop_registry:
            flop_counter.register_flop_formula(op)(formula)
