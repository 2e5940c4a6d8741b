"""FLOP counting that sees attention on CPU too.

`torch.utils.flop_counter` has formulas for the CUDA attention kernels but not for the CPU one
(`_scaled_dot_product_flash_attention_for_cpu`), so on CPU every attention matmul counts as zero.
`register_cpu_attention_flops` adds the same formulas for the CPU kernel and its backward.
"""

from __future__ import annotations

from torch.utils import flop_counter

from torch_impl.compat import aten

# The CPU kernel's forward and backward -> the CUDA kernels' formulas, on the shapes they take first.
_FORMULAS = {
    aten("_scaled_dot_product_flash_attention_for_cpu"): (
        lambda query, key, value, *args, **kwargs: flop_counter.sdpa_flop_count(query, key, value)
    ),
    aten("_scaled_dot_product_flash_attention_for_cpu_backward"): (
        lambda grad_out, query, key, value, *args, **kwargs: flop_counter.sdpa_backward_flop_count(
            grad_out, query, key, value
        )
    ),
}


def register_cpu_attention_flops() -> None:
    """Idempotent: teach `FlopCounterMode` the CPU attention kernel's forward and backward."""
    for op, formula in _FORMULAS.items():
        if op not in flop_counter.flop_registry:
            flop_counter.register_flop_formula(op)(formula)
