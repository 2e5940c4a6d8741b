"""Apply a framework-free `CheckpointPlan` to the Flax U-Net, as a class transform.

Mirrors `torch_impl/checkpointing.py`. Where torch shadows a built module's ``forward``, Flax
chooses the *class* before construction: a recomputed block or layer is an instance of
``nn.remat(Cls)`` instead of ``Cls``. Its name comes from the ``setup()`` attribute it is assigned
to, so the parameter tree is the same for every plan.

Two places use this module, and only these: the U-Net assembly picks each block's class with
`block_class`, and a block builds its ResNets/attentions with `build`, given the (hashable) tuple
of its own layer names that the plan recomputes.

Op-level plans (``plan.save_for(name)``, per unit) become the remat ``policy``: the layers tag
their outputs with ``checkpoint_name`` (``"conv"``, ``"matmul"``, ``"attention"``, ``"norm"``, see
`layers.py`) and `remat_policy` keeps exactly the named ones:
`jax.checkpoint_policies.save_only_these_names`, or with ``offload``
`save_and_offload_only_these_names` (device -> pinned host). A layer-level plan reaches the blocks
through their ``recompute`` tuple: `layers_of` adds, after each layer that keeps ops, a marker entry
``"resnets.0/save=conv,matmul[/offload]"`` (names never contain ``/``), which `build` reads back.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Collection
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
_MARKER = "/"


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


def block_class(cls: M, name: str, plan: CheckpointPlan) -> M:
    """The class to instantiate for block ``name`` (``down.1``, ``mid``, ...) under ``plan``."""
    return remat(cls, plan.save_for(name), _offload_here(plan.offload)) if name in plan else cls


def layers_of(block: str, plan: CheckpointPlan) -> tuple[str, ...]:
    """The plan's recomputed layers inside ``block``, relative to it: ``("resnets.0", ...)``, each
    followed by its ``"resnets.0/save=..."`` marker when it keeps op outputs."""
    prefix = f"{block}."
    names: tuple[str, ...] = ()
    for name in plan.recompute:
        if name.startswith(prefix):
            names += (name.removeprefix(prefix),)
            if save := plan.save_for(name):
                names += (names[-1] + _MARKER + "save=" + ",".join(save) + ("/offload" if plan.offload else ""),)
    return names


def _ops_of(recompute: Collection[str], name: str) -> tuple[tuple[str, ...], bool]:
    """(save, offload) of layer ``name`` from its marker entry in a block's ``recompute`` tuple."""
    for entry in recompute:
        if entry.startswith(name + _MARKER):
            mods = entry.removeprefix(name + _MARKER).split("/")
            return tuple(mods[0].removeprefix("save=").split(",")), "offload" in mods[1:]
    return (), False


def build(factory: Callable[..., nn.Module], name: str, recompute: Collection[str], *args: Any) -> nn.Module:
    """``factory(*args)``, its module class remat'd when ``name`` (``resnets.0``) is in ``recompute``.

    ``factory`` is a Module class or a `functools.partial` of one (what the assembly hands blocks).
    """
    if name not in recompute:
        return factory(*args)
    save, offload = _ops_of(recompute, name)
    offload = _offload_here(offload)
    if isinstance(factory, functools.partial):
        return functools.partial(remat(factory.func, save, offload), *factory.args, **factory.keywords)(*args)
    return remat(factory, save, offload)(*args)
