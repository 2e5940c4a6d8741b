"""The JAX training step and what a loop builds around it: `TrainState`, `train_step`, `make_step`.

To put the U-Net in your own loop::

    model, tx = UNet(spec=spec, policy="full"), make_optimizer(lr=1e-3, weight_decay=0.0)
    state = init_state(model, tx, seed=0)             # params, opt_state, batch_stats (, ema)
    state, loss = train_step(state, arrays(batch), key, model=model, tx=tx)

`Trainee` is what `jax_impl.train`'s loop steps. Mirror: `torch_impl/train.py`; docs/training.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.typing import DTypeLike

from jax_impl import processes
from jax_impl.guard import StepPlan, plan_for_step, xla_compile
from jax_impl.memory import compiled_peak
from jax_impl.parallel import shard
from jax_impl.regime import apply_regime, cast_floating, init_ema, step_options, update_ema
from jax_impl.unet import UNet, abstract_inputs
from shared_configs.pair import ControlNetPairSpec
from shared_configs.regime import DEFAULT, Regime
from shared_configs.sizes import MIB
from shared_configs.spec import UNetSpec
from shared_configs.training.config import TrainConfig
from shared_configs.training.data import CONDITIONING, Batch, Dataset, check_conditioning, step_seed
from shared_configs.training.ddpm import Schedule
from shared_configs.training.run_plan import RunPlan, report, resolve_any, workload_of

# (noisy, t, noise, context, class_labels, text_embeds, time_ids[, controlnet_cond]): the forward's
# inputs in its order (`shared_configs.training.data.CONDITIONING`), None where the spec takes none.
Arrays = tuple[jax.Array | None, ...]
Step = Callable[["TrainState", int], tuple["TrainState", float]]


@flax.struct.dataclass
class TrainState:
    """Everything a step updates, as one pytree: the step's signature is the same for every norm."""

    params: Any
    opt_state: Any
    batch_stats: Any  # BatchNorm running statistics; {} for a GroupNorm spec
    ema: Any = None  # --ema: a float32 moving average of the params (None: none kept)

    @classmethod
    def create(cls, variables: Any, tx: optax.GradientTransformation, regime: Regime = DEFAULT) -> TrainState:
        """From Flax ``variables`` in ``regime``: params cast to its weight dtype, an EMA copy when it keeps one."""
        params = apply_regime(variables["params"], regime)
        return cls(params, tx.init(params), variables.get("batch_stats", {}), init_ema(params, regime))

    def variables(self) -> dict[str, Any]:
        return flax_variables(self.params, self.batch_stats)


def flax_variables(params: Any, batch_stats: Any) -> dict[str, Any]:
    """What ``model.apply`` takes; no empty ``batch_stats`` collection for a GroupNorm spec."""
    return {"params": params} | ({"batch_stats": batch_stats} if batch_stats else {})


def arrays(batch: Batch) -> Arrays:
    """The batch's inputs (`Arrays`) as jax arrays (None kept), images NCHW -> NHWC."""
    return tuple(None if a is None else jnp.asarray(a) for a in host_arrays(batch))


def host_arrays(batch: Batch) -> tuple[np.ndarray | None, ...]:
    """`arrays` in numpy, on the host (to be placed over a mesh: `jax_impl.parallel.shard`)."""
    return nhwc(batch.noisy, batch.t, batch.noise, *batch.conditioning().values())


def nhwc(*values: Any) -> tuple[Any, ...]:
    """``values`` (numpy or JAX arrays, or None) with each image (4-D: the sample, the noise, a conditioning image)
    NCHW -> NHWC."""
    return tuple(a.transpose(0, 2, 3, 1) if a is not None and a.ndim == 4 else a for a in values)


