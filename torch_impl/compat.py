"""Every reach of torch_impl into a private API (torch's, accelerate's), in one place.

`REACHES` names each one and says why it is reached; `CHECKED`, the versions they were checked against.
A patch is undone in ``finally``. `reach` resolves a name or fails naming it (`shared_configs.compat`), so a
library that moves one breaks loudly here (tests/test_compat.py reaches every one), not in a measurement.
Mirror: `jax_impl/compat.py`. docs/layout.md.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

# Already imported by ``import torch``: tools documented for users that live in private modules.
from torch._C._profiler import _EventType  # noqa: F401 (the profiler's event kinds: allocator_peak's allocations)
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: F401 (steps from shapes alone)
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass  # noqa: F401
from torch.utils._pytree import tree_leaves, tree_map_only  # noqa: F401 (torch's pytree)

from shared_configs import compat as shared

CHECKED = "torch 2.13.0, accelerate 1.16.0"
_MOD_TRACKER, _MEM_TRACKER = "torch.distributed._tools.mod_tracker", "torch.distributed._tools.mem_tracker"
REACHES = {  # "module:attribute" -> why
    "torch._C._profiler:_EventType": "allocator_peak reads the profiler's allocation events",
    "torch._subclasses.fake_tensor:FakeTensorMode": "the planner's steps from shapes alone (nothing allocated)",
    "torch.utils._python_dispatch:TorchDispatchMode": "StepTracker and the shapes-only step see every op",
    "torch.utils._python_dispatch:is_traceable_wrapper_subclass": "torchao's 8-bit state: its inner tensors",
    "torch.utils._python_dispatch:_get_current_dispatch_mode": "the guard's EMA watch leaves only where innermost",
    "torch._subclasses.fake_tensor:FakeTensor": "(as above) a tensor already fake is kept",
    "torch.utils._pytree:tree_leaves": "the tensors in an op's outputs and in a step's arguments",
    "torch.utils._pytree:tree_map_only": "a checkpointed call's arguments as meta tensors",
    "torch:UntypedStorage.resize_": "replaced while StepTracker runs: FSDP2 gathers and frees by resizing storages",
    f"{_MOD_TRACKER}:ModTracker": "the phase (forward, backward) and the block a tracked op runs in",
    f"{_MOD_TRACKER}:register_multi_grad_hook": "ModTracker's backward hook, called in mode 'any' while tracking",
    f"{_MEM_TRACKER}:MemTracker": "PyTorch's own count of a step's memory, the check on StepTracker",
    "torch._functorch.config:activation_memory_budget": "torch.compile's own planner, a row of the benchmark",
    "torch:Tensor._base": "a view's base: a view of a parameter FSDP2 gathered is not a residual",
    "torch:_foreach_lerp_": "the EMA update of every shadow tensor in one call, as torch's optimizers update",
    "torch:ops.aten._local_scalar_dense": "a value read from a fake tensor (.item()) answered without data",
    "torch:ops.aten._scaled_dot_product_flash_attention_for_cpu_backward": "the CPU attention's backward FLOPs",
    "accelerate.state:GradientState._set_sync_gradients": "a retry puts back accelerate's accumulation state",
}
SDPA_KERNELS = (  # F.scaled_dot_product_attention's kernels, CPU first
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
REACHES |= {f"torch:ops.aten.{k}": "the attention kernels: a save set's op class 'attention'" for k in SDPA_KERNELS}
INSTANCE_REACHES = {  # reached on objects, not their classes: tests/test_compat.py builds one of each
    "OptimizedModule._orig_mod": "the model torch.compile wraps (`torch_impl.wrappers.unwrap`)",
    "MemTracker._param_to_grad_hook_handles": "frozen weights marked hooked, so MemTracker can watch them",
    "nn.Module._parameters, nn.Module._buffers": "fake tensors swapped in by key (Module.to cannot)",
}


def reach(name: str) -> Any:
    """``"module:attribute.path"`` resolved, or `shared_configs.compat.MovedError` naming it."""
    return shared.reach(name, CHECKED)


@contextlib.contextmanager
def resizes_to(on_resize: Callable[[Callable[[Any, int], None], Any, int], None]) -> Iterator[None]:
    """``torch.UntypedStorage.resize_(st, size)`` runs ``on_resize(resize, st, size)`` in the block, ``resize``
    the real one: FSDP2 gathers a parameter by growing its storage and frees it by shrinking it, unseen by
    a dispatch mode."""
    real = reach("torch:UntypedStorage.resize_")

    def resize_(st: Any, size: int) -> None:  # a function: bound to the storage
        on_resize(real, st, size)

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = real  # type: ignore[method-assign]


@contextlib.contextmanager
def multi_grad_hooks_any() -> Iterator[None]:
    """ModTracker's (ours, MemTracker's) hook for leaving a module in the backward, in mode "any": in its
    default, "all", it holds the gradients of the module's inputs until the last is ready (a ResNet's
    input gradient until the time embedding's, at the backward's end), bytes the watched step never holds."""
    module = importlib.import_module(_MOD_TRACKER)
    hook = reach(f"{_MOD_TRACKER}:register_multi_grad_hook")
    module.register_multi_grad_hook = functools.partial(hook, mode="any")
    try:
        yield
    finally:
        module.register_multi_grad_hook = hook


def mod_tracker() -> Any:
    return reach(f"{_MOD_TRACKER}:ModTracker")()


def mem_tracker(frozen: Iterable[nn.Parameter]) -> Any:
    """PyTorch's ``MemTracker``, able to watch ``frozen`` weights (LoRA's base, an encoder): it hooks the gradient
    of every parameter a forward reads, which one without ``requires_grad`` refuses; marked hooked already in its
    private table, they are skipped."""
    tracker = reach(f"{_MEM_TRACKER}:MemTracker")()
    hook = SimpleNamespace(remove=lambda: None)
    for param in frozen:
        tracker._param_to_grad_hook_handles.setdefault(param, (hook, hook))
    return tracker


def compiled_inner(model: nn.Module) -> nn.Module:
    """The module ``torch.compile``'s ``OptimizedModule`` runs."""
    return model._orig_mod


def tensor_tables(module: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """``module``'s own parameters and buffers by name, as tables a fake tensor can be put into by key."""
    return module._parameters, module._buffers


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    return t._base


def foreach_lerp_(tensors: list[torch.Tensor], ends: list[torch.Tensor], weight: float) -> None:
    torch._foreach_lerp_(tensors, ends, weight)


def innermost_mode() -> Any:
    """The dispatch mode entered last, or None."""
    return reach("torch.utils._python_dispatch:_get_current_dispatch_mode")()


def aten(name: str) -> Any:
    """``torch.ops.aten.<name>`` (a private kernel's op)."""
    return reach(f"torch:ops.aten.{name}")


@contextlib.contextmanager
def activation_memory_budget(ratio: float) -> Iterator[None]:
    """torch.compile's own planner set to ``ratio`` in the block, each compile afresh (the budget is not among
    Dynamo's guards)."""
    torch.compiler.reset()
    with reach("torch._functorch.config:patch")(activation_memory_budget=ratio):
        yield
    torch.compiler.reset()


def set_sync_gradients(accelerator: Any, sync: bool) -> None:
    """accelerate's ``sync_gradients``, which each ``accelerator.accumulate`` entry sets, put back (its setter is
    private)."""
    accelerator.gradient_state._set_sync_gradients(sync)
