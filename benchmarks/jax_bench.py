"""One JAX/Flax training step (forward, MSE loss, backward, ``optax.adamw``), measured.

Imported by the worker only, after it has set ``XLA_FLAGS``. Per row: the step is jitted (with
params and optimizer state donated), lowered and compiled (timed apart); the compiled step's
``memory_analysis()`` and ``cost_analysis()`` give the peak and FLOPs; ``saved_residuals`` gives
what autodiff keeps; one warm-up run, then ``steps`` timed runs. On CPU the same lowered step is
compiled a second time with XLA's default pass list (``cse_barrier_expander`` enabled, LLVM at
-O0 since that compile is never run) for the un-flagged figure.
"""

from __future__ import annotations

import functools
import gc
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax._src.ad_checkpoint import saved_residuals  # public only as print_saved_residuals

from benchmarks.common import XLA_CPU_FLAG, Job, cpu_name, job_spec, load_benchmark_spec, policy_arg, timing_stats
from jax_impl import UNet

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
TIMESTEPS = 1000
Batch = dict[str, Any]


def resolve_device(requested: str) -> jax.Device:
    if requested == "gpu":
        try:
            return jax.devices("gpu")[0]
        except RuntimeError:
            raise RuntimeError("device: gpu requested but jax sees no GPU (install jax[cuda12])") from None
    if requested == "cpu":
        return jax.devices("cpu")[0]
    return jax.devices()[0]


def _on_gpu(device: jax.Device) -> bool:
    return device.platform in ("gpu", "cuda", "rocm")


def one_row_per_process(device: jax.Device) -> bool:
    """On GPU the device's peak counter cannot be reset: each row needs a fresh process."""
    return _on_gpu(device)


def device_info(device: jax.Device) -> dict[str, Any]:
    name = device.device_kind if _on_gpu(device) else cpu_name()
    return {"kind": "gpu" if _on_gpu(device) else "cpu", "name": name, "platform": device.platform}


def versions() -> dict[str, str]:
    import flax

    return {"jax": jax.__version__, "jaxlib": jax.lib.__version__, "flax": flax.__version__, "optax": optax.__version__}


def memory_method(device: jax.Device) -> str:
    if _on_gpu(device):
        # The counter cannot be reset, hence one process per row; it also sees the compiler's
        # autotuning scratch, so compiled_peak_bytes (memory_analysis) is reported beside it.
        return "jax device memory_stats() peak_bytes_in_use (one process per row, preallocation off)"
    flags = os.environ.get("XLA_FLAGS", "")
    barrier = "cse_barrier_expander disabled" if XLA_CPU_FLAG in flags.split() else "XLA:CPU default passes"
    return f"XLA compiled memory_analysis() (arguments + outputs - aliased + temporaries), {barrier}"


def make_batch(spec: Any, batch_size: int, context_length: int, dtype: Any, device: jax.Device) -> Batch:
    """Deterministic NHWC inputs; the same shapes and distributions as the torch side's."""
    rng = np.random.default_rng(0)
    size = spec.sample_size
    batch = {
        "x": rng.standard_normal((batch_size, size, size, spec.in_channels), dtype=np.float32),
        "t": rng.integers(0, TIMESTEPS, (batch_size,)).astype(np.float32),
        "context": None,
        "target": rng.standard_normal((batch_size, size, size, spec.out_channels), dtype=np.float32),
    }
    if spec.cross_attention_dim is not None:
        batch["context"] = rng.standard_normal((batch_size, context_length, spec.cross_attention_dim), np.float32)
    cast = {k: None if v is None else jnp.asarray(v, jnp.float32 if k == "t" else dtype) for k, v in batch.items()}
    return jax.device_put(cast, device)


