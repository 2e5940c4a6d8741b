"""DDPM noise-prediction training of the U-Net in JAX/Flax + optax: ``python -m jax_impl.train``.

A thin loop over an importable, jitted step. To put this U-Net in your own loop::

    model = UNet(spec=spec, policy="full")            # nn.remat applied inside, per the plan
    tx = make_optimizer(lr=1e-3, weight_decay=0.0)    # jax_impl.regime: optax.adamw by default
    state = init_state(model, tx, seed=0)              # TrainState: params, opt_state, batch_stats
    state, loss = train_step(state, arrays(batch), key, model=model, tx=tx)
    # bf16 mixed precision: float32 params and optimizer state, bf16 forward, float32 loss
    state, loss = train_step(..., model=model, tx=tx, compute_dtype=jnp.bfloat16)

Batches, timesteps, noise and the conditioning inputs (whichever the spec takes) come from
`shared_configs.training.data` (numpy, NCHW; `arrays` transposes images to NHWC), so `torch_impl.train`
sees the very same ones for a seed.
The dropout key of step ``s`` is derived from (seed, s), so a resumed run replays the same masks.
A ``norm_kind: batch`` spec carries its BatchNorm running statistics in ``state.batch_stats``
(updated once per step, remat or not); a GroupNorm spec's ``batch_stats`` is an empty dict.

``--distributed`` runs over every device, data-parallel or FSDP (`jax_impl.parallel`), of one
process or of several joined by `jax.distributed` (`jax_impl.processes`); checkpoints are orbax
folders (`jax_impl.checkpoint_io`). The run folder, resume checks and NaN guard are
framework-free (`shared_configs.training.loop`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
from jax.typing import DTypeLike

from jax_impl import processes
from jax_impl.checkpoint_io import FRAMEWORK, LAYOUT, abstract_target, load_checkpoint, save_checkpoint
from jax_impl.guard import StepPlan, compiled_peak, plan_for_step
from jax_impl.parallel import make_mesh, shard, state_shardings
from jax_impl.regime import (
    apply_regime,
    cast_floating,
    check_regime,
    init_ema,
    make_optimizer,
    step_options,
    update_ema,
)
from jax_impl.train_options import CLI, JaxOptions, on_device, run_settings
from jax_impl.unet import UNet
from shared_configs import load_spec
from shared_configs.defaults import device_of
from shared_configs.inputs import input_specs
from shared_configs.pair import ControlNetPairSpec
from shared_configs.planning.workers import XLA_CPU_OPTIONS
from shared_configs.regime import DEFAULT, Regime
from shared_configs.spec import UNetSpec
from shared_configs.training import config
from shared_configs.training.config import TrainConfig, cli_main, options_of
from shared_configs.training.data import CONDITIONING, Batch, Dataset, check_conditioning, load_dataset, step_seed
from shared_configs.training.ddpm import Schedule, check_objective, make_schedule, sample
from shared_configs.training.loop import RunStart, manifest_for, open_run, run_loop
from shared_configs.training.outputs import write_outputs
from shared_configs.training.run_folder import SOLO, Comm
from shared_configs.training.run_plan import RunPlan, report, resolve_any, resolve_run, workload_of
from shared_configs.units import MIB

# (noisy, t, noise, context, class_labels, text_embeds, time_ids): the conditioning in the forward's
# order (`shared_configs.training.data.CONDITIONING`), None where the spec takes none of it.
Arrays = tuple[jax.Array | None, ...]


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The flags of ``python -m jax_impl.train`` (`shared_configs.training.config.parse_args`)."""
    return config.parse_args(argv, CLI)


@flax.struct.dataclass
class TrainState:
    """Everything a step updates, as one pytree: the step's signature is the same for every norm."""

    params: Any
    opt_state: Any
    batch_stats: Any  # BatchNorm running statistics; {} for a GroupNorm spec
    ema: Any = None  # --ema: a float32 moving average of the params (None: none kept)

    @classmethod
    def create(cls, variables: Any, tx: optax.GradientTransformation, regime: Regime = DEFAULT) -> TrainState:
        """From Flax ``variables`` (``model.init``'s, or `jax_impl.convert.torch_to_flax_variables`'s),
        in ``regime``: params cast to its weight dtype, an EMA copy when it keeps one."""
        params = apply_regime(variables["params"], regime)
        return cls(params, tx.init(params), variables.get("batch_stats", {}), init_ema(params, regime))

    def variables(self) -> dict[str, Any]:
        return flax_variables(self.params, self.batch_stats)


