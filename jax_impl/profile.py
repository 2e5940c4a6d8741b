"""The JAX measuring half of planning (mirror: `torch_impl.profile`; docs/planning.md).

Every figure comes from the jitted `jax_impl.step.train_step` (state donated, ``cse_barrier_expander``
off: docs/remat_vs_checkpoint.md): bytes from one compile per uniform plan, XLA's live ranges filed by
unit (`jax_impl.xla_dump`); seconds from the plain step alone, recompute priced as its FLOPs at that
step's throughput (docs/planning.md#the-time-model). Shapes only: compiled, never run.
"""

from __future__ import annotations

import functools
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import jax
import numpy as np

from jax_impl import regime as jregime
from jax_impl import step as jt
from jax_impl import xla_dump
from jax_impl.memory import FAST_COMPILE as FAST
from jax_impl.memory import Dump, compile_uncached, compiled_peak, read_dump
from jax_impl.pair import init_pair, step_model
from jax_impl.pair import train_step as pair_step
from shared_configs.defaults import jax_cache_dir
from shared_configs.pair import CONTROLNET, ControlNetPairSpec, example_pair_batch
from shared_configs.planning.recompute_time import at_rates, step_flops
from shared_configs.planning.stepclock import clock, contenders, cpu_split, measured_rounds, times
from shared_configs.planning.timeline import Timeline, filed_units, profile_assignments, unit_costs
from shared_configs.planning.units import StepSpec, block_layers, leaf_units, policy_string
from shared_configs.planning.workers import XLA_CPU_OPTIONS as BARRIERS
from shared_configs.progress import progress, tracked
from shared_configs.regime import DEFAULT, STATE_MODEL, Regime, modelled_state_delta
from shared_configs.training.data import example_batch


def setup(
    spec: StepSpec,
    batch_size: int,
    context_length: int,
    chunk: int | None,
    run: bool,
    regime: Regime = DEFAULT,
    drawn: bool = False,
) -> dict[str, Any]:
    """The step's arguments in ``regime`` (the ControlNet step's: its state, then the frozen U-Net's
    parameters), real (``run``; ``drawn``: `_drawn`, the init's compile is long) or shapes, and the optimizer."""
    jregime.check_regime(regime)
    tx = jregime.make_optimizer(1e-4, 0.0, regime)
    model = step_model(spec, "none", chunk, regime.lora_rank)
    pair = isinstance(spec, ControlNetPairSpec)
    init = functools.partial(init_pair if pair else jt.init_state, model, tx, 0, regime)
    if not run:
        state = jax.eval_shape(init)
    elif drawn:
        state = _drawn(jax.eval_shape(init), pair)
    else:  # the training loop's own init (compiled fast: it runs once)
        state = jax.jit(init, compiler_options=FAST)()
    example = example_pair_batch if pair else example_batch
    inputs = (jt.arrays(example(spec, batch_size, context_length)), jax.random.key(2))
    args: tuple = (*(state if pair else (state,)), *(inputs if run else _abstract(inputs)))
    return {"spec": spec, "tx": tx, "args": args, "chunk": chunk, "run": run, "regime": regime}


def _drawn(abstract: Any, pair: bool) -> Any:
    """Arrays of an abstract state: parameters normal (scale 0.02), the rest zeros. XLA:CPU's step takes
    as long on these as on the init's values (no data-dependent kernels)."""
    rng = np.random.default_rng(0)

    def draw(tree: Any) -> Any:
        return jax.tree.map(lambda a: jax.device_put((0.02 * rng.standard_normal(a.shape)).astype(a.dtype)), tree)

    state = abstract[0] if pair else abstract
    zeros = jax.tree.map(lambda a: jax.device_put(np.zeros(a.shape, a.dtype)), state.replace(params=None))
    state = zeros.replace(params=draw(state.params))  # optimizer state, batch statistics and EMA zeros
    return (state, draw(abstract[1])) if pair else state


def _abstract(tree: Any) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def compiled_step(s: dict[str, Any], policy: str, dump: str | None = None, fast: bool = True) -> Any:
    """The donated, jitted train step under ``policy``, compiled (dumped into ``dump``; ``fast``: -O0, not run)."""
    options = jregime.step_options(s["regime"])
    train_step = pair_step if isinstance(s["spec"], ControlNetPairSpec) else jt.train_step
    model = step_model(s["spec"], policy, s["chunk"], s["regime"].lora_rank)
    step = jax.jit(functools.partial(train_step, model=model, tx=s["tx"], **options), donate_argnums=(0,))
    compiler: dict[str, Any] = {**BARRIERS, **FAST} if fast else dict(BARRIERS)
    lowered = step.lower(*s["args"])
    if dump is not None:  # past the persistent cache, if one is on: a cache hit would dump nothing
        compiler |= {"xla_dump_to": dump, "xla_dump_hlo_as_text": True, "xla_dump_hlo_module_re": "train_step"}
        if jax.config.jax_compilation_cache_dir:
            return compile_uncached(lowered, compiler)
    return lowered.compile(compiler_options=compiler)


