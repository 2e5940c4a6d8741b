"""Apply a framework-free `CheckpointPlan` to a PyTorch module tree, from the outside.

A recomputed block keeps its place (and its `state_dict` keys): only its instance ``forward``
is shadowed by one that runs the class's forward under `torch.utils.checkpoint.checkpoint`
(non-reentrant, RNG state stashed and replayed so dropout masks match on recompute).
"""

from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from shared_configs.plan import CheckpointPlan
from torch_impl.batchnorm import with_frozen_running_stats


def apply_plan(root: nn.Module, plan: CheckpointPlan, preserve_rng_state: bool = True) -> None:
    """Checkpoint every module named in ``plan`` (names are `get_submodule` paths)."""
    remove_plan(root)
    for name in plan.recompute:
        module = root.get_submodule(name)
        plain = type(module).forward.__get__(module)
        # use_reentrant=False: the reentrant variant gives parameters no gradient when no
        # *input* requires grad, and cannot handle keyword arguments or nested outputs.
        module.forward = functools.partial(
            checkpoint,
            plain,
            use_reentrant=False,
            preserve_rng_state=preserve_rng_state,
            # BatchNorm: the recompute must not update running statistics twice (torch_impl.batchnorm).
            context_fn=with_frozen_running_stats(module),
        )


def remove_plan(root: nn.Module) -> None:
    """Undo `apply_plan`: every module gets its class's forward back."""
    for module in root.modules():
        module.__dict__.pop("forward", None)


def checkpointed_names(root: nn.Module) -> list[str]:
    """Names of the modules that currently run under checkpoint."""
    return [name for name, m in root.named_modules() if "forward" in m.__dict__]