def init_state(model: UNet, tx: optax.GradientTransformation, seed: int, regime: Regime = DEFAULT) -> TrainState:
    """Fresh parameters (from ``seed``), their optimizer state and BatchNorm statistics, in ``regime``."""
    # The smallest inputs: the parameters do not depend on their batch or sizes.
    inputs = jax.tree.map(jnp.zeros_like, abstract_inputs(model.resolved_spec))
    rngs = {"params": jax.random.key(seed), "dropout": jax.random.key(seed + 1)}
    return TrainState.create(jax.jit(model.init)(rngs, **inputs), tx, regime)


def loss_fn(
    params: Any,
    batch_stats: Any,
    model: UNet,
    batch: Arrays,
    dropout_key: jax.Array,
    compute_dtype: DTypeLike | None = None,
) -> tuple[jax.Array, Any]:
    """MSE between the predicted and the true noise (dropout on, batch statistics) in float32, and the updated
    batch_stats (under remat an output of the forward: they move once per step; never cast). ``compute_dtype``
    casts the params and floating inputs (the gradients flow back as float32); the timesteps stay float32: bf16
    would round t in [512, 1024) to multiples of 4 (the U-Net casts its sinusoids instead)."""
    noisy, t, noise, *conditioning = batch
    check_conditioning(model.resolved_spec, dict(zip(CONDITIONING, conditioning, strict=True)))  # at trace time
    context, class_labels, text_embeds, time_ids = conditioning
    if compute_dtype is not None:  # time_ids stay float32, as t does (pixel sizes up to 2048 and more)
        params, noisy, context, class_labels, text_embeds = cast_floating(
            (params, noisy, context, class_labels, text_embeds), compute_dtype
        )
    variables, rngs = flax_variables(params, batch_stats), {"dropout": dropout_key}
    pred, updates = model.apply(
        variables,
        noisy,
        t,
        context,
        class_labels,
        text_embeds,
        time_ids,
        train=True,
        rngs=rngs,
        mutable=["batch_stats"],
    )
    return jnp.mean((pred.astype(jnp.float32) - noise) ** 2), updates.get("batch_stats", batch_stats)


# The state is donated (a step holds one copy of the params and optimizer state): keep the state returned.
@functools.partial(jax.jit, static_argnames=("model", "tx", "compute_dtype", "loss_scale"), donate_argnames=("state",))
def train_step(
    state: TrainState,
    batch: Arrays,
    dropout_key: jax.Array,
    *,
    model: UNet,
    tx: optax.GradientTransformation,
    compute_dtype: DTypeLike | None = None,
    loss_scale: float | None = None,
) -> tuple[TrainState, jax.Array]:
    """One DDPM step through the remat plan the model carries: (new state, loss). The keyword arguments
    are static: keep one object of each (`jax_impl.regime.make_optimizer`) to compile once."""

    def loss(params: Any) -> tuple[jax.Array, Any]:
        return loss_fn(params, state.batch_stats, model, batch, dropout_key, compute_dtype)

    return apply_gradients(state, tx, loss_scale, loss)


