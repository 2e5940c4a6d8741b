"""The PyTorch measuring half of planning (mirror: `jax_impl.profile`; docs/planning.md).

Every figure comes from the training loop's own `torch_impl.step.train_step` after a warm-up step:
bytes from one step per uniform plan under `torch_impl.memory.StepTracker`, filed by unit through
module hooks; seconds from the plain and per-layer steps, every choice priced as its unit's forward
seconds at the choice's rate (`priced`). ``shapes=True``: fake tensors, nothing allocated. `measure_step`
is the one measurement of a step (the planner's `measure`, the benchmark's rows). Called by
`shared_configs.planning.workers`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from statistics import median
from typing import Any

import numpy as np
import torch

from shared_configs import UNetSpec
from shared_configs.planning import optimizer_step
from shared_configs.planning.budget import PROFILE_RUNS, Cost
from shared_configs.planning.stepclock import clock, cpu_split, in_turn, measured_rounds, times
from shared_configs.planning.timeline import BWD, FWD, filed_units, profile_assignments, unit_costs
from shared_configs.planning.units import StepSpec, block_layers, leaf_units, policy_string
from shared_configs.progress import tracked
from shared_configs.regime import DEFAULT, STATE_MODEL, Regime, modelled_state_delta
from shared_configs.training.data import Batch, batch_bytes, step_arrays
from torch_impl import compat
from torch_impl.compat import FakeTensor, FakeTensorMode, TorchDispatchMode
from torch_impl.memory import StepTracker, allocator_peak, memtracker, saved_for_backward, state_tensors, storage_bytes
from torch_impl.pair import ControlNetPair, step_batch, step_model, unit_modules
from torch_impl.regime import (
    DTYPE,
    add_lora,
    apply_regime,
    make_optimizer,
    step_tools,
    trained_parameters,
    weight_dtype,
)
from torch_impl.step import step_loss, train_step
from torch_impl.unet import UNet

OPTIMIZER = "optimizer"
_LOCAL_SCALAR = compat.aten("_local_scalar_dense").default


def start_worker(request: dict[str, Any]) -> None:
    """One intra-op thread, so that CPU seconds add up to the work, whatever else runs on the machine."""
    torch.set_num_threads(1)


@contextmanager
def hooks(
    model: UNet | ControlNetPair, opt: torch.optim.Optimizer, units: Iterable[str], on: Callable[[str, str], None]
) -> Iterator[None]:
    """Call ``on(unit, phase)`` when ``unit``'s forward or backward starts, and on the optimizer step."""
    with contextlib.ExitStack() as handles:  # each hook removed at exit
        handles.callback(opt.register_step_pre_hook(lambda *_: on(OPTIMIZER, "opt")).remove)
        for unit in units:
            for m in unit_modules(model, unit, "fwd"):
                handles.callback(m.register_forward_pre_hook(lambda *_, u=unit: on(u, "fwd")).remove)
            for m in unit_modules(model, unit, "bwd"):
                handles.callback(m.register_full_backward_pre_hook(lambda *_, u=unit: on(u, "bwd")).remove)
        yield


class ShapesOnly(contextlib.ExitStack):
    """``FakeTensorMode`` (``.fake``) with the CPU's answers where shapes alone differ (`_AsCPU`); entered
    once at a time, as often as needed."""

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)

    def __enter__(self) -> ShapesOnly:
        for mode in (self.fake, _AsCPU()):
            self.enter_context(mode)
        return self


