"""Norms of the Flax U-Net: GroupNorm / LayerNorm with their outputs tagged ``"norm"`` for remat
policies (see `jax_impl.layers`), the spec's ResNet norm kinds, and `norm_act`, a norm recomputed in
the backward pass; `jax_impl.layers` builds its layers from them."""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

Array = jax.Array


def tagged(cls: type[nn.Module], tag: str) -> type[nn.Module]:
    """``cls`` with its output tagged ``tag`` (`checkpoint_name`), the name a remat policy saves it by."""

    class Tagged(cls):
        def __call__(self, x: Array, *args: object, **kwargs: object) -> Array:
            return checkpoint_name(super().__call__(x, *args, **kwargs), tag)

    Tagged.__name__ = Tagged.__qualname__ = cls.__name__
    return Tagged


GroupNorm, LayerNorm = tagged(nn.GroupNorm, "norm"), tagged(nn.LayerNorm, "norm")


def group_norm(groups: int, eps: float) -> nn.GroupNorm:
    # use_fast_variance=False: E[(x - mean)^2] as torch, not E[x^2] - mean^2 (cancels badly).
    return GroupNorm(num_groups=groups, epsilon=eps, use_fast_variance=False)


def batch_norm(eps: float, momentum: float) -> nn.BatchNorm:
    # ``momentum`` is torch's (the new batch's weight), Flax's the old average's; train mode is chosen per call.
    return nn.BatchNorm(momentum=1.0 - momentum, epsilon=eps, use_fast_variance=False)


# Norm kinds of the spec -> constructor (groups, eps, momentum); the same keys as in torch.
NORM: dict[str, Callable[[int, float, float], nn.Module]] = {
    "group": lambda groups, eps, momentum: group_norm(groups, eps),
    "batch": lambda groups, eps, momentum: batch_norm(eps, momentum),
}


def norm_layer(ch: int, norm: str, groups: int, eps: float, momentum: float) -> nn.Module:
    """The ResNet / output norm of kind ``norm``."""
    del ch  # Flax infers it from the input; kept to mirror torch's signature
    return NORM[norm](groups, eps, momentum)


def norm_act(
    norm: nn.Module, x: Array, train: bool = False, silu: bool = False, film: tuple[Array, Array] | None = None
) -> Array:
    """``norm(x)``, then ``* (1 + scale) + shift`` with ``film=(scale, shift)``, then SiLU if ``silu``,
    recomputed from ``x`` in the backward pass: autodiff would keep x - mean and the SiLU's input and
    sigmoid, where torch's autograd keeps the norm's input and output. The parameter tree is unchanged,
    and a plan's ``save=norm`` still keeps the tagged output. Figures: docs/remat_vs_checkpoint.md."""

    def f(module: nn.Module, y: Array, film: tuple[Array, Array] | None) -> Array:
        # a BatchNorm uses (and updates) batch statistics in train mode, else its running ones
        y = module(y, use_running_average=not train) if isinstance(module, nn.BatchNorm) else module(y)
        if film is not None:
            y = y * (1 + film[0]) + film[1]
        return nn.silu(y) if silu else y

    return nn.checkpoint(f, prevent_cse=True)(norm, x, film)


def layer_norm(eps: float) -> nn.LayerNorm:
    return LayerNorm(epsilon=eps, use_fast_variance=False)
