"""Apply a framework-free `CheckpointPlan` to the Flax U-Net, as a class transform.

Where torch shadows a built module's ``forward``, Flax picks the class before construction: a
recomputed unit is an ``nn.remat(Cls)``, named by its ``setup()`` attribute, so the parameter tree is
the same for every plan. The U-Net assembly calls `remat_class`, a block `build`; save sets become
``checkpoint_name`` tags and `remat_policy`. Mirror: `torch_impl/checkpointing.py`.
Docs: docs/spec_and_plans.md, docs/remat_vs_checkpoint.md.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import jax
from flax import linen as nn

from shared_configs.plan import CheckpointPlan

M = TypeVar("M", bound=type[nn.Module])

# Call arguments that select Python control flow rather than carry arrays. They must be passed
# positionally: jax.checkpoint traces keyword arguments, and `not tracer` fails.
STATIC_ARGS: tuple[str, ...] = ("train",)
OFFLOAD_ON_CPU = (
    "offload: on CPU the pinned host is the device's own memory; saving the named outputs in place "
    "instead (the plan runs as save without offload)"
)


def remat_policy(save: tuple[str, ...] = (), offload: bool = False) -> Callable[..., Any] | None:
    """The ``jax.checkpoint`` policy for a plan's ``save``/``offload``; None saves nothing inside.

    Callers pass ``offload`` through `_offload_here` first (CPU degrades, with a warning).
    """
    if not save:
        return None
    if not offload:
        return jax.checkpoint_policies.save_only_these_names(*save)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(),
        names_which_can_be_offloaded=save,
        offload_src="device",
        offload_dst="pinned_host",
    )


def _offload_here(offload: bool) -> bool:
    """Offload on a CPU backend warns and degrades to plain saving: XLA:CPU would copy the saved
    tensors to "pinned_host", i.e. into the same RAM, for nothing."""
    if offload and jax.default_backend() == "cpu":
        warnings.warn(OFFLOAD_ON_CPU, UserWarning, stacklevel=3)
        return False
    return offload


@functools.cache
def remat(cls: M, save: tuple[str, ...] = (), offload: bool = False) -> M:
    """``nn.remat(cls)``: recompute the module's forward in the backward pass.

    ``static_argnums`` is read off ``cls.__call__``'s signature (``self`` counts as 0), so a layer
    without a ``train`` flag needs none. With ``save=()`` (policy None) nothing inside is saved:
    every intermediate is recomputed from the block's inputs; otherwise the outputs tagged with
    those names are kept (`remat_policy`). Cached per (class, save, offload).
    """
    params = list(inspect.signature(cls.__call__).parameters)
    static = tuple(i for i, p in enumerate(params) if p in STATIC_ARGS)
    return nn.remat(cls, static_argnums=static, prevent_cse=True, policy=remat_policy(save, offload))


def remat_class(cls: M, name: str, plan: CheckpointPlan | None) -> M:
    """The class to instantiate for unit ``name`` (``down.1``, ``mid.resnets.0``, ...) under ``plan``:
    ``cls`` itself, or its `remat` with the unit's own save set when the plan recomputes it."""
    if plan is None or name not in plan:
        return cls
    return remat(cls, plan.save_for(name), _offload_here(plan.offload))


def build(factory: Callable[..., nn.Module], name: str, plan: CheckpointPlan | None, *args: Any) -> nn.Module:
    """``factory(*args)``, its module class remat'd when ``plan`` recomputes unit ``name``
    (``down.1.resnets.0``). ``factory`` is a Module class or a `functools.partial` of one (what the
    assembly hands blocks)."""
    if isinstance(factory, functools.partial):
        return functools.partial(remat_class(factory.func, name, plan), *factory.args, **factory.keywords)(*args)
    return remat_class(factory, name, plan)(*args)
