"""The ControlNet training step in JAX/Flax: `torch_impl/pair.py`'s mirror.

`ControlNetPair` holds the frozen U-Net (``unet``) and the trained ControlNet (``controlnet``) under one
pair plan (`shared_configs.pair`). The step differentiates the ControlNet's parameters only; the U-Net's
are an argument it reads, run without dropout as diffusers does. `pair_trainee` is what the loop steps.
Docs: docs/training.md "Training a ControlNet", docs/planning.md "The ControlNet step".
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from jax.typing import DTypeLike

from jax_impl.controlnet import ControlNet, abstract_controlnet_inputs
from jax_impl.regime import apply_regime, cast_floating
from jax_impl.step import Trainee, TrainState, apply_gradients
from jax_impl.unet import PolicyArg, UNet
from shared_configs.pair import ControlNetPairSpec, PairPlan, split_pair_plan
from shared_configs.regime import DEFAULT, Regime
from shared_configs.spec import UNetSpec

Array = jax.Array


class ControlNetPair(nn.Module):
    """The U-Net and the ControlNet made from it, under a pair ``policy`` (`shared_configs.pair.split_pair_plan`):
    ``apply(variables, x, t, ..., controlnet_cond)`` (NHWC) returns the U-Net's prediction."""

    spec: ControlNetPairSpec
    policy: str | PairPlan | None = None
    attention_chunk: int | None = None

    @functools.cached_property
    def plan(self) -> PairPlan:
        return split_pair_plan(self.spec, self.policy)

    def setup(self) -> None:
        self.unet = UNet(spec=self.spec.unet, policy=self.plan.unet, attention_chunk=self.attention_chunk)
        self.controlnet = ControlNet(
            spec=self.spec.controlnet, policy=self.plan.controlnet, attention_chunk=self.attention_chunk
        )

    def __call__(
        self,
        x: Array,
        t: Array | float,
        context: Array | None,
        class_labels: Array | None,
        text_embeds: Array | None,
        time_ids: Array | None,
        controlnet_cond: Array,
        train: bool = False,
    ) -> Array:
        conditioning = {"class_labels": class_labels, "text_embeds": text_embeds, "time_ids": time_ids}
        down, mid = self.controlnet(x, t, context, controlnet_cond, **conditioning, train=train)
        return self.unet(
            x, t, context, **conditioning, down_block_additional_residuals=down, mid_block_additional_residual=mid
        )


def step_model(
    spec: UNetSpec | ControlNetPairSpec, policy: PolicyArg | PairPlan, chunk: int | None, lora_rank: int | None = None
) -> UNet | ControlNetPair:
    """The model a training step trains under ``policy``: the U-Net (with ``lora_rank``), or the ControlNet pair;
    ``chunk``: the attention chunk."""
    if isinstance(spec, ControlNetPairSpec):
        return ControlNetPair(spec=spec, policy=policy, attention_chunk=chunk)
    return UNet(spec=spec, policy=policy, attention_chunk=chunk, lora_rank=lora_rank)


def init_pair(
    pair: ControlNetPair, tx: optax.GradientTransformation, seed: int, regime: Regime = DEFAULT
) -> tuple[TrainState, Any]:
    """The ControlNet's `TrainState` (its encoder the U-Net's) and the U-Net's params, in ``regime``."""
    inputs = jax.tree.map(jnp.zeros_like, abstract_controlnet_inputs(pair.spec.controlnet))
    names = ("sample", "timestep", "context", "class_labels", "text_embeds", "time_ids", "controlnet_cond")
    rngs = {"params": jax.random.key(seed), "dropout": jax.random.key(seed + 1)}
    params = pair.init(rngs, *(inputs[n] for n in names))["params"]
    unet = params["unet"]
    # The trunk's names are the U-Net's; copies, not the same buffers: the state is donated, the U-Net's are not.
    controlnet = {k: jax.tree.map(jnp.copy, unet[k]) if k in unet else v for k, v in params["controlnet"].items()}
    return TrainState.create({"params": controlnet}, tx, regime), apply_regime(unet, regime)


def pair_trainee(pair: ControlNetPair, unet_params: Any) -> Trainee:
    """What the training loop steps: the pair's ControlNet (`train_step`), the U-Net's parameters frozen."""
    return Trainee(pair, train_step, (unet_params,), lambda s, unet: {"params": {"controlnet": s.params, "unet": unet}})


def loss_fn(
    params: Any, unet_params: Any, model: ControlNetPair, batch: tuple, key: Array, compute_dtype: DTypeLike = None
) -> Array:
    """The U-Net's noise-prediction MSE in float32; ``compute_dtype`` as in `jax_impl.step.loss_fn`."""
    noisy, t, noise, context, class_labels, text_embeds, time_ids, cond = batch
    variables = {"params": {"controlnet": params, "unet": unet_params}}
    if compute_dtype is not None:
        variables, noisy, context, class_labels, text_embeds, cond = cast_floating(
            (variables, noisy, context, class_labels, text_embeds, cond), compute_dtype
        )
    pred = model.apply(
        variables, noisy, t, context, class_labels, text_embeds, time_ids, cond, train=True, rngs={"dropout": key}
    )
    return jnp.mean((pred.astype(jnp.float32) - noise) ** 2)


@functools.partial(jax.jit, static_argnames=("model", "tx", "compute_dtype", "loss_scale"), donate_argnames=("state",))
def train_step(
    state: TrainState,
    unet_params: Any,
    batch: tuple,
    dropout_key: Array,
    *,
    model: ControlNetPair,
    tx: optax.GradientTransformation,
    compute_dtype: DTypeLike | None = None,
    loss_scale: float | None = None,
) -> tuple[TrainState, Array]:
    """One ControlNet step (as `jax_impl.step.train_step`): ``unet_params`` read, not differentiated."""

    def loss(params: Any) -> tuple[Array, Any]:
        return loss_fn(params, unet_params, model, batch, dropout_key, compute_dtype), state.batch_stats

    return apply_gradients(state, tx, loss_scale, loss)