def flax_variables(params: Any, batch_stats: Any) -> dict[str, Any]:
    """What ``model.apply`` takes; no empty ``batch_stats`` collection for a GroupNorm spec."""
    return {"params": params} | ({"batch_stats": batch_stats} if batch_stats else {})


def arrays(batch: Batch) -> Arrays:
    """(noisy, t, noise, context, class_labels, text_embeds, time_ids) as jax arrays (None kept),
    images NCHW -> NHWC."""
    return tuple(None if a is None else jnp.asarray(a) for a in host_arrays(batch))


def host_arrays(batch: Batch) -> tuple[np.ndarray | None, ...]:
    """`arrays` in numpy, on the host (to be placed over a mesh: `jax_impl.parallel.shard`)."""
    nhwc = (0, 2, 3, 1)
    return (batch.noisy.transpose(nhwc), batch.t, batch.noise.transpose(nhwc), *batch.conditioning().values())


def init_state(model: UNet, tx: optax.GradientTransformation, seed: int, regime: Regime = DEFAULT) -> TrainState:
    """Fresh parameters (from ``seed``), their optimizer state, and initial BatchNorm statistics, in
    ``regime`` (`TrainState.create`)."""
    spec = model.resolved_spec
    # Zeros of every input the spec takes (batch 1, one context token): the parameter shapes do not
    # depend on the sizes; the spec's own sample size, as before, keeps the traced init unchanged.
    wanted = input_specs(spec, 1, context_len=1, layout="NHWC")
    inputs = {k: None if v is None else jnp.zeros(v.shape, v.dtype) for k, v in wanted.items()}
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
    """MSE between the predicted and the true noise (dropout on, batch statistics), in float32.

    Returns (loss, updated batch_stats): under remat the collection is an output of the forward,
    so the running statistics move once per step (torch needs `torch_impl.batchnorm` for that).
    The batch_stats are never cast: Flax computes and keeps BatchNorm statistics in float32.

    With ``compute_dtype`` (``jnp.bfloat16``) the params, image and context are cast to it, so every
    conv and matmul of the forward (and, by transposition, of the backward) runs in that dtype;
    the gradients flow back through the casts as float32. The timesteps stay float32: bf16 keeps
    8 significant bits, so t in [512, 1024) would round to multiples of 4; the U-Net casts its
    sinusoidal features (bounded by 1) to the image dtype instead.
    """
    noisy, t, noise, *conditioning = batch
    check_conditioning(model.resolved_spec, dict(zip(CONDITIONING, conditioning, strict=True)))  # at trace time
    context, class_labels, text_embeds, time_ids = conditioning
    if compute_dtype is not None:  # time_ids stay float32, as t does (pixel sizes up to 2048 and more)
        params, noisy, context, class_labels, text_embeds = cast_floating(
            (params, noisy, context, class_labels, text_embeds), compute_dtype
        )
    variables, rngs = flax_variables(params, batch_stats), {"dropout": dropout_key}
    inputs = (context, class_labels, text_embeds, time_ids)
    pred, updates = model.apply(variables, noisy, t, *inputs, train=True, rngs=rngs, mutable=["batch_stats"])
    return jnp.mean((pred.astype(jnp.float32) - noise) ** 2), updates.get("batch_stats", batch_stats)


