"""The JAX backend of the benchmark's worker (mirror: `benchmarks.backends.torch_bench`; docs/benchmark.md).

A row compiles the jitted `jax_impl.step.train_step` a user's loop calls, with XLA's memory plan
dumped (`jax_impl.memory`: the peak, its parts, the timeline); ``cost_analysis()`` gives the FLOPs,
``saved_residuals`` what autodiff keeps; one warm-up run, then ``steps`` timed runs. Imported by the
worker only, after it has set ``XLA_FLAGS``.
"""

from __future__ import annotations

import functools
import gc
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import flax
import jax
import numpy as np
import optax

from benchmarks.harness.job import (
    OPTIMIZER,
    XLA_CPU_FLAG,
    Job,
    cpu_name,
    job_spec,
    load_benchmark_spec,
    policy_arg,
    timing_stats,
)
from jax_impl import UNet
from jax_impl import regime as jregime
from jax_impl import step as jt
from jax_impl.compat import saved_residuals
from jax_impl.memory import FAST_COMPILE, compile_with_plan, compiled_peak
from jax_impl.parallel import make_mesh, shard, state_shardings
from shared_configs.defaults import device_of, resolve_chunk
from shared_configs.regime import Regime
from shared_configs.spec import SpecError
from shared_configs.training.data import example_batch

SEED = 0


def attention_chunk(job: Job, device: jax.Device) -> int | None:
    """The job's chunk size; ``auto``: the device's default (`shared_configs.defaults`)."""
    return resolve_chunk(job.attention_chunk, device_of(device.platform))


def resolve_device(requested: str) -> jax.Device:
    if requested == "gpu":
        try:
            return jax.devices("gpu")[0]
        except RuntimeError:
            raise RuntimeError("device: gpu requested but jax sees no GPU (install jax[cuda12])") from None
    return jax.devices("cpu")[0] if requested == "cpu" else jax.devices()[0]


def _on_gpu(device: jax.Device) -> bool:
    return device.platform in ("gpu", "cuda", "rocm")


one_row_per_process = _on_gpu  # on GPU the device's peak counter cannot be reset: each row needs a fresh process


_PENDING: dict[tuple[str, int], Future] = {}  # (policy, batch size) -> its compile, under way
_BACKGROUND: list[Future] = []  # every compile started by prepare, the initial state's included


def prepare(job: Job, device: jax.Device) -> None:
    """Start compiling every row's step and the initial state, two at a time (XLA compiles on one core);
    rows wait for all of it, so no compile overlaps a timed step."""
    if job.jax_cache is not None:
        jax.config.update("jax_compilation_cache_dir", job.jax_cache)
    if job.source == "diffusers":  # its weights first: if they do not fit, no row can run
        _initial_state(job.config, job.sample_size, job.source, job.regime)
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="compile")
    for policy, batch_size in job.rows()[:1] if one_row_per_process(device) else job.rows():
        _PENDING[(policy, batch_size)] = pool.submit(_compile, job, policy, batch_size, device)
    if not (job.peak_only and not _on_gpu(device)):
        _BACKGROUND.append(pool.submit(_initial_state, job.config, job.sample_size, job.source, job.regime))
    _BACKGROUND.extend(_PENDING.values())
    pool.shutdown(wait=False)


def device_info(device: jax.Device) -> dict[str, Any]:
    kind, name = ("gpu", device.device_kind) if _on_gpu(device) else ("cpu", cpu_name())
    return {"kind": kind, "name": name, "platform": device.platform}


VERSIONS = {"jax": jax.__version__, "jaxlib": jax.lib.__version__, "flax": flax.__version__, "optax": optax.__version__}


def memory_method(device: jax.Device, attention_chunk: int | None) -> str:
    attention = (
        f"attention: query-chunked, {attention_chunk} queries per chunk (UNet(attention_chunk=...))"
        if attention_chunk
        else "attention: jax.nn.dot_product_attention (unchunked)"
    )
    if _on_gpu(device):
        # The counter cannot be reset, hence one process per row; it also sees the compiler's
        # autotuning scratch, counted as temporaries beside XLA's plan.
        return f"{attention}; jax device memory_stats() peak_bytes_in_use (one process per row), parts from XLA's plan"
    flags = os.environ.get("XLA_FLAGS", "").split()
    barrier = "cse_barrier_expander disabled" if XLA_CPU_FLAG in flags else "XLA:CPU default passes"
    return f"{attention}; XLA compiled memory_analysis() total, {barrier}; parts from XLA's plan"


