"""``python -m jax_impl.train --controlnet``: the ControlNet step's loop, `torch_impl.train`'s twin.

The U-Net is made from the run's seed and frozen (`jax_impl.pair.init_pair`: the ControlNet's
trunk copies its parameters, as diffusers' ``from_unet``); the ControlNet trains in the
`jax_impl.train.TrainState` (donated each step), the U-Net's parameters a separate argument the
step reads and never differentiates (`jax_impl.pair.train_step`). Each batch carries each sample's
edge map as the conditioning image (`shared_configs.pair.ControlNetDataset`). Checkpoints hold the
state (the ControlNet, its optimizer state, its EMA); a resumed run makes the U-Net again from the
seed. One process: the run folder, resume checks, NaN guard and signals are the shared loop's
(`shared_configs.training.loop`); ``--budget-mib`` plans the pair's step and judges its compiled
peak with `jax_impl.plan_for_step`, as the U-Net's loop does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_impl import train as jt
from jax_impl.checkpoint_io import FRAMEWORK, LAYOUT, abstract_target, load_checkpoint, save_checkpoint
from jax_impl.guard import StepPlan, compiled_peak
from jax_impl.pair import ControlNetPair, init_pair, pair_arrays, train_step
from jax_impl.regime import make_optimizer, step_options
from jax_impl.train_options import CLI, on_device, run_settings
from shared_configs.defaults import device_of
from shared_configs.pair import ControlNetDataset, check_pair_workload, controlnet_pair, load_pair_dataset
from shared_configs.spec import UNetSpec
from shared_configs.training.config import TrainConfig
from shared_configs.training.data import step_seed
from shared_configs.training.ddpm import Schedule, make_schedule, sample
from shared_configs.training.loop import RunStart, manifest_for, open_run, run_loop
from shared_configs.training.outputs import write_outputs
from shared_configs.training.run_plan import RunPlan, report, resolve_run

Step = Callable[[jt.TrainState, int], tuple[jt.TrainState, float]]


def train_pair(cfg: TrainConfig, spec: UNetSpec) -> list[float]:
    """Run (or resume) a ``--controlnet`` run of ``spec``'s U-Net; returns every step's loss from step 0."""
    pair_spec = controlnet_pair(spec)
    check_pair_workload(pair_spec, False, cfg.regime)  # a BatchNorm U-Net: one line, before anything is built
    device = device_of(jax.devices()[0].platform)
    cfg, own = on_device(cfg, device)
    chunk = own.attention_chunk
    with open_run(cfg, spec, FRAMEWORK, LAYOUT) as run:
        cfg, plan, budget = resolve_run(cfg, pair_spec, CLI.name, 1, run, attention_chunk=chunk)
        model = ControlNetPair(spec=pair_spec, policy=plan.policy, attention_chunk=chunk)
        tx = make_optimizer(cfg.lr, cfg.weight_decay, cfg.regime)
        state, unet_params = start_pair(model, tx, cfg, run)
        dataset, schedule = load_pair_dataset(cfg.data, pair_spec, cfg.seed), make_schedule(cfg.schedule, cfg.timesteps)
        guarded = None
        if budget is not None:  # the plan judged by this loop's own compiled step
            guarded = guard_pair_step(cfg, model, tx, (state, unet_params, dataset, schedule), budget, len(run.losses))
            cfg, budget = replace(cfg, policy=guarded.plan), jt.corrected(budget, pair_spec, guarded)
            model = model.clone(policy=guarded.plan)

        def save_fn(state: jt.TrainState, losses: list[float]) -> None:
            manifest = manifest_for(cfg, spec, FRAMEWORK, LAYOUT, losses)  # cfg.policy: the plan in force
            if guarded is not None:  # every compile judged, this run's after those of the run it resumes
                earlier = run.manifest.run.get("guard", []) if run.manifest is not None else []
                manifest.run["guard"] = [*earlier, *(asdict(r) for r in guarded.history)]
            save_checkpoint(run.out, state, manifest)

        losses = run.losses
        step = make_pair_step(cfg, model, tx, unet_params, dataset, schedule, budget)
        title = f"jax {pair_spec.name} {plan.policy}"
        state = run_loop(cfg, state, losses, step, save_fn, title, settings=run_settings(cfg, device))
        samples = generate_pair(model, state, unet_params, schedule, dataset, cfg) if cfg.sample_steps > 0 else None
        write_outputs(cfg.out, losses, samples, f"jax_impl {pair_spec.name}, policy {plan.policy}")
    return losses


def start_pair(
    model: ControlNetPair, tx: optax.GradientTransformation, cfg: TrainConfig, run: RunStart
) -> tuple[jt.TrainState, Any]:
    """The ControlNet's first state (restored from the run's checkpoint, checked first, or made from
    the seed) and the frozen U-Net's parameters (always from the seed)."""
    state, unet_params = init_pair(model, tx, cfg.seed, cfg.regime)
    if run.checkpoint is not None:
        shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
        state = load_checkpoint(run.checkpoint, abstract_target(shapes, jax.tree.map(lambda a: a.sharding, state)))[0]
    return state, unet_params