def timeline_of(dump: Dump, leaves: list[str]) -> Timeline:
    """XLA's schedule as a `Timeline`: positions are instructions, buffers its values' live ranges."""
    where = xla_dump.segments(dump, set(leaves), first=leaves[0])
    names, starts, ends, sizes = zip(*dump.buffers(), strict=True)
    return Timeline(
        units=[u for u, _ in where],
        phases=[p for _, p in where],
        starts=np.array(starts, np.int64),
        ends=np.array(ends, np.int64),
        sizes=np.array(sizes, np.int64),
        static=np.array([dump.hlo.opcodes.get(n) == "parameter" for n in names], bool),
    )


def sharded_bytes(s: dict[str, Any]) -> dict[str, int]:
    """What FSDP would shard (`shared_configs.planning.budget.per_rank`), from shapes (the state may be abstract)."""
    state = s["args"][0]
    pair = isinstance(s["spec"], ControlNetPairSpec)
    frozen = s["args"][1] if pair else {}  # the ControlNet step's U-Net

    def nbytes(tree: Any) -> int:
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))

    def block_params(unit: str) -> Any:
        own = unit.startswith(CONTROLNET) or not pair
        return (state.params if own else frozen)[unit.removeprefix(CONTROLNET).replace(".", "_")]

    params = nbytes(state.params) + nbytes(frozen)
    block = max(nbytes(block_params(b)) for b in block_layers(s["spec"]))
    static = params + nbytes(state.opt_state) + nbytes(state.ema)  # ema: None (no leaves) without one
    trained = jregime.trained_leaves(state.params, s["regime"])
    return {"static_bytes": static, "grad_bytes": nbytes(trained), "block_param_bytes": block}


def modelled_state(s: dict[str, Any], regime: Regime) -> dict[str, Any]:
    """For a regime profiled in another (`Regime.profiled`): the state bytes it holds beyond it."""
    if regime.profiled == regime:
        return {}
    leaves = jregime.trained_leaves(s["args"][0].params, s["regime"])
    numels = [int(np.prod(x.shape)) for x in leaves]
    delta = modelled_state_delta(regime, numels, np.dtype(leaves[0].dtype).itemsize)
    return {"modelled_state_bytes": delta, "modelled": STATE_MODEL}


def memory_run(s: dict[str, Any], assignment: dict[str, str], fast: bool = True) -> tuple:
    """One compile under ``assignment``: per-unit bytes, the live-byte and compiled peaks, the compiled step."""
    leaves = [u for u, _ in leaf_units(s["spec"], assignment)]
    with tempfile.TemporaryDirectory(prefix="plan-xla-") as dump:
        compiled = compiled_step(s, policy_string(assignment), dump, fast=fast)
        plan = read_dump(dump)
    costs, _, live_peak = unit_costs(timeline_of(plan, leaves), leaves)
    return costs, live_peak, compiled_peak(compiled), compiled


def timed(
    s: dict[str, Any],
    compiled: dict[str, Any],
    rounds: int,
    peaks: dict[str, int] | None = None,
    race_to: dict[str, Any] | None = None,
) -> dict[str, list[float]]:
    """Per compiled step, `measured_rounds` after one warm-up each, the donated state carried along."""

    def step(c: Any) -> None:
        state, loss = c(*s["args"])
        jax.block_until_ready(loss)
        s["args"] = (state, *s["args"][1:])

    steps = {name: functools.partial(step, compiled[name]) for name in contenders(list(compiled), peaks or {}, race_to)}
    for step in steps.values():
        step()
    return measured_rounds(steps, peaks or {}, rounds, race_to) | {n: [] for n in compiled if n not in steps}