@functools.cache
def _initial_state(config: str, sample_size: int | None, source: str, regime: Regime) -> Any:
    """The host TrainState every row starts from (each donates its device copy), the same for every policy."""
    jregime.check_regime(regime)
    tx = jregime.make_optimizer(OPTIMIZER.lr, OPTIMIZER.weight_decay, regime)
    if source == "diffusers":
        from jax_impl.diffusers_io import from_diffusers

        if regime.lora_rank is not None:
            raise SpecError("trainable: lora:R on a diffusers folder is measured in torch only (--framework torch)")
        state = jt.TrainState.create({"params": from_diffusers(config)[1]}, tx, regime)
    else:
        model = UNet(spec=load_benchmark_spec(config, sample_size), policy="none", lora_rank=regime.lora_rank)
        state = jax.jit(functools.partial(jt.init_state, model, tx, SEED, regime), compiler_options=FAST_COMPILE)()
    return jax.tree.map(np.asarray, state)


def _setup(job: Job, policy: str, batch_size: int, device: jax.Device) -> dict[str, Any]:
    """What a row's step takes, the state abstract; over ranks, sharded as ``--distributed fsdp`` trains."""
    spec, regime = job_spec(job), job.regime
    tx = jregime.make_optimizer(OPTIMIZER.lr, OPTIMIZER.weight_decay, regime)
    state, mesh = _abstract_state(spec, tx, regime), None
    rank_batch = jt.arrays(example_batch(spec, batch_size, job.context_length))
    if job.world_size == 1:
        batch = jax.device_put(rank_batch, device)
    else:
        mesh = make_mesh(job.world_size * batch_size)
        placement = state_shardings(mesh, state, "fsdp")
        state = jax.tree.map(lambda a, p: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=p), state, placement)
        whole = jt.arrays(example_batch(spec, job.world_size * batch_size, job.context_length))
        batch = shard(mesh, {}, whole, "fsdp")[1]
    options = jregime.step_options(regime)  # the step's compute dtype and loss scale
    return {
        "model": UNet(
            spec=spec,
            policy=policy_arg(policy),
            attention_chunk=attention_chunk(job, device),
            lora_rank=regime.lora_rank,
        ),
        "tx": tx,
        "state": state,
        "batch": batch,
        "key": jax.random.key(2),
        "options": options,
        "dtype": options["compute_dtype"],
        "mesh": mesh,
        "rank_batch": rank_batch,
    }


@functools.cache
def _abstract_state(spec: Any, tx: Any, regime: Regime) -> Any:
    """The TrainState's shapes and dtypes (traced once: the same for every policy and batch)."""
    model = UNet(spec=spec, policy="none", lora_rank=regime.lora_rank)
    return jax.eval_shape(lambda: jt.init_state(model, tx, SEED, regime))


def _compile(job: Job, policy: str, batch_size: int, device: jax.Device) -> tuple[dict[str, Any], Any, Any, Any]:
    """(setup, lowered, compiled, XLA's memory plan) of one row's step, compile seconds in setup."""
    s = _setup(job, policy, batch_size, device)
    lowered = jt.train_step.lower(s["state"], s["batch"], s["key"], model=s["model"], tx=s["tx"], **s["options"])
    compiled, plan, s["compile_s"] = compile_with_plan(lowered, job.jax_cache)
    return s, lowered, compiled, plan


def _nbytes(tree: Any) -> int:
    """Bytes of ``tree``'s arrays on one device: a sharded leaf's shard, any other leaf whole."""

    def one(x: Any) -> int:
        sharding = getattr(x, "sharding", None)
        return int(np.prod(x.shape if sharding is None else sharding.shard_shape(x.shape))) * x.dtype.itemsize

    return sum(one(x) for x in jax.tree.leaves(tree))


def _flops(compiled: Any) -> float | None:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return None if not cost or "flops" not in cost else float(cost["flops"])


def _saved_bytes(s: dict[str, Any]) -> int:
    """Residuals autodiff keeps for backward, parameters excluded (as on the torch side)."""

    def loss(params: Any, batch_stats: Any, batch: Any, key: jax.Array) -> jax.Array:
        return jt.loss_fn(params, batch_stats, s["model"], batch, key, s["dtype"])[0]

    state = s["state"]
    residuals = saved_residuals(loss, state.params, state.batch_stats, s["batch"], s["key"])
    return sum(
        int(np.prod(a.shape)) * a.dtype.itemsize
        for a, where in residuals
        if not where.startswith("from the argument params")
    )


