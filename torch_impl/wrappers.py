"""The wrappers a training script's model may wear: DDP, FSDP1, accelerate's prepared module,
``torch.compile``'s ``OptimizedModule``. `unwrap` takes them off, `compiled` says whether one compiles.
Told by class name, so neither accelerate nor torch.distributed is imported. Docs: docs/guard.md.
"""

from __future__ import annotations

from torch import nn

from torch_impl.compat import compiled_inner

# Wrappers whose ``.module`` is the model they run (torch's DDP, DataParallel and FSDP1).
_HOLDERS = ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel")


def unwrap(model: nn.Module) -> nn.Module:
    """``model`` without its wrappers: ``torch.compile``'s ``_orig_mod``, DDP's / FSDP1's ``module``
    (accelerate's ``prepare`` returns one of these, or the model itself with its forward wrapped)."""
    while True:
        if type(model).__name__ == "OptimizedModule":
            model = compiled_inner(model)
        elif type(model).__name__ in _HOLDERS and isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        else:
            return model


def compiled(model: nn.Module) -> bool:
    """``model`` is ``torch.compile``'s, or a wrapper (DDP, accelerate's) around one."""
    return "OptimizedModule" in (type(model).__name__, type(getattr(model, "module", None)).__name__)
