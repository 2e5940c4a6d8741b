"""The torch half of `benchmarks.saved`: what autograd keeps for backward, block by block.

Three sources, distinct storages counted once, parameters and model inputs left out: ``saved``
(``saved_tensors_hooks`` outside recomputed blocks, with the last aten op dispatched), ``input``
(what checkpoint keeps of each recomputed block's inputs) and ``policy`` (outputs a selective
policy keeps, from `record_saved`). Each is attributed to the block whose forward produced it.
"""

from __future__ import annotations

from typing import Any

import torch

from shared_configs import UNetSpec, block_names
from shared_configs.memory import OUTSIDE, block_of
from torch_impl import UNet
from torch_impl.compat import TorchDispatchMode, tree_leaves
from torch_impl.memory import record_saved

Row = tuple[str, str, str, tuple[int, ...], str, int]


class _Producers(TorchDispatchMode):
    """Notes, per output storage, the block running when it was made, and the last op name."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = [OUTSIDE]
        self.block: dict[int, str] = {}
        self.last_op = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.last_op = str(func).removeprefix("aten.").removesuffix(".default")
        for t in out if isinstance(out, tuple | list) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.block[_ptr(t)] = self.stack[-1]  # storages are reused: latest producer wins
        return out


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _hook_blocks(model: UNet, prod: _Producers, inputs: dict[int, Row]) -> list[Any]:
    """Block pre/post hooks keep ``prod.stack``; recomputed modules' tensor inputs go to ``inputs``."""
    handles = []
    for name in block_names(model.spec):
        module = model.get_submodule(name)
        # Hooks must return None: a forward hook's return value replaces the module's output.
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: prod.stack.append(n) and None))
        handles.append(module.register_forward_hook(lambda m, a, o: prod.stack.pop() and None))
    for name in model.plan.recompute:

        def keep(m: Any, args: tuple, n: str = name) -> None:
            for t in (t for t in tree_leaves(args) if isinstance(t, torch.Tensor)):
                inputs[_ptr(t)] = _row(prod.block.get(_ptr(t), OUTSIDE), f"input of {n}", "input", t)

        handles.append(model.get_submodule(name).register_forward_pre_hook(keep))
    return handles


def _row(block: str, op: str, kind: str, t: torch.Tensor, nbytes: int | None = None) -> Row:
    """A kept tensor's row: its storage's bytes unless ``nbytes``."""
    dtype = str(t.dtype).removeprefix("torch.")
    return block, op, kind, tuple(t.shape), dtype, t.untyped_storage().nbytes() if nbytes is None else nbytes


def collect(spec: UNetSpec, policy: str, batch_size: int, context_length: int) -> list[Row]:
    """One forward and backward (dropout off, as the JAX side); every tensor kept for backward."""
    torch.manual_seed(0)  # the same weights every run
    model = UNet(spec).eval()
    model.enable_gradient_checkpointing(policy)
    gen, s, dim = torch.Generator().manual_seed(0), spec.sample_size, spec.cross_attention_dim
    x = torch.randn(batch_size, spec.in_channels, s, s, generator=gen)
    ctx = torch.randn(batch_size, context_length, dim, generator=gen) if dim else None
    t = torch.linspace(1.0, 900.0, batch_size)
    skip = {_ptr(p) for p in model.parameters()} | {_ptr(v) for v in (x, t, ctx) if v is not None}
    prod, saved, inputs = _Producers(), {}, {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        ptr = _ptr(tensor)
        if ptr not in skip and ptr not in saved:
            saved[ptr] = _row(prod.block.get(ptr, prod.stack[-1]), prod.last_op, "saved", tensor)
        return tensor

    handles = _hook_blocks(model, prod, inputs)
    try:
        with record_saved() as records, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), prod:
            out = model(x, t, ctx)
        out.square().mean().backward()
    finally:
        for h in handles:
            h.remove()
    extra = [row for ptr, row in inputs.items() if ptr not in saved and ptr not in skip]
    return [
        *saved.values(),
        *extra,
        *(
            _row(block_of(r.block), r.op_class, "policy", o, o.numel() * o.element_size())
            for r in records
            if not r.recompute
            for o in r.outputs
        ),
    ]
