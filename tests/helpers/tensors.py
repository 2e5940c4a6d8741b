"""Comparing the frameworks: relative errors, named inputs as torch or Flax arrays, perturbed weights,
FLOPs counted per module. Frameworks are imported inside, so a test module imports only the one it uses."""

from __future__ import annotations

from typing import Any

import numpy as np


def rel_err(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def as_torch(inputs: dict[str, Any]) -> dict[str, Any]:
    """`shared_configs.inputs.example_inputs` (NCHW numpy) -> torch tensors, by name (None kept)."""
    import torch

    return {k: None if v is None else torch.from_numpy(v) for k, v in inputs.items()}


def as_flax(inputs: dict[str, Any]) -> dict[str, Any]:
    """`shared_configs.inputs.example_inputs` (NCHW numpy) -> jax arrays with x in NHWC, by name (None kept)."""
    import jax.numpy as jnp

    out = {k: None if v is None else jnp.asarray(v) for k, v in inputs.items()}
    out["x"] = jnp.asarray(inputs["x"].transpose(0, 2, 3, 1))
    return out


def randomize_(model: Any, seed: int = 0, scale: float = 0.2) -> None:
    """Perturb every torch parameter (norm scales and biases too) so no layout mistake hides."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))


def count_flops(model: Any, inputs: tuple, backward: bool) -> tuple[int, dict[str, int]]:
    """FLOPs of ``model(*inputs)`` (and of ``.sum().backward()``), total and per module, named by
    path below ``model`` (``down.0``, ...). CPU attention counted too (`torch_impl.flops`)."""
    from torch.utils.flop_counter import FlopCounterMode

    from torch_impl.flops import register_cpu_attention_flops

    register_cpu_attention_flops()
    with FlopCounterMode(display=False) as counter:
        out = model(*inputs)
        if backward:
            out.sum().backward()
    root = type(model).__name__ + "."
    per_module = {k.removeprefix(root): sum(v.values()) for k, v in counter.get_flop_counts().items()}
    return counter.get_total_flops(), per_module