def apply_gradients(
    state: TrainState, tx: optax.GradientTransformation, loss_scale: float | None, loss: Callable[[Any], tuple]
) -> tuple[TrainState, jax.Array]:
    """``state`` updated by the gradients of ``loss(params) -> (loss, batch_stats)``, scaled; the EMA moved."""
    scale = 1.0 if loss_scale is None else loss_scale

    def scaled(params: Any) -> tuple[jax.Array, tuple[jax.Array, Any]]:
        value, stats = loss(params)
        return value * scale, (value, stats)

    (_, (value, batch_stats)), grads = jax.value_and_grad(scaled, has_aux=True)(state.params)
    if loss_scale is not None:
        grads = jax.tree.map(lambda g: g / scale, grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return TrainState(params, opt_state, batch_stats, update_ema(state.ema, params)), value


@dataclass(frozen=True)
class Trainee:
    """What a loop steps: ``model`` (a `UNet` or a `ControlNetPair`), its jitted ``step(state, *frozen, batch, key,
    *, model, tx, ...)``, the arguments it reads and never trains, and what ``model.apply`` takes."""

    model: Any
    step: Any = train_step
    frozen: tuple[Any, ...] = ()
    variables: Callable[..., dict[str, Any]] = TrainState.variables

    def clone(self, policy: str) -> Trainee:
        """The same trainee, its model under ``policy``."""
        return replace(self, model=self.model.clone(policy=policy))


def make_step(
    cfg: TrainConfig,
    trainee: Trainee,
    tx: optax.GradientTransformation,
    dataset: Dataset,
    schedule: Schedule,
    mesh: Mesh | None = None,
    budget: RunPlan | None = None,
) -> Step:
    """``step(state, s) -> (state, loss)``: training step ``s`` on its batch, over ``mesh`` if given; with a
    ``budget`` compiled as the planner compiled it, its peak printed beside the prediction."""
    step_fn = functools.partial(trainee.step, model=trainee.model, tx=tx, **step_options(cfg.regime))
    compiled: list[jax.stages.Compiled] = []  # with a budget: the one executable every step runs

    def step(state: TrainState, index: int) -> tuple[TrainState, float]:
        batch = dataset.batch(index, cfg.batch_size, schedule, cfg.seed)  # the global batch, in every process
        if mesh is None:
            batch = arrays(batch)
        else:
            state, batch = shard(mesh, state, host_arrays(batch), cfg.distributed)
        key = jax.random.key(step_seed(cfg.seed, index))  # dropout masks depend on (seed, step) only
        args = (state, *trainee.frozen, batch, key)
        if budget is not None and not compiled:
            compiled.append(xla_compile(step_fn.func.lower(*args, **step_fn.keywords)))  # as the planner did
            if processes.process_rank() == 0:  # per device: every process compiled the same step
                cpu = "; XLA:CPU with cse_barrier_expander off, as planned" if jax.default_backend() == "cpu" else ""
                report(
                    budget.peak_line(
                        compiled_peak(compiled[0]), "XLA's memory_analysis() of the compiled step this loop runs" + cpu
                    )
                )
        state, loss = (compiled[0] if compiled else step_fn)(*args)
        return state, float(loss)

    return step


def guard_step(
    cfg: TrainConfig,
    spec: UNetSpec | ControlNetPairSpec,
    trainee: Trainee,
    tx: optax.GradientTransformation,
    data: tuple[TrainState, Dataset, Schedule],
    budget: RunPlan,
    first: int,
) -> StepPlan:
    """`jax_impl.plan_for_step` on the loop's own step (as shapes, the batch of step ``first``) from the run's
    plan: that plan corrected by what the compiled step holds beyond the model's. Says the plan in force."""
    options, (state, dataset, schedule) = step_options(cfg.regime), data
    batch = arrays(dataset.batch(first, cfg.batch_size, schedule, cfg.seed))
    args = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (state, *trainee.frozen, batch, jax.random.key(0))
    )

    def build(policy: str) -> Any:
        step = functools.partial(trainee.step.__wrapped__, model=trainee.clone(policy).model, tx=tx, **options)
        return jax.jit(step, donate_argnums=(0,))

    work = workload_of(cfg, spec, 1, trainee.model.attention_chunk)
    sp = plan_for_step(
        build,
        args,
        budget.budget_bytes,
        spec=work.spec,
        batch_size=work.batch_size,
        regime=cfg.regime,
        policy=budget.policy,
        context_length=work.context_length,
        attention_chunk=work.attention_chunk,
    )
    report(
        f"guard: the loop's compiled step under {sp.plan} is {sp.compiled / MIB:.1f} MiB of the "
        f"{sp.budget / MIB:.1f} MiB budget ({len(sp.history)} compile(s))"
    )
    return sp


def corrected(budget: RunPlan, spec: UNetSpec | ControlNetPairSpec, sp: StepPlan) -> RunPlan:
    """``budget`` with the guard's plan and its prediction (unchanged where the first plan fitted)."""
    if sp.plan == budget.policy:
        return budget
    return replace(budget, plan=resolve_any(spec, sp.plan), predicted_peak_bytes=sp.predicted, kept=False)
