"""Apply a framework-free `CheckpointPlan` to the Flax U-Net, as a class transform.

Where torch shadows a built module's ``forward``, Flax picks the class before construction: a recomputed
unit is an ``nn.remat(Cls)`` under the same ``setup()`` name, so the parameter tree is the same for every
plan. Mirror: `torch_impl/checkpointing.py`. Docs: docs/spec_and_plans.md, docs/remat_vs_checkpoint.md.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import jax
from flax import linen as nn

from shared_configs.vocabulary import CheckpointPlan

M = TypeVar("M", bound=type[nn.Module])

# Call arguments that select Python control flow, passed positionally: jax.checkpoint traces keyword arguments.
STATIC_ARGS: tuple[str, ...] = ("train",)
OFFLOAD_ON_CPU = (
    "offload: on CPU the pinned host is the device's own memory; saving the named outputs in place "
    "instead (the plan runs as save without offload)"
)


def remat_policy(save: tuple[str, ...] = (), offload: bool = False) -> Callable[..., Any] | None:
    """The ``jax.checkpoint`` policy for a plan's ``save``/``offload`` (through `_offload_here`); None saves nothing."""
    if not save:
        return None
    if not offload:
        return jax.checkpoint_policies.save_only_these_names(*save)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=save, offload_src="device", offload_dst="pinned_host"
    )


def _offload_here(offload: bool) -> bool:
    """Offload on CPU warns and saves in place: XLA:CPU would copy to "pinned_host", the same RAM, for nothing."""
    if offload and jax.default_backend() == "cpu":
        warnings.warn(OFFLOAD_ON_CPU, UserWarning, stacklevel=3)
        return False
    return offload


@functools.cache
def remat(cls: M, save: tuple[str, ...] = (), offload: bool = False) -> M:
    """``nn.remat(cls)``, keeping the outputs tagged ``save``; ``static_argnums`` read off ``cls.__call__``."""
    params = list(inspect.signature(cls.__call__).parameters)
    static = tuple(i for i, p in enumerate(params) if p in STATIC_ARGS)
    return nn.remat(cls, static_argnums=static, prevent_cse=True, policy=remat_policy(save, offload))


def remat_class(cls: M, name: str, plan: CheckpointPlan | None) -> M:
    """``cls``, or its `remat` with the unit's own save set when ``plan`` recomputes unit ``name``."""
    if plan is None or name not in plan:
        return cls
    return remat(cls, plan.save_for(name), _offload_here(plan.offload))


def build(factory: functools.partial, name: str, plan: CheckpointPlan | None, *args: Any) -> nn.Module:
    """``factory(*args)`` (a `functools.partial` of a Module class), remat'd as ``plan`` says for ``name``."""
    return functools.partial(remat_class(factory.func, name, plan), *factory.args, **factory.keywords)(*args)


@jax.custom_vjp
def own_cotangent(x: jax.Array) -> jax.Array:
    """``x``, its cotangent made a value of its own where it is computed (an optimization barrier). For the skips
    of the up path: XLA otherwise fuses the slice of each concatenation's cotangent into the skip's consumer, at
    the end of the backward, keeping the whole concatenation's cotangents (and their inputs) alive until then."""
    return x


def _own_fwd(x: jax.Array) -> tuple[jax.Array, None]:
    return x, None


def _own_bwd(_: None, g: jax.Array) -> tuple[jax.Array]:
    return (jax.lax.optimization_barrier(g),)


own_cotangent.defvjp(_own_fwd, _own_bwd)