def _xla_default(lowered: Any, row: dict[str, Any]) -> dict[str, Any]:
    """The peak of the same step compiled with XLA:CPU's default passes (never run, so -O0)."""
    peak = row["peak_bytes"]  # without optimization barriers (no remat) the pass has nothing to strip: same program
    if "opt-barrier" in lowered.as_text(dialect="hlo"):
        flags = [
            f.split("=", 1)[1] for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_disable_hlo_p")
        ]
        kept = [p for flag in flags for p in flag.split(",") if p and p != "cse_barrier_expander"]
        # -O0 (FAST_COMPILE): buffer assignment comes before code generation: same memory analysis, faster.
        peak = compiled_peak(
            lowered.compile(compiler_options={"xla_disable_hlo_passes": ",".join(kept), **FAST_COMPILE})
        )
    return {
        "xla_default_peak_bytes": peak,
        "xla_default_method": "the same lowered step compiled again with XLA:CPU's default passes "
        "(cse_barrier_expander on), LLVM -O0 (buffer assignment precedes code generation), never run; a step "
        "without remat has no barriers and is not compiled twice",
    }


def _run_steps(s: dict[str, Any], compiled: Any, steps: int) -> tuple[float, list[float]]:
    """One warm-up run, then ``steps`` timed runs; each donates the state it is given."""
    state, times = s["state"], []
    for _ in range(steps + 1):
        if s["mesh"] is not None:  # jit picks the new state's shardings: placed back, as the training loop does
            state = shard(s["mesh"], state, (), "fsdp")[0]
        t0 = time.perf_counter()
        state, loss = compiled(state, s["batch"], s["key"])
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - t0)
    return times[0], times[1:]


def measure(job: Job, policy: str, batch_size: int, device: jax.Device) -> dict[str, Any]:
    """Every measured figure of one (policy, batch size) row."""
    wait(_BACKGROUND)  # every compile done before anything is timed
    pending = _PENDING.pop((policy, batch_size), None)
    s, lowered, compiled, plan = pending.result() if pending else _compile(job, policy, batch_size, device)
    row: dict[str, Any] = {
        "compile_s": s["compile_s"],
        "compiled_peak_bytes": plan.peak,
        "peak_bytes": plan.peak,
        "fragmentation_bytes": plan.fragmentation,
        "live_peak_bytes": plan.live_peak,
        "xla_live_peak_bytes": plan.xla_live_peak,
        "flops": _flops(compiled),
        "param_count": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(s["state"].params)),
        "static_bytes": _nbytes((s["state"].params, s["state"].batch_stats, s["state"].opt_state)),
        **{f"{kind}_bytes": value for kind, value in plan.parts.items()},
    }
    if policy in job.timeline:
        row["timeline"] = plan.timeline
    if job.xla_default and not _on_gpu(device):
        row.update(_xla_default(lowered, row))
    if not (job.peak_only and not _on_gpu(device)):  # on CPU the peak is the compiled step's: no run needed
        initial = _initial_state(job.config, job.sample_size, job.source, job.regime)
        s["state"] = jax.device_put(initial, device) if s["mesh"] is None else shard(s["mesh"], initial, (), "fsdp")[0]
        row["saved_bytes"] = _saved_bytes({**s, "batch": s["rank_batch"]})  # one rank's residuals
        first, samples = _run_steps(s, compiled, 0 if job.peak_only else job.steps)
        row.update(timing_stats(samples) if samples else {}, first_step_s=first)
    if _on_gpu(device):  # the device's own peak; what XLA's plan does not explain is scratch
        row["peak_bytes"] = max(plan.peak, device.memory_stats()["peak_bytes_in_use"])
        row["temporary_bytes"] += row["peak_bytes"] - plan.peak
    # SPMD: one program for every device, each holding the same shapes (its shards), so rank 0's
    # figures are every rank's; memory_analysis() and XLA's plan are per device.
    row.update(
        world_size=job.world_size,
        max_rank_peak_bytes=row["peak_bytes"],
        peak_method=memory_method(device, attention_chunk(job, device)),
        flops_method="XLA cost_analysis() of the compiled step (all ops, optimizer included; a loop body once)",
        saved_method="jax saved_residuals of the loss (params excluded)",
        check_method="live bytes rebuilt from XLA's dump against XLA's own count (HloLiveRange) at its peak",
    )
    return row


def release(device: jax.Device) -> None:
    gc.collect()
    jax.clear_caches()


OOM_TYPES = (MemoryError,)  # XLA's RESOURCE_EXHAUSTED is a JaxRuntimeError, recognised by message
simulated_oom = functools.partial(  # a fresh error per raise, as torch_bench's
    jax.errors.JaxRuntimeError, "RESOURCE_EXHAUSTED: simulated: Out of memory allocating 1073741824 bytes"
)