def make_pair_step(
    cfg: TrainConfig,
    model: ControlNetPair,
    tx: optax.GradientTransformation,
    unet_params: Any,
    dataset: ControlNetDataset,
    schedule: Schedule,
    budget: RunPlan | None = None,
) -> Step:
    """``step(state, s) -> (state, loss)``: the pair's step ``s`` on its batch (a function of (seed,
    s)), dropout keyed by (seed, s). With a ``budget`` it is compiled ahead of the first step as the
    planner compiles it (`jax_impl.train.compile_step`) and its compiled peak printed beside the prediction."""
    step_fn = functools.partial(train_step, model=model, tx=tx, **step_options(cfg.regime))
    compiled: list[Any] = []

    def step(state: jt.TrainState, index: int) -> tuple[jt.TrainState, float]:
        batch = pair_arrays(dataset.batch(index, cfg.batch_size, schedule, cfg.seed))
        key = jax.random.key(step_seed(cfg.seed, index))
        if budget is None:
            state, loss = step_fn(state, unet_params, batch, key)
            return state, float(loss)
        if not compiled:
            compiled.append(jt.compile_step(step_fn, state, unet_params, batch, key))
            report(budget.peak_line(compiled_peak(compiled[0]), jt.peak_instrument()))
        state, loss = compiled[0](state, unet_params, batch, key)
        return state, float(loss)

    return step


def guard_pair_step(
    cfg: TrainConfig,
    model: ControlNetPair,
    tx: optax.GradientTransformation,
    data: tuple[jt.TrainState, Any, ControlNetDataset, Schedule],
    budget: RunPlan,
    first: int,
) -> StepPlan:
    """`jax_impl.train.judge_step` on the pair's step (its regime's options; the run's state, the
    U-Net's parameters and the batch of step ``first``, as shapes)."""
    state, unet_params, dataset, schedule = data
    batch = pair_arrays(dataset.batch(first, cfg.batch_size, schedule, cfg.seed))
    args = (state, unet_params, batch, jax.random.key(0))
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    options = step_options(cfg.regime)

    def build(policy: str) -> Any:
        step = functools.partial(train_step.__wrapped__, model=model.clone(policy=policy), tx=tx, **options)
        return jax.jit(step, donate_argnums=(0,))

    return jt.judge_step(cfg, model.spec, build, args, budget, model.attention_chunk)


def generate_pair(
    model: ControlNetPair,
    state: jt.TrainState,
    unet_params: Any,
    schedule: Schedule,
    dataset: ControlNetDataset,
    cfg: TrainConfig,
) -> np.ndarray:
    """A grid of samples (NCHW), dropout off, each conditioned on its class's edge map."""
    unet = model.spec.unet
    shape = (cfg.num_samples, unet.in_channels, unet.sample_size, unet.sample_size)
    variables = {"params": {"controlnet": state.params, "unet": unet_params}}
    apply = jax.jit(lambda x, t, c: model.apply(variables, x, t, **c))

    def eps_fn(x: np.ndarray, t: np.ndarray, conditioning: dict[str, np.ndarray | None]) -> np.ndarray:
        inputs = {k: None if v is None else jnp.asarray(v) for k, v in conditioning.items()}
        inputs["controlnet_cond"] = jnp.asarray(conditioning["controlnet_cond"].transpose(0, 2, 3, 1))  # NHWC
        return np.asarray(apply(jnp.asarray(x.transpose(0, 2, 3, 1)), jnp.asarray(t), inputs)).transpose(0, 3, 1, 2)

    return sample(eps_fn, schedule, dataset, shape, cfg.sample_steps, cfg.seed)