# The state is donated: the new params and optimizer state reuse its buffers (a step holds one copy
# of each, not two). Do not use a state after passing it in; keep the one returned.
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
    """One DDPM step: loss and gradients (through the remat plan the model carries), optax update.

    ``model``, ``tx``, ``compute_dtype`` and ``loss_scale`` are static: keep one object of each (see
    `make_optimizer`) to compile once. ``compute_dtype=jnp.bfloat16`` is mixed precision (see
    `loss_fn`): params, gradients, optimizer state and loss stay float32. ``loss_scale`` (float16)
    multiplies the loss before the backward and divides the gradients after. A state with an
    ``ema`` moves it toward the new params. Returns (new state, loss).
    """
    scale = 1.0 if loss_scale is None else loss_scale

    def scaled(params: Any) -> tuple[jax.Array, tuple[jax.Array, Any]]:
        loss, stats = loss_fn(params, state.batch_stats, model, batch, dropout_key, compute_dtype)
        return loss * scale, (loss, stats)

    (_, (loss, batch_stats)), grads = jax.value_and_grad(scaled, has_aux=True)(state.params)
    if loss_scale is not None:
        grads = jax.tree.map(lambda g: g / scale, grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return TrainState(params, opt_state, batch_stats, update_ema(state.ema, params)), loss


def generate(model: UNet, state: TrainState, schedule: Schedule, dataset: Dataset, cfg: TrainConfig,
             mesh: Mesh | None = None) -> np.ndarray:  # fmt: skip
    """A grid of samples (NCHW) from the short ancestral sampler (eval mode: dropout off, BatchNorm
    with its running statistics). With a ``mesh`` (the state sharded over it, maybe over several
    processes) every process runs it and gets the whole grid."""
    spec = model.resolved_spec
    shape = (cfg.num_samples, spec.in_channels, spec.sample_size, spec.sample_size)
    whole = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    apply = jax.jit(lambda x, t, c: model.apply(state.variables(), x, t, **c), out_shardings=whole)

    def eps_fn(x: np.ndarray, t: np.ndarray, conditioning: dict[str, np.ndarray | None]) -> np.ndarray:
        out = apply(jnp.asarray(x.transpose(0, 2, 3, 1)), jnp.asarray(t), conditioning)
        return np.asarray(out).transpose(0, 3, 1, 2)

    return sample(eps_fn, schedule, dataset, shape, cfg.sample_steps, cfg.seed)


PEAK_INSTRUMENT = "XLA's memory_analysis() of the compiled step this loop runs"


def make_step(
    cfg: TrainConfig,
    model: UNet,
    tx: optax.GradientTransformation,
    dataset: Dataset,
    schedule: Schedule,
    mesh: Mesh | None = None,
    budget: RunPlan | None = None,
) -> Callable[[TrainState, int], tuple[TrainState, float]]:
    """``step(state, s) -> (state, loss)``: training step ``s`` on its batch (a function of (seed, s)).

    With a ``mesh`` (`jax_impl.parallel.make_mesh`) the state is placed as
    ``cfg.distributed`` says (replicated, or FSDP-sharded) and the batch split over the devices;
    the regime's precision picks the forward's compute dtype and the loss scale
    (`jax_impl.regime.step_options`). With a
    ``budget`` the step is compiled ahead of the first one as the planner compiled it (XLA:CPU
    keeping remat's barriers, without which a plan saves nothing on CPU) and its compiled peak
    printed beside the prediction.
    """
    step_fn = functools.partial(train_step, model=model, tx=tx, **step_options(cfg.regime))
    compiled: list[jax.stages.Compiled] = []  # with a budget: the one executable every step runs

    def step(state: TrainState, index: int) -> tuple[TrainState, float]:
        batch = dataset.batch(index, cfg.batch_size, schedule, cfg.seed)  # the global batch, in every process
        if mesh is None:
            batch = arrays(batch)
        else:
            state, batch = shard(mesh, state, host_arrays(batch), cfg.distributed)
        key = jax.random.key(step_seed(cfg.seed, index))  # dropout masks depend on (seed, step) only
        if budget is None:
            state, loss = step_fn(state, batch, key)
            return state, float(loss)
        if not compiled:
            compiled.append(compile_step(step_fn, state, batch, key))
            if processes.process_rank() == 0:  # per device: every process compiled the same step
                report(budget.peak_line(compiled_peak(compiled[0]), peak_instrument()))
        state, loss = compiled[0](state, batch, key)
        return state, float(loss)

    return step


def compile_step(step_fn: functools.partial, *args: Any) -> jax.stages.Compiled:
    """``step_fn`` (`train_step` with its static arguments) compiled for ``args``; on CPU with
    remat's optimization barriers kept (`XLA_CPU_OPTIONS`), as the planner's profile compiles it."""
    options = XLA_CPU_OPTIONS if jax.default_backend() == "cpu" else {}
    return step_fn.func.lower(*args, **step_fn.keywords).compile(compiler_options=options)


def guard_step(
    cfg: TrainConfig,
    spec: UNetSpec,
    model: UNet,
    tx: optax.GradientTransformation,
    data: tuple[TrainState, Dataset, Schedule],
    budget: RunPlan,
    first: int,
) -> StepPlan:
    """`jax_impl.plan_for_step` on this loop's own step (`train_step`, its regime's options, the run's
    state and the batch of step ``first``, as shapes): the preamble's plan, corrected by what the
    compiled step holds beyond the planner's model step. Only compiled; one line per change."""
    options, (state, dataset, schedule) = step_options(cfg.regime), data
    batch = arrays(dataset.batch(first, cfg.batch_size, schedule, cfg.seed))
    args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (state, batch, jax.random.key(0)))

    def build(policy: str) -> Any:
        planned = model.clone(policy=policy)  # the same model under ``policy``
        return jax.jit(functools.partial(train_step.__wrapped__, model=planned, tx=tx, **options),
                       donate_argnums=(0,))  # fmt: skip

    return judge_step(cfg, spec, build, args, budget, model.attention_chunk)


