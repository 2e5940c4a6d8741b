"""Apply a framework-free `CheckpointPlan` to the Flax U-Net, as a class transform.

Mirrors `torch_impl/checkpointing.py`. Where torch shadows a built module's ``forward``, Flax
chooses the *class* before construction: a recomputed block or layer is an instance of
``nn.remat(Cls)`` instead of ``Cls``. Its name comes from the ``setup()`` attribute it is assigned
to, so the parameter tree is the same for every plan.

Two places use this module, and only these: the U-Net assembly picks each block's class with
`block_class`, and a block builds its ResNets/attentions with `build`, given the (hashable) tuple
of its own layer names that the plan recomputes.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Collection
from typing import Any, TypeVar

from flax import linen as nn

from shared_configs.plan import CheckpointPlan

M = TypeVar("M", bound=type[nn.Module])

# Call arguments that select Python control flow rather than carry arrays. They must be passed
# positionally: jax.checkpoint traces keyword arguments, and `not tracer` fails.
STATIC_ARGS: tuple[str, ...] = ("train",)


@functools.cache
def remat(cls: M) -> M:
    """``nn.remat(cls)``: recompute the module's forward in the backward pass.

    ``static_argnums`` is read off ``cls.__call__``'s signature (``self`` counts as 0), so a layer
    without a ``train`` flag needs none. ``policy=None`` saves nothing inside: every intermediate is
    recomputed from the block's inputs. Cached, so each class is transformed once.
    """
    params = list(inspect.signature(cls.__call__).parameters)
    static = tuple(i for i, p in enumerate(params) if p in STATIC_ARGS)
    return nn.remat(cls, static_argnums=static, prevent_cse=True, policy=None)


def block_class(cls: M, name: str, plan: CheckpointPlan) -> M:
    """The class to instantiate for block ``name`` (``down.1``, ``mid``, ...) under ``plan``."""
    return remat(cls) if name in plan else cls


def layers_of(block: str, plan: CheckpointPlan) -> tuple[str, ...]:
    """The plan's recomputed layers inside ``block``, relative to it: ``("resnets.0", ...)``."""
    prefix = f"{block}."
    return tuple(name.removeprefix(prefix) for name in plan.recompute if name.startswith(prefix))


def build(factory: Callable[..., nn.Module], name: str, recompute: Collection[str], *args: Any) -> nn.Module:
    """``factory(*args)``, its module class remat'd when ``name`` (``resnets.0``) is in ``recompute``.

    ``factory`` is a Module class or a `functools.partial` of one (what the assembly hands blocks).
    """
    if name not in recompute:
        return factory(*args)
    if isinstance(factory, functools.partial):
        return functools.partial(remat(factory.func), *factory.args, **factory.keywords)(*args)
    return remat(factory)(*args)