class _AsCPU(TorchDispatchMode):
    """A value read (``.item()``) reads 1 (Adafactor's step count and norms set scalars, not tensors); a
    reduced ``mse_loss`` holds the unreduced loss's storage, as the CPU kernel's does."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _LOCAL_SCALAR:
            return True if args[0].dtype == torch.bool else 1
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mse_loss.default and out.dim() == 0:
            numel = torch.broadcast_shapes(args[0].shape, args[1].shape).numel()
            return out.new_empty(numel).resize_(())
        return out


def fake_regime(model: torch.nn.Module, regime: Regime, mode: ShapesOnly) -> torch.nn.Module:
    """`apply_regime` on a model of fake tensors, cast tensor by tensor: ``Module.to`` cannot swap fake
    parameters (peft's adapters are made outside the mode, then made fake)."""
    if regime.lora_rank is not None:
        add_lora(model, regime.lora_rank)
    with mode.fake:
        for module in model.modules():
            params, buffers = compat.tensor_tables(module)
            for table in (params, buffers):
                for name, t in table.items():
                    if t is None:
                        continue
                    new = t if isinstance(t, FakeTensor) else mode.fake.from_tensor(t)
                    weight = table is params
                    dtype = weight_dtype(regime, t.requires_grad) if weight else DTYPE[regime.param_dtype]
                    new = new.to(dtype) if new.is_floating_point() else new
                    table[name] = torch.nn.Parameter(new, t.requires_grad) if weight else new
    return model


def setup(
    spec: StepSpec, batch_size: int, context_length: int, shapes: bool = False, regime: Regime = DEFAULT
) -> dict[str, Any]:
    """Model, optimizer, inputs and a step function in ``regime``, after a warm-up step. ``shapes``: fake
    tensors (`ShapesOnly`; run steps inside ``s["mode"]``), the step `step_loss` without a ``GradScaler``."""
    mode: Any = ShapesOnly() if shapes else contextlib.nullcontext()
    torch.manual_seed(0)
    with mode:
        model = step_model(spec)  # the U-Net, or the ControlNet pair (`torch_impl.pair`)
    model = fake_regime(model, regime, mode) if shapes else apply_regime(model, regime)
    with mode:
        opt = make_optimizer(model, lr=1e-4, weight_decay=0.0, regime=regime)
        tools = step_tools(model, regime, scaler=not shapes)
        batch = step_batch(spec, batch_size, context_length)
        run = step_loss if shapes else train_step
        step: Callable[[], Any] = functools.partial(run, model, opt, batch, tools=tools)
        step()
    return {
        "spec": spec,
        "model": model,
        "opt": opt,
        "batch": batch,
        "step": step,
        "mode": mode,
        "shapes": shapes,
        "held": [] if tools.ema is None else tools.ema.shadow,
    }


def sharded_bytes(s: dict[str, Any]) -> dict[str, int]:
    """What FSDP would shard (`shared_configs.planning.budget.per_rank`), by size (fake tensors have no storage)."""
    model = s["model"]

    def nbytes(tensors: Iterable[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    params = nbytes(model.parameters())
    state = nbytes(v for st in s["opt"].state.values() for v in st.values() if isinstance(v, torch.Tensor))
    state += nbytes(s["held"])
    block = max(nbytes(p for m in unit_modules(model, b, FWD) for p in m.parameters()) for b in block_layers(s["spec"]))
    return {"static_bytes": params + state, "grad_bytes": nbytes(trained_parameters(model)), "block_param_bytes": block}


def memory_run(s: dict[str, Any], assignment: dict[str, str]) -> tuple[dict[str, Cost], int, int]:
    """One step under ``assignment``: per-unit bytes, the optimizer's peak, the step's peak."""
    units = [u for u, _ in leaf_units(s["spec"], assignment)]
    return unit_costs(tracked_step(s, policy_string(assignment), units).unit_timeline(), units)


def tracked_step(s: dict[str, Any], policy: str, units: Iterable[str] = ()) -> StepTracker:
    """One set-up step under ``policy`` inside `StepTracker` (``units`` marked as their hooks fire): the tracker."""
    s["model"].enable_gradient_checkpointing(policy)
    tracker = StepTracker(s["model"], s["opt"], s["held"], batch_inputs(s["batch"]), detail=False)
    with s["mode"], hooks(s["model"], s["opt"], units, tracker.mark), tracker:
        s["step"]()
    return tracker


def batch_inputs(batch: Batch) -> list[torch.Tensor]:
    """The numpy batch as the tensors a step reads, sharing its memory (read by the step, not allocated)."""
    return [torch.from_numpy(a) for a in step_arrays(batch)]


def timed_step(s: dict[str, Any], assignment: dict[str, str]) -> tuple[dict[str, tuple[float, float]], float]:
    """One step under ``assignment``: per unit, its forward's and backward's seconds (hook to hook); the step's."""
    model = s["model"]
    model.enable_gradient_checkpointing(policy_string(assignment))
    units = [u for u, _ in leaf_units(s["spec"], assignment)]
    marks: list[tuple[float, str, str]] = []
    with hooks(model, s["opt"], units, lambda unit, phase: marks.append((clock(), unit, phase))):
        t0 = clock()
        s["step"]()
        seconds = clock() - t0
    spent: dict[tuple[str, str], float] = defaultdict(float)
    for (t0, unit, phase), (t1, _, _) in itertools.pairwise(marks):
        spent[(unit, phase)] += t1 - t0
    return {u: (spent[(u, FWD)], spent[(u, BWD)]) for u in units}, seconds


def timing_runs(
    s: dict[str, Any], assignments: list[dict[str, str]], repeats: int
) -> list[tuple[dict[str, list[float]], float]]:
    """Per assignment, medians over ``repeats`` rounds of `timed_step`, in turn within each round: a
    process's first steps run slower, which would make the plain run, timed first, look dearest."""
    rounds = [
        [timed_step(s, assignment) for assignment in assignments]
        for _ in tracked(range(repeats), "timing rounds", lambda r: f"{len(assignments)} steps")
    ]
    return [
        ({u: [median(r[0][u][k] for r in runs) for k in (0, 1)] for u in runs[0][0]}, median(r[1] for r in runs))
        for runs in zip(*rounds, strict=True)
    ]


def profile(
    spec: StepSpec,
    batch_size: int,
    context_length: int = 77,
    shapes: bool = False,
    repeats: int = 1,
    regime: Regime = DEFAULT,
) -> dict:
    """The `shared_configs.planning.budget.Profile` fields (``repeats=0``: bytes only). Where fake tensors
    give the real step's bytes (`fake_is_exact`), the runs not timed are traced on them."""
    cpu = {"start": round(clock(), 2)}  # the process's own start and imports, before this request
    timing, exact = not shapes and repeats > 0, fake_is_exact(regime.profiled)
    with cpu_split(cpu, "setup"):
        real = (
            None
            if shapes or (exact and not timing)
            else setup(spec, batch_size, context_length, False, regime.profiled)
        )
        fake = fake_setup(spec, batch_size, context_length, regime.profiled) if shapes or exact else None
    assignments = profile_assignments(spec)
    named = tracked(zip(PROFILE_RUNS, assignments, strict=True), "memory runs", lambda run: " ".join(run[0]))
    with cpu_split(cpu, "memory"):  # a real run also warms its plan up for the timing
        measured = [
            memory_run(real if real and (not exact or level == TIMED_LEVEL) else fake, a) for (_, level), a in named
        ]
    runs = {
        policy_string(a): {"peak_bytes": peak, "step_time_s": None}
        for a, (_, _, peak) in zip(assignments, measured, strict=True)
    }
    units = filed_units(spec, batch_size, context_length, assignments, [costs for costs, _, _ in measured])
    step_time, rates = 0.0, {}
    with cpu_split(cpu, "timing"):
        if timing and real is not None:
            units, step_time, rates = priced(real, units, assignments, repeats, runs)
    s = fake or real
    assert s is not None
    return {
        "framework": "torch",
        "units": units,
        "opt_peak": measured[0][1],  # the plain run's, PROFILE_RUNS' first
        **sharded_bytes(s),
        "step_time_s": step_time,
        "mode": "measured" if timing else "shapes",
        "meta": {
            "runs": runs,
            "method": "live tensor-storage bytes filed by unit (module hooks) in torch_impl.train.train_step "
            f"({'the runs not timed on fake tensors, the same bytes' if exact else 'every run real'}); "
            "recompute seconds: the unit's forward CPU seconds in the plain step (single thread, hook to hook) "
            "times its choice's rate, the per-layer run's extra step seconds per forward second recomputed; "
            "the runs timed in turn",
            "time_rates": rates,
            "versions": {"torch": torch.__version__},
            "regime": regime.describe(),
            # torch's CPU default (foreach runs on CUDA only): shared_configs.planning.optimizer_step
            "optimizer_step": optimizer_step.describe(regime.profiled.optimizer, "per-parameter"),
            "cpu_s": cpu,
            **modelled_state(s, regime),
        },
    }


def fake_is_exact(regime: Regime) -> bool:
    """Whether fake tensors file the real step's bytes exactly (tests/test_profile_fake.py); under
    autocast the real step holds cast copies the fake one does not."""
    return regime.precision == "fp32"


_fake: tuple[Any, dict[str, Any]] | None = None  # the last `fake_setup`, for the same worker's next request


def fake_setup(spec: StepSpec, batch_size: int, context_length: int, regime: Regime) -> dict[str, Any]:
    """`setup` on fake tensors, kept for a kept worker's next request of the same workload (its check)."""
    global _fake
    key = (spec.model_dump_json(), batch_size, context_length, regime)
    if _fake is None or _fake[0] != key:
        _fake = None  # the old one's memory first
        _fake = (key, setup(spec, batch_size, context_length, shapes=True, regime=regime))
    return _fake[1]


# The runs timed: the plain step and the per-layer plans, each recomputing every layer under one choice.
TIMED_LEVEL = "layers"


def priced(
    s: dict[str, Any], units: dict[str, dict[str, Cost]], assignments: list[dict[str, str]], repeats: int, runs: dict
) -> tuple[dict[str, dict[str, Cost]], float, dict[str, float]]:
    """``units`` priced as the step runs them: a recompute redoes the unit's forward, so a choice costs the
    unit's forward seconds in the plain step (a block: its layers' and sampler's) times the choice's rate, the
    median over the per-layer run's layers of each one's extra seconds per forward second, weighted by its
    forward (a stall in a few layers' round moves it little; none above 0, as on a machine too loaded to
    tell: 1, the forward run again). Each timed run's median step is filed in ``runs``. Returns the units,
    the plain step's seconds and the rates."""
    timed = [a for (_, level), a in zip(PROFILE_RUNS, assignments, strict=True) if level == TIMED_LEVEL]
    results = timing_runs(s, timed, repeats)
    plain, step_time = results[0]  # the plain run is PROFILE_RUNS' first
    forward = {u: fwd for u, (fwd, _) in plain.items()}
    forward |= {b: sum(forward[n] for n in layers) for b, layers in block_layers(s["spec"]).items()}
    rates = {}
    for assignment, (per_unit, seconds) in zip(timed, results, strict=True):
        runs[policy_string(assignment)]["step_time_s"] = seconds
        if assignment:  # a per-layer run, every layer under one choice
            (choice,) = set(assignment.values())
            extra = [(sum(per_unit[u]) - sum(plain[u])) / forward[u] for u in assignment]
            rate = np.quantile(extra, 0.5, weights=[forward[u] for u in assignment], method="inverted_cdf")
            rates[choice] = float(rate) if rate > 0 else 1.0  # no signal above noise: its forward again
    priced = {
        u: {c: replace(v, time_s=rates.get(c, 0.0) * forward[u]) for c, v in per.items()} for u, per in units.items()
    }
    return priced, step_time, rates


def measure(
    spec: StepSpec,
    batch_size: int,
    policies: list[str],
    context_length: int = 77,
    steps: int = 3,
    race_to: dict[str, Any] | None = None,
    regime: Regime = DEFAULT,
) -> dict:
    """Per policy: `measure_step`'s peaks and the step times (``rounds_s``, in turn; ``race_to``: raced)."""
    s = setup(spec, batch_size, context_length, regime=regime)
    peaks = {}
    for policy in policies:
        s["model"].enable_gradient_checkpointing(policy)
        s["step"]()  # warm-up under this plan
        row = measure_step(s["model"], s["opt"], s["step"], s["batch"], s["held"])
        peaks[policy] = {k: row[k] for k in ("peak_bytes", "allocator_peak_bytes")}

    def under(policy: str) -> Callable[[], None]:
        return lambda: (s["model"].enable_gradient_checkpointing(policy), s["step"]())

    rounds = measured_rounds(
        {p: under(p) for p in policies}, {p: r["peak_bytes"] for p, r in peaks.items()}, steps, race_to
    )
    rows = {p: peaks[p] | times(rounds[p]) for p in policies}
    return {"framework": "torch", "rows": rows, "method": "torch_impl.profile.measure_step around train_step"}


def measure_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: Callable[[], Any],
    batch: Batch,
    held: list[torch.Tensor] | None = None,
    check: bool = False,
    tracked: bool = True,
) -> dict[str, Any]:
    """One step under `StepTracker` (the peak, its parts, timeline), the allocator (``allocator_peak_bytes``;
    on CUDA the peak, what tensors do not explain counted as temporaries) and `saved_for_backward`.
    ``check``: PyTorch's ``MemTracker`` too (CPU). ``tracked=False``: the allocator only (torch.compile).
    ``held``: training state alive throughout (an EMA); the numpy batch counts on CPU only."""
    held, device = held or [], next(model.parameters()).device
    inputs = batch_inputs(batch) if device.type == "cpu" else []
    tracker = StepTracker(model, optimizer, held, inputs)
    found: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            allocator = stack.enter_context(allocator_peak())
            if check:
                found = stack.enter_context(memtracker(model, optimizer, inputs + held))
        if tracked:
            stack.enter_context(tracker)
        saved = stack.enter_context(saved_for_backward(exclude=[*model.parameters(), *model.buffers()]))
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        allocated = torch.cuda.max_memory_allocated(device)
    else:  # the allocator's events show the blocks the step allocates above what persists (or its start)
        persistent = storage_bytes([*model.parameters(), *model.buffers(), *state_tensors(optimizer), *held])
        grads = storage_bytes(p.grad for p in model.parameters() if p.grad is not None)
        allocated = persistent + batch_bytes(batch) + max(grads, allocator["peak"])
    row = {"allocator_peak_bytes": allocated, "saved_bytes": saved["bytes"]}
    if not tracked:
        return row | {"peak_bytes": allocated}
    result = tracker.result
    breakdown = dict(result.breakdown)
    if device.type == "cuda":
        breakdown["temporary"] += max(0, allocated - result.peak)
    return row | {
        "peak_bytes": max(result.peak, allocated) if device.type == "cuda" else result.peak,
        "tracker_peak_bytes": result.peak,
        "memtracker_peak_bytes": found.get("peak"),
        "timeline": result.timeline,
        **{f"{kind}_bytes": value for kind, value in breakdown.items()},
    }


def peaks(
    spec: StepSpec, batch_size: int, policies: list[str], context_length: int = 77, regime: Regime = DEFAULT
) -> dict:
    """Per policy, `StepTracker`'s peak of a step of fake tensors as `measure_step` takes it (no unit hooks):
    the real step's in float32 (`fake_is_exact`), a little under it in mixed precision (docs/planning.md#checks)."""
    cpu: dict[str, float] = {}
    with cpu_split(cpu, "setup"):
        s = fake_setup(spec, batch_size, context_length, regime.profiled)
    delta = modelled_state(s, regime).get("modelled_state_bytes", 0)
    with cpu_split(cpu, "steps"):
        found = {policy: tracked_step(s, policy).result.peak + delta for policy in policies}
    return {"peaks": found, "cpu_s": cpu}


def modelled_state(s: dict[str, Any], regime: Regime) -> dict[str, Any]:
    """For a regime profiled in another (`Regime.profiled`): the state bytes it holds beyond it."""
    trained = trained_parameters(s["model"])
    if not trained or regime.profiled == regime:
        return {}
    delta = modelled_state_delta(regime, [p.numel() for p in trained], trained[0].element_size())
    return {"modelled_state_bytes": delta, "modelled": STATE_MODEL}


def measure_compiled(
    spec: UNetSpec, batch_size: int, ratios: list[float], context_length: int = 77, steps: int = 3
) -> dict:
    """torch.compile's own planner (``activation_memory_budget`` = each ratio), trained by `train_step`,
    its peak at the allocator level (`measure_step`); compile seconds apart."""
    rows = {}
    for ratio in ratios:
        with compat.activation_memory_budget(ratio):
            s = setup(spec, batch_size, context_length)
            compiled = torch.compile(s["model"])
            start = time.perf_counter()
            train_step(compiled, s["opt"], s["batch"])
            compile_s = time.perf_counter() - start
            step = functools.partial(train_step, compiled, s["opt"], s["batch"])
            step()
            peak = measure_step(s["model"], s["opt"], step, s["batch"], s["held"], tracked=False)
            rows[f"torch.compile:{ratio:g}"] = {
                "allocator_peak_bytes": peak["allocator_peak_bytes"],
                "step_time_s": median(in_turn({"compiled": step}, steps)["compiled"]),
                "compile_s": compile_s,
            }
    return {
        "framework": "torch",
        "rows": rows,
        "method": "torch.compile(model) + activation_memory_budget; "
        "allocator-level peak (torch.profiler memory events) around train_step",
    }