def judge_step(
    cfg: TrainConfig,
    spec: UNetSpec | ControlNetPairSpec,
    build: Callable[[str], Any],
    args: Any,
    budget: RunPlan,
    attention_chunk: int | None,
) -> StepPlan:
    """`jax_impl.plan_for_step` on a loop's step, ``build(policy)``, for ``args`` (shapes), from the
    preamble's plan; ``spec``: a U-Net's or the ControlNet pair's. One line: the plan in force."""
    work = workload_of(cfg, spec, 1, attention_chunk)
    sp = plan_for_step(build, args, budget.budget_bytes, spec=work.spec, batch_size=work.batch_size,
                       regime=cfg.regime, policy=budget.policy, context_length=work.context_length,
                       attention_chunk=work.attention_chunk)  # fmt: skip
    report(f"guard: the loop's compiled step under {sp.plan} is {sp.compiled / MIB:.1f} MiB of the "
           f"{sp.budget / MIB:.1f} MiB budget ({len(sp.history)} compile(s))")  # fmt: skip
    return sp


def corrected(budget: RunPlan, spec: UNetSpec | ControlNetPairSpec, sp: StepPlan) -> RunPlan:
    """``budget`` with the guard's plan and its prediction (unchanged where the first plan fitted)."""
    if sp.plan == budget.policy:
        return budget
    return replace(budget, plan=resolve_any(spec, sp.plan), predicted_peak_bytes=sp.predicted, kept=False)


def peak_instrument() -> str:
    """How a budgeted run's compiled peak is read, as its line says."""
    cpu = "; XLA:CPU with cse_barrier_expander off, as planned" if jax.default_backend() == "cpu" else ""
    return PEAK_INSTRUMENT + cpu


def run_steps(
    state: TrainState,
    losses: list[float],
    dataset: Dataset,
    schedule: Schedule,
    cfg: TrainConfig,
    stop: int,
    model: UNet,
    tx: optax.GradientTransformation,
    on_step: Callable[[float], None] | None = None,
    mesh: Mesh | None = None,
) -> TrainState:
    """Steps ``len(losses) .. stop - 1`` (see `make_step`), appending each loss; returns the new state."""
    step = make_step(cfg, model, tx, dataset, schedule, mesh)
    for index in range(len(losses), stop):
        state, loss = step(state, index)
        losses.append(loss)
        if on_step is not None:
            on_step(loss)
    return state


def start_state(model: UNet, tx: optax.GradientTransformation, cfg: TrainConfig, run: RunStart, mesh: Mesh | None,
                comm: Comm = SOLO) -> TrainState:  # fmt: skip
    """The run's first state, placed as ``cfg.distributed`` says: restored from the run's checkpoint
    (checked first; onto this mesh, whatever mesh wrote it), or initialised from the seed (under
    FSDP straight into its shards: jit's ``out_shardings``, no full copy on one device)."""
    if mesh is None and run.checkpoint is None:
        return init_state(model, tx, cfg.seed, cfg.regime)
    abstract = jax.eval_shape(lambda: init_state(model, tx, cfg.seed, cfg.regime))
    if mesh is None:
        placement = jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), abstract)
    else:
        placement = state_shardings(mesh, abstract, cfg.distributed)
    if run.checkpoint is not None:
        return load_checkpoint(run.checkpoint, abstract_target(abstract, placement), comm)[0]
    return jax.jit(lambda: init_state(model, tx, cfg.seed, cfg.regime), out_shardings=placement)()


