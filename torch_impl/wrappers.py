"""The wrappers a training script's model may wear: DDP, FSDP1, accelerate's prepared module,
``torch.compile``'s ``OptimizedModule``; and FSDP2's ``fully_shard``, which shards the model in place.
`unwrap` takes the wrappers off, `compiled` says whether one compiles, `sharding` how a rank is planned.
Told by class name, so neither accelerate nor torch.distributed is imported. Docs: docs/guard.md.
"""

from __future__ import annotations

from typing import Any

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


def sharding(model: nn.Module) -> dict[str, Any]:
    """The planner's options for one rank of ``model``: FSDP2's sharded parameters (DTensors) say ``fsdp`` over
    their mesh's ranks; else none (DDP: each rank holds the whole step)."""
    mesh = getattr(next(model.parameters()), "device_mesh", None)
    return {} if mesh is None else {"distributed": "fsdp", "world_size": mesh.size()}