def make_step(model: UNet, tx: optax.GradientTransformation) -> tuple[Callable, Callable]:
    """The loss ``(params, x, t, context, target, key)`` and the jitted train step."""

    def loss_fn(params: Any, x: jax.Array, t: jax.Array, context: Any, target: jax.Array, key: jax.Array) -> Any:
        out = model.apply({"params": params}, x, t, context, train=True, rngs={"dropout": key})
        return jnp.mean((out.astype(jnp.float32) - target.astype(jnp.float32)) ** 2)

    def train_step(params: Any, opt_state: Any, batch: Batch, key: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(
            params, batch["x"], batch["t"], batch["context"], batch["target"], key
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return loss_fn, jax.jit(train_step, donate_argnums=(0, 1))


def _nbytes(tree: Any) -> int:
    # ``dtype.itemsize`` rather than ``np.dtype``: PRNG key arrays have an extended dtype.
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _compiled_peak(compiled: Any) -> int:
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def _flops(compiled: Any) -> float | None:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return None if not cost or "flops" not in cost else float(cost["flops"])


def _default_passes_peak(lowered: Any) -> int:
    """Peak of the same step compiled with XLA:CPU's default passes (never run, so -O0)."""
    kept = [p for p in _disabled_passes() if p != "cse_barrier_expander"]
    options = {
        "xla_disable_hlo_passes": ",".join(kept),
        # Code generation only (buffer assignment comes before it): same memory analysis, faster.
        "xla_backend_optimization_level": 0,
        "xla_llvm_disable_expensive_passes": True,
    }
    return _compiled_peak(lowered.compile(compiler_options=options))


def _disabled_passes() -> list[str]:
    out: list[str] = []
    for flag in os.environ.get("XLA_FLAGS", "").split():
        if flag.startswith("--xla_disable_hlo_passes="):
            out += [p for p in flag.split("=", 1)[1].split(",") if p]
    return out


def _saved_bytes(loss_fn: Callable, params: Any, batch: Batch, key: jax.Array) -> int:
    """Residuals autodiff keeps for backward, parameters excluded (as on the torch side)."""
    args = (params, batch["x"], batch["t"], batch["context"], batch["target"], key)
    residuals = saved_residuals(loss_fn, *args)
    keep = [aval for aval, where in residuals if not where.startswith("from the argument params")]
    return _nbytes(keep)


def init_params(shapes: Any, dtype: Any, seed: int = 0) -> Any:
    """Parameters drawn host-side with Flax's default initialisers' distributions.

    LeCun-normal kernels, zero biases, unit norm scales. Jitting ``model.init`` instead compiles
    the whole forward pass once more, which costs as much as compiling the step on XLA:CPU;
    the values do not change what is measured.
    """
    rng = np.random.default_rng(seed)

    def draw(path: tuple, leaf: Any) -> np.ndarray:
        name = str(getattr(path[-1], "key", path[-1]))
        shape = tuple(leaf.shape)
        if name == "kernel":
            fan_in = int(np.prod(shape[:-1])) or 1
            value = rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)
        else:
            value = np.full(shape, 1.0 if name == "scale" else 0.0, np.float32)
        return value.astype(dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


@functools.cache
def _host_params(config: str, sample_size: int | None, dtype_name: str, source: str) -> Any:
    """Host copies of the parameters: the tree is the same for every policy (by design), and
    each row needs fresh device copies, since the step donates them. A diffusers folder's own
    weights when ``source`` is "diffusers"."""
    if source == "diffusers":
        from jax_impl.diffusers_io import from_diffusers

        return jax.tree.map(lambda a: np.asarray(a).astype(DTYPES[dtype_name]), from_diffusers(config)[1])
    spec = load_benchmark_spec(config, sample_size)
    model = UNet(spec=spec, policy="none")
    x = jnp.zeros((1, spec.sample_size, spec.sample_size, spec.in_channels))
    context = None if spec.cross_attention_dim is None else jnp.zeros((1, 1, spec.cross_attention_dim))
    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    shapes = jax.eval_shape(lambda: model.init(keys, x, jnp.zeros((1,)), context, train=False))
    return init_params(shapes["params"], DTYPES[dtype_name])


def _setup(job: Job, policy: str, batch_size: int, device: jax.Device) -> dict[str, Any]:
    spec = job_spec(job)
    dtype = DTYPES[job.dtype]
    model = UNet(spec=spec, policy=policy_arg(policy), attention_chunk=job.attention_chunk)
    batch = make_batch(spec, batch_size, job.context_length, dtype, device)
    params = jax.device_put(_host_params(job.config, job.sample_size, job.dtype, job.source), device)
    tx = optax.adamw(1e-4)
    loss_fn, step = make_step(model, tx)
    return {
        "params": params,
        "opt_state": tx.init(params),
        "batch": batch,
        "key": jax.random.key(2),
        "loss_fn": loss_fn,
        "step": step,
    }


def _analysis(s: dict[str, Any], device: jax.Device, xla_default: bool) -> dict[str, Any]:
    """Compile (timed) and read the compiled step's memory and cost analyses."""
    t0 = time.perf_counter()
    lowered = s["step"].lower(s["params"], s["opt_state"], s["batch"], s["key"])
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    static = 2 * _nbytes(s["params"]) + _nbytes(s["opt_state"])  # params + grads + optimizer state
    input_bytes = _nbytes([v for v in s["batch"].values() if v is not None]) + _nbytes(s["key"])
    row = {
        "compiled": compiled,
        "compile_s": compile_s,
        "compiled_peak_bytes": _compiled_peak(compiled),
        "static_bytes": static,
        "input_bytes": input_bytes,
        "flops": _flops(compiled),
        "param_count": sum(int(np.prod(x.shape)) for x in jax.tree.leaves(s["params"])),
    }
    if xla_default and not _on_gpu(device):
        # Without optimization barriers (no remat) the pass has nothing to strip: same program.
        has_barriers = "opt-barrier" in lowered.as_text(dialect="hlo")
        row["xla_default_peak_bytes"] = _default_passes_peak(lowered) if has_barriers else row["compiled_peak_bytes"]
        row["xla_default_method"] = (
            "the same lowered step compiled again with XLA:CPU's default passes (cse_barrier_expander on), "
            "LLVM -O0 (buffer assignment precedes code generation), never run; a step without remat has no "
            "barriers and is not compiled twice"
        )
        row["xla_default_activation_bytes"] = row["xla_default_peak_bytes"] - static - input_bytes
    return row


def _run_steps(s: dict[str, Any], compiled: Any, steps: int) -> tuple[float, list[float]]:
    """One warm-up run, then ``steps`` timed runs; params and optimizer state are donated."""
    params, opt_state = s["params"], s["opt_state"]
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        params, opt_state, loss = compiled(params, opt_state, s["batch"], s["key"])
        jax.block_until_ready((params, opt_state, loss))
        times.append(time.perf_counter() - t0)
    s["params"], s["opt_state"] = params, opt_state
    return times[0], times[1:]


def measure(job: Job, policy: str, batch_size: int, device: jax.Device) -> dict[str, Any]:
    """Every measured figure of one (policy, batch size) row."""
    s = _setup(job, policy, batch_size, device)
    row = _analysis(s, device, job.xla_default)
    compiled = row.pop("compiled")
    if not (job.peak_only and not _on_gpu(device)):  # on CPU the peak is the compiled step's: no run needed
        row["saved_bytes"] = _saved_bytes(s["loss_fn"], s["params"], s["batch"], s["key"])
        first, samples = _run_steps(s, compiled, 0 if job.peak_only else job.steps)
        row.update(timing_stats(samples) if samples else {}, first_step_s=first)
    if _on_gpu(device):
        row["peak_bytes"] = device.memory_stats()["peak_bytes_in_use"]
    else:
        row["peak_bytes"] = row["compiled_peak_bytes"]
    row.update(
        activation_bytes=row["peak_bytes"] - row["static_bytes"] - row["input_bytes"],
        peak_method=memory_method(device),
        flops_method="XLA cost_analysis() of the compiled step (all ops, optimizer included)",
        saved_method="jax saved_residuals of the loss (params excluded)",
    )
    return row


def release(device: jax.Device) -> None:
    gc.collect()
    jax.clear_caches()


def oom_types() -> tuple[type[BaseException], ...]:
    return (MemoryError,)  # XLA's RESOURCE_EXHAUSTED is a JaxRuntimeError, recognised by message


def simulated_oom() -> BaseException:
    return jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: simulated: Out of memory allocating 1073741824 bytes")