def train(cfg: TrainConfig) -> list[float]:
    """Run (or resume) training as ``cfg`` says; returns the loss of every step from step 0.

    Everything that can refuse the run (spec, objective, regime, devices, run folder, resume
    record, policy or budget) is checked before the model is initialised.
    """
    own = options_of(cfg, JaxOptions)
    joined = processes.join(own.coordinator, own.num_processes, own.process_id)  # before JAX's backend starts
    if joined is not None and joined.processes > 1:
        processes.check_distributed(joined.processes, cfg.distributed)
    spec = load_spec(cfg.config)
    check_objective(spec)
    check_regime(cfg.regime)
    if cfg.controlnet:  # one process (`check_controlnet`)
        from jax_impl.pair_train import train_pair  # here: it imports this module

        return train_pair(cfg, spec)
    with processes.lost_processes():
        return _train(cfg, spec)


def _train(cfg: TrainConfig, spec: UNetSpec) -> list[float]:
    device = device_of(jax.devices()[0].platform)
    cfg, own = on_device(cfg, device)
    mesh = make_mesh(cfg.batch_size) if cfg.distributed else None
    comm = processes.current_comm()  # one process, or every process of the run: the run folder's collectives
    with open_run(cfg, spec, FRAMEWORK, LAYOUT, owner=comm.rank == 0) as run:
        ranks, chunk, first = mesh.size if mesh else 1, own.attention_chunk, comm.rank == 0
        cfg, plan, budget = resolve_run(cfg, spec, CLI.name, ranks, run, first, attention_chunk=chunk)
        model = UNet(spec=spec, policy=plan, attention_chunk=chunk, lora_rank=cfg.regime.lora_rank)
        tx = make_optimizer(cfg.lr, cfg.weight_decay, cfg.regime)
        state = start_state(model, tx, cfg, run, mesh, comm)
        dataset, schedule = load_dataset(cfg.data, spec, cfg.seed), make_schedule(cfg.schedule, cfg.timesteps)
        guarded = None
        if budget is not None and mesh is None:  # the plan judged by the loop's own compiled step
            guarded = guard_step(cfg, spec, model, tx, (state, dataset, schedule), budget, len(run.losses))
            cfg, budget = replace(cfg, policy=guarded.plan), corrected(budget, spec, guarded)
            model = UNet(spec=spec, policy=budget.plan, attention_chunk=chunk, lora_rank=cfg.regime.lora_rank)

        def save_fn(state: TrainState, losses: list[float]) -> None:
            manifest = manifest_for(cfg, spec, FRAMEWORK, LAYOUT, losses)  # cfg.policy: the plan in force
            if guarded is not None:  # every compile judged, this run's after those of the run it resumes
                earlier = run.manifest.run.get("guard", []) if run.manifest is not None else []
                manifest.run["guard"] = [*earlier, *(asdict(r) for r in guarded.history)]
            save_checkpoint(run.out, state, manifest, comm)

        losses = run.losses
        step = make_step(cfg, model, tx, dataset, schedule, mesh, budget)
        state = run_loop(cfg, state, losses, step, save_fn, f"jax {spec.name} {plan.policy}", comm,
                         run_settings(cfg, device))  # fmt: skip
        samples = generate(model, state, schedule, dataset, cfg, mesh) if cfg.sample_steps > 0 else None
        if first:  # the logs and plots: process 0's
            write_outputs(cfg.out, losses, samples, f"jax_impl {spec.name}, policy {plan.policy}")
    return losses


def main(argv: list[str] | None = None) -> int:
    return processes.leave(cli_main(train, argv, CLI))  # several processes: each leaves as its status allows


if __name__ == "__main__":
    sys.exit(main())
