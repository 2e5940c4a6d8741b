"""A training regime (`shared_configs.regime.Regime`) in JAX/Flax + optax: `torch_impl.regime`'s twin.

Precision: ``bf16`` casts the params (`apply_regime`), the ``*-mixed`` ones cast params and inputs for the
forward (`step_options`), ``fp16-mixed`` with a static loss scale. ``lora:R``: the U-Net's own adapters
(``UNet(lora_rank=R)``), the only weights the optimizer (`make_optimizer`) updates. ``--ema``: a float32
copy of the trained params (`init_ema`, `update_ema`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.typing import DTypeLike

from jax_impl.lora import LORA_LEAVES
from shared_configs.defaults import device_of
from shared_configs.regime import DEFAULT, Regime, check_planned
from shared_configs.spec import SpecError

# The regime's dtype names; None computes in the params' own dtype (no casts at all).
DTYPES: dict[str | None, DTypeLike | None] = {
    None: None,
    "float32": None,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}
# fp16-mixed's static loss scale (a step whose gradients still overflow is skipped: `optax.apply_if_finite`).
LOSS_SCALE = 2.0**12
EMA_DECAY = 0.9999


def check_regime(regime: Regime) -> None:
    """Refuse, in one line, a regime the Flax loop cannot train on this machine."""
    check_planned(regime, "jax", device_of(jax.devices()[0].platform))


def step_options(regime: Regime) -> dict[str, Any]:
    """`jax_impl.step.train_step`'s static regime arguments: the forward's compute dtype and the loss scale."""
    return {"compute_dtype": DTYPES[regime.compute_dtype], "loss_scale": LOSS_SCALE if regime.loss_scaling else None}


def cast_floating(tree: Any, dtype: DTypeLike) -> Any:
    """Every floating leaf of ``tree`` cast to ``dtype``; integer leaves and None stay as they are."""
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def apply_regime(params: Any, regime: Regime) -> Any:
    """``params`` in ``regime``'s weight dtype (pure bf16 casts them; the others keep float32)."""
    return params if regime.param_dtype == "float32" else cast_floating(params, DTYPES[regime.param_dtype])


@functools.cache  # one object per hyperparameters, so the jitted step (tx is static) compiles once
def make_optimizer(lr: float, weight_decay: float, regime: Regime = DEFAULT) -> optax.GradientTransformation:
    """``regime.optimizer`` in optax; under loss scaling a step with non-finite gradients is skipped."""
    if regime.optimizer == "adamw8bit":
        raise SpecError(
            "optimizer: adamw8bit has no JAX implementation (optax has no 8-bit AdamW); use adamw or "
            "adafactor, or plan its state bytes from shapes (the plan command's --shapes)"
        )
    tx = (
        optax.adafactor(lr, weight_decay_rate=weight_decay or None)
        if regime.optimizer == "adafactor"
        else optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=weight_decay)  # optax's default decay: 1e-4
    )
    if regime.lora_rank is not None:  # the adapters train; the rest gets no update and no state

        def labels(params: Any) -> Any:
            return jax.tree.map(lambda t: "trained" if t else "frozen", trained_mask(params, regime))

        tx = optax.multi_transform({"trained": tx, "frozen": optax.set_to_zero()}, labels)
    return optax.apply_if_finite(tx, max_consecutive_errors=10) if regime.loss_scaling else tx


def trained_mask(params: Any, regime: Regime = DEFAULT) -> Any:
    """True for each parameter ``regime`` trains: all, or under LoRA the adapters' (`LoRADense`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: regime.lora_rank is None or any(getattr(k, "key", None) in LORA_LEAVES for k in path), params
    )


def trained_leaves(params: Any, regime: Regime = DEFAULT) -> list[Any]:
    """The parameters ``regime`` trains (`trained_mask`), as a list of leaves (torch: `trained_parameters`)."""
    return [x for x, t in zip(jax.tree.leaves(params), jax.tree.leaves(trained_mask(params, regime)), strict=True) if t]


def init_ema(params: Any, regime: Regime) -> Any:
    """``regime``'s float32 EMA copy of ``params`` (a copy: float32 params would share buffers, donated twice),
    or None; under LoRA a frozen weight holds an empty array."""
    if not regime.ema:
        return None
    return jax.tree.map(
        lambda p, trained: jnp.array(p if trained else p[:0], jnp.float32, copy=True),
        params,
        trained_mask(params, regime),
    )


def update_ema(ema: Any, params: Any) -> Any:
    """``ema`` moved toward ``params`` (`EMA_DECAY`); None stays None, an empty leaf (a frozen weight) as it is."""
    if ema is None:
        return None
    return jax.tree.map(
        lambda e, p: e if e.size == 0 else e + (1.0 - EMA_DECAY) * (p.astype(jnp.float32) - e), ema, params
    )
