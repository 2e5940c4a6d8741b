"""``python -m jax_impl.train``: DDPM noise-prediction training in JAX/Flax + optax, the CLI and its loop.

One loop over the U-Net or, with ``--controlnet``, a ControlNet on the frozen U-Net (`jax_impl.pair`),
stepping `jax_impl.step`'s step. Batches, noise and dropout keys are functions of (seed, step), as
torch's, so a resumed run replays them; the run folder, resume checks and NaN guard are
`shared_configs.training.loop`'s. Mirror: `torch_impl/train.py`; docs/training.md.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import asdict, dataclass, field, replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from jax_impl import processes
from jax_impl.checkpoint_io import FRAMEWORK, LAYOUT, abstract_target, load_checkpoint, save_checkpoint
from jax_impl.pair import ControlNetPair, init_pair, pair_trainee, step_model
from jax_impl.parallel import make_mesh, state_shardings
from jax_impl.regime import check_regime, make_optimizer
from jax_impl.step import Trainee, TrainState, corrected, guard_step, init_state, make_step, nhwc
from jax_impl.unet import UNet
from shared_configs import load_spec
from shared_configs.cli import cache_dir
from shared_configs.defaults import AUTO, CHUNK_HELP, chunk_arg, device_of, jax_cache_dir, resolve_chunk
from shared_configs.pair import ControlNetPairSpec, load_step_dataset, step_spec
from shared_configs.spec import UNetSpec
from shared_configs.training import config
from shared_configs.training.config import FrameworkCLI, TrainConfig, cli_main, options_of, used
from shared_configs.training.data import Dataset
from shared_configs.training.ddpm import Schedule, check_objective, make_schedule, sample
from shared_configs.training.loop import RunStart, manifest_for, open_run, run_loop
from shared_configs.training.outputs import write_outputs
from shared_configs.training.run_folder import Comm
from shared_configs.training.run_plan import resolve_run


@dataclass(frozen=True)
class JaxOptions:
    """The flags torch has no use for: the attention chunk, the XLA cache, and `jax.distributed`'s (torchrun's)."""

    # UNet(attention_chunk=...); "auto": the device's (`shared_configs.defaults`), resolved by `on_device`
    attention_chunk: int | str | None = AUTO
    jax_cache: str | None = field(default_factory=jax_cache_dir)  # the persistent compilation cache; None: off
    coordinator: str | None = None  # jax.distributed (`jax_impl.processes`); the three None: detected, else one process
    num_processes: int | None = None
    process_id: int | None = None

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        d = cls()
        parser.add_argument(
            "--attention-chunk", type=chunk_arg, default=d.attention_chunk, metavar="N", help=CHUNK_HELP
        )
        parser.add_argument(
            "--jax-cache",
            type=cache_dir,
            default=d.jax_cache or "none",
            metavar="DIR",
            help="JAX's persistent compilation cache folder (%(default)s; 'none': off)",
        )
        processes.add_flags(parser)

    def check(self, cfg: TrainConfig) -> None:
        processes.check_flags(self.coordinator, self.num_processes, self.process_id, cfg.distributed)


CLI = FrameworkCLI("jax", JaxOptions, rank=processes.process_rank)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """The flags of ``python -m jax_impl.train`` (`shared_configs.training.config.parse_args`)."""
    return config.parse_args(argv, CLI)


def run_settings(cfg: TrainConfig, device: str) -> str:
    """What the run uses on ``device``: its attention chunk, dtype and compilation cache."""
    own = options_of(cfg, JaxOptions)
    return used(cfg, device, attention_chunk=resolve_chunk(own.attention_chunk, device), jax_cache=own.jax_cache)


def on_device(cfg: TrainConfig, device: str) -> tuple[TrainConfig, JaxOptions]:
    """``cfg`` with its attention chunk resolved on ``device``, and its options; the compilation cache turned on."""
    own = options_of(cfg, JaxOptions)
    own = replace(own, attention_chunk=resolve_chunk(own.attention_chunk, device))
    if own.jax_cache is not None:  # a repeated run loads its compiled steps
        jax.config.update("jax_compilation_cache_dir", own.jax_cache)
    return replace(cfg, options=own), own


def generate(
    trainee: Trainee,
    state: TrainState,
    spec: UNetSpec,
    schedule: Schedule,
    dataset: Dataset,
    cfg: TrainConfig,
    mesh: Mesh | None = None,
) -> np.ndarray:
    """A grid of samples (NCHW) from the short ancestral sampler, in eval mode (a pair's conditioned on each
    class's edge map); with a ``mesh`` every process runs it and gets the whole grid."""
    whole = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    variables = trainee.variables(state, *trainee.frozen)
    apply = jax.jit(lambda x, t, c: trainee.model.apply(variables, x, t, **c), out_shardings=whole)

    def eps_fn(x: np.ndarray, t: np.ndarray, conditioning: dict[str, np.ndarray | None]) -> np.ndarray:
        x, t, *inputs = (None if a is None else jnp.asarray(a) for a in nhwc(x, t, *conditioning.values()))
        out = apply(x, t, dict(zip(conditioning, inputs, strict=True)))
        return np.asarray(out).transpose(0, 3, 1, 2)

    shape = (cfg.num_samples, spec.in_channels, spec.sample_size, spec.sample_size)
    return sample(eps_fn, schedule, dataset, shape, cfg.sample_steps, cfg.seed)


def start(
    model: UNet | ControlNetPair,
    tx: optax.GradientTransformation,
    cfg: TrainConfig,
    run: RunStart,
    mesh: Mesh | None,
    comm: Comm,
) -> tuple[TrainState, Trainee]:
    """The run's first state and what it steps (a pair's frozen U-Net made from the seed again on resume). The
    state is placed as ``cfg.distributed`` says: restored from the run's checkpoint, or made from the seed (under
    FSDP straight into its shards, no full copy on one device)."""
    if isinstance(model, ControlNetPair):  # one process (`check_controlnet`)
        state, unet_params = init_pair(model, tx, cfg.seed, cfg.regime)
        init, trainee = (lambda: state), pair_trainee(model, unet_params)
    else:
        init, trainee = functools.partial(init_state, model, tx, cfg.seed, cfg.regime), Trainee(model)
    if mesh is None and run.checkpoint is None:
        return init(), trainee
    abstract = jax.eval_shape(init)
    placement = (
        jax.tree.map(lambda _: SingleDeviceSharding(jax.devices()[0]), abstract)
        if mesh is None
        else state_shardings(mesh, abstract, cfg.distributed)
    )
    if run.checkpoint is not None:
        return load_checkpoint(run.checkpoint, abstract_target(abstract, placement), comm)[0], trainee
    return jax.jit(init, out_shardings=placement)(), trainee


def train(cfg: TrainConfig) -> list[float]:
    """Run (or resume) training as ``cfg`` says, every refusal before the model is built; every step's loss."""
    own = options_of(cfg, JaxOptions)
    count = processes.join(own.coordinator, own.num_processes, own.process_id)  # before JAX's backend starts
    if count > 1:
        processes.check_distributed(count, cfg.distributed)
    spec = load_spec(cfg.config)
    check_objective(spec)
    check_regime(cfg.regime)
    trains = step_spec(spec, cfg.controlnet, cfg.regime)  # the U-Net, or the ControlNet pair
    with processes.lost_processes():
        return _train(cfg, spec, trains)


def _train(cfg: TrainConfig, spec: UNetSpec, trains: UNetSpec | ControlNetPairSpec) -> list[float]:
    device = device_of(jax.devices()[0].platform)
    cfg, own = on_device(cfg, device)
    mesh = make_mesh(cfg.batch_size) if cfg.distributed else None
    comm = processes.current_comm()  # one process, or every process of the run: the run folder's collectives
    with open_run(cfg, spec, FRAMEWORK, LAYOUT, owner=comm.rank == 0) as run:
        ranks, chunk, first = mesh.size if mesh else 1, own.attention_chunk, comm.rank == 0
        cfg, plan, budget = resolve_run(cfg, trains, CLI.name, ranks, run, first, attention_chunk=chunk)
        tx = make_optimizer(cfg.lr, cfg.weight_decay, cfg.regime)
        state, trainee = start(step_model(trains, plan, chunk, cfg.regime.lora_rank), tx, cfg, run, mesh, comm)
        dataset, schedule = load_step_dataset(cfg.data, trains, cfg.seed), make_schedule(cfg.schedule, cfg.timesteps)
        guarded = None
        if budget is not None and mesh is None:  # the plan judged by the loop's own compiled step
            guarded = guard_step(cfg, trains, trainee, tx, (state, dataset, schedule), budget, len(run.losses))
            cfg, budget = replace(cfg, policy=guarded.plan), corrected(budget, trains, guarded)
            trainee = trainee.clone(guarded.plan)

        def save_fn(state: TrainState, losses: list[float]) -> None:
            manifest = manifest_for(cfg, spec, FRAMEWORK, LAYOUT, losses)  # cfg.policy: the plan in force
            if guarded is not None:  # every compile judged, this run's after those of the run it resumes
                earlier = run.manifest.run.get("guard", []) if run.manifest is not None else []
                manifest.run["guard"] = [*earlier, *(asdict(r) for r in guarded.history)]
            save_checkpoint(run.out, state, manifest, comm)

        losses = run.losses
        step = make_step(cfg, trainee, tx, dataset, schedule, mesh, budget)
        state = run_loop(
            cfg, state, losses, step, save_fn, f"jax {trains.name} {plan.policy}", comm, run_settings(cfg, device)
        )
        samples = generate(trainee, state, spec, schedule, dataset, cfg, mesh) if cfg.sample_steps > 0 else None
        if first:  # the logs and plots: process 0's
            write_outputs(cfg.out, losses, samples, f"jax_impl {trains.name}, policy {plan.policy}")
    return losses


def main(argv: list[str] | None = None) -> int:
    return processes.leave(cli_main(train, argv, CLI))  # several processes: each leaves as its status allows


if __name__ == "__main__":
    sys.exit(main())