def profile(
    spec: StepSpec,
    batch_size: int,
    context_length: int = 77,
    shapes: bool = False,
    repeats: int = 1,
    attention_chunk: int | None = None,
    regime: Regime = DEFAULT,
) -> dict:
    """The `shared_configs.planning.budget.Profile` fields (JSON-ready) of ``spec`` at ``batch_size`` in ``regime``."""
    global _shapes
    cpu = {"start": round(clock(), 2)}  # the process's own start and imports, before this request
    timing = not shapes and repeats > 0
    with cpu_split(cpu, "setup"):
        s = setup(spec, batch_size, context_length, attention_chunk, run=timing, regime=regime.profiled, drawn=True)
        key = _shapes_key(spec, batch_size, context_length, attention_chunk, regime)
        _shapes = (key, s | {"args": _abstract(s["args"]), "run": False})
    assignments = profile_assignments(spec)
    with cpu_split(cpu, "compiles"):  # only the plain step is run: its throughput prices recompute
        measured = memory_runs(s, assignments, run_plain=timing)
    compiled = {policy_string({}): measured[0][3]} if timing else {}
    runs: dict[str, Any] = {
        policy_string(a): {"peak_bytes": peak, "live_peak_bytes": live, "step_time_s": None}
        for a, (_, live, peak, _) in zip(assignments, measured, strict=True)
    }
    units = filed_units(spec, batch_size, context_length, assignments, [m[0] for m in measured])
    del measured
    with cpu_split(cpu, "timing"):
        samples = timed(s, compiled, repeats) if timing else {}
    del compiled
    for policy, seconds in samples.items():
        runs[policy] |= times(seconds)
    step_time = runs[policy_string({})]["step_time_s"] or 0.0  # shapes only: no step was run
    if timing:
        units = at_rates(spec, units, step_time / step_flops(spec, batch_size, context_length, regime), 0.0)
    return {
        "framework": "jax",
        "units": units,
        **sharded_bytes(s),
        "opt_peak": 0,  # optax's updates are scheduled inside the backward: filed under its units
        "step_time_s": step_time,
        "scale": float(np.mean([r["peak_bytes"] / r["live_peak_bytes"] for r in runs.values()])),
        "mode": "shapes" if shapes or not repeats else "measured",
        "attention_chunk": attention_chunk,
        "meta": {
            "runs": runs,
            "method": "XLA's buffer live ranges over its schedule (xla_dump_to), filed by the op_name's Flax module; "
            "compiled with cse_barrier_expander disabled; recompute seconds: the unit's recompute FLOPs at the "
            "plain step's throughput (the process's CPU seconds, parameters drawn at the init's shapes); the remat "
            "runs compiled at -O0, not run",
            "versions": {"jax": jax.__version__},
            "regime": regime.describe(),
            "cpu_s": cpu,
            **modelled_state(s, regime),
        },
    }


COMPILE_THREADS = 2  # XLA compiles outside the GIL: two at a time use a second core


def memory_runs(s: dict[str, Any], assignments: list[dict[str, str]], run_plain: bool) -> list[tuple]:
    """`memory_run` of each assignment (the plain one at -O2 when ``run_plain``), `COMPILE_THREADS` at a
    time; one at a time with the persistent compilation cache (the dumped compiles toggle it)."""
    threads = 1 if jax.config.jax_compilation_cache_dir else COMPILE_THREADS
    with progress("compiles", len(assignments)) as p, ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(memory_run, s, a, not (run_plain and not a)) for a in assignments]
        for _ in as_completed(futures):
            p.advance()
        return [f.result() for f in futures]


_shapes: tuple[Any, dict[str, Any]] | None = None  # the last profile's step as shapes, for the worker's check


def _shapes_key(spec: StepSpec, batch_size: int, context_length: int, chunk: int | None, regime: Regime) -> tuple:
    return spec.model_dump_json(), batch_size, context_length, chunk, regime.profiled


def peaks(
    spec: StepSpec,
    batch_size: int,
    policies: list[str],
    context_length: int = 77,
    attention_chunk: int | None = None,
    regime: Regime = DEFAULT,
) -> dict:
    """Per policy, the compiled step's ``memory_analysis()`` peak (what `measure` reports) at -O0, nothing
    run; a kept worker reuses its profile's set-up."""
    cpu: dict[str, float] = {}
    key = _shapes_key(spec, batch_size, context_length, attention_chunk, regime)
    with cpu_split(cpu, "setup"):
        kept = _shapes is not None and _shapes[0] == key
        s = _shapes[1] if kept else setup(spec, batch_size, context_length, attention_chunk, False, regime.profiled)
    delta = modelled_state(s, regime).get("modelled_state_bytes", 0)
    with cpu_split(cpu, "compiles"):
        found = {p: compiled_peak(compiled_step(s, p)) + delta for p in tracked(policies, "compiles")}
    return {"peaks": found, "cpu_s": cpu}


def measure(
    spec: StepSpec,
    batch_size: int,
    policies: list[str],
    context_length: int = 77,
    steps: int = 3,
    attention_chunk: int | None = None,
    race_to: dict[str, Any] | None = None,
    regime: Regime = DEFAULT,
) -> dict:
    """Per policy: the compiled step's ``memory_analysis()`` peak and its step times (`measured_rounds`)."""
    s = setup(spec, batch_size, context_length, attention_chunk, run=True, regime=regime)
    compiled = {p: compiled_step(s, p, fast=False) for p in tracked(policies, "compiles")}
    rounds = timed(s, compiled, steps, {p: compiled_peak(c) for p, c in compiled.items()}, race_to)
    rows = {p: {"peak_bytes": compiled_peak(c)} | times(rounds[p]) for p, c in compiled.items()}
    return {
        "framework": "jax",
        "rows": rows,
        "method": "compiled memory_analysis() (arguments + outputs - aliased + temporaries), cse_barrier_expander off",
    }


def start_worker(request: dict[str, Any]) -> None:
    """Measured and checked steps persist in the compilation cache; a profile reads XLA's dumps, which a
    cache hit would not write."""
    if request["kind"] != "profile" and jax_cache_dir() is not None:
        jax.config.update("jax_compilation_cache_dir", jax_cache_dir())
