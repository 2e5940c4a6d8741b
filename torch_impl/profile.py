"""The PyTorch per-unit profile for `shared_configs.planning.budget`, and the plain measurement of a plan.

Every figure comes from the training loop's own `torch_impl.train.train_step`, after a warm-up step
has made the gradients and AdamW's state: bytes from one traced step per uniform plan (`Recorder`, a
live-tensor tracker that notes the unit running at each allocation: a `timeline.Timeline`); seconds
from the plain and per-layer steps timed unit hook to unit hook, every choice priced at two fitted
rates (`priced`); FLOPs from the spec (`unit_flops`). ``shapes=True``: the same steps on fake tensors,
nothing allocated, time left to FLOPs. `measure` is the verification (the benchmark's `StepTracker`
and the median step). Mirror: `jax_impl.profile`; docs/planning.md#the-profile.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import statistics
import sys
import time
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from shared_configs import UNetSpec
from shared_configs.planning import optimizer_step
from shared_configs.planning.budget import (
    PLAIN,
    PROFILE_RUNS,
    STEM,
    Cost,
    StepSpec,
    block_layers,
    leaf_units,
    policy_string,
    uniform,
)
from shared_configs.planning.recompute_time import at_rates, plain_keeps, step_flops, work
from shared_configs.planning.stepclock import clock, fitted_rates, measured_rounds, round_robin, times
from shared_configs.planning.timeline import BWD, FWD, Timeline, unit_costs
from shared_configs.planning.unit_flops import recompute_flops, unit_flops
from shared_configs.planning.workers import serve
from shared_configs.progress import tracked
from shared_configs.regime import DEFAULT, STATE_MODEL, Regime, modelled_state_delta
from shared_configs.training.data import batch_bytes, step_arrays
from torch_impl.memory import AllocatorPeak, StepTracker, state_tensors, storage_bytes
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
from torch_impl.train import step_loss, train_step
from torch_impl.unet import UNet

OPTIMIZER = "optimizer"


def single_threaded() -> None:
    """One intra-op thread: CPU seconds then add up to the work, whatever else runs on the machine."""
    torch.set_num_threads(1)


class Recorder(TorchDispatchMode):
    """Live tensor storages as a `Timeline`: a position per allocation and per unit boundary, each
    storage alive from the position that allocated it to the last one before it was freed."""

    def __init__(self, existing: list[torch.Tensor]) -> None:
        super().__init__()
        self.units: list[str] = []
        self.phases: list[str] = []
        self.starts: list[int] = []
        self.ends: list[int] = []  # -1 while alive
        self.sizes: list[int] = []
        self.static: list[bool] = []
        self._index: dict[int, int] = {}  # id(storage) -> buffer
        self._refs: dict[int, weakref.ref] = {}
        self.enter((STEM, FWD))
        for t in existing:
            self._track(t, static=True)

    def enter(self, segment: tuple[str, str]) -> None:
        self.segment = segment
        self.units.append(segment[0])
        self.phases.append(segment[1])

    def _track(self, t: torch.Tensor, static: bool = False) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self._index and self._refs[key]() is st:
            return
        if not static:
            self.enter(self.segment)  # a new position: the level after this allocation
        self._index[key] = len(self.sizes)
        self._refs[key] = weakref.ref(st, lambda _ref, key=key: self._release(key))
        self.starts.append(len(self.units) - 1)
        self.ends.append(-1)
        self.sizes.append(st.nbytes())
        self.static.append(static)

    def _release(self, key: int) -> None:
        index = self._index.pop(key, None)
        self._refs.pop(key, None)
        if index is not None:
            self.ends[index] = len(self.units) - 1

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        return out

    def timeline(self) -> Timeline:
        last = len(self.units) - 1
        ends = np.array([last if e < 0 else e for e in self.ends], np.int64)
        return Timeline(self.units, self.phases, np.array(self.starts, np.int64), ends,
                        np.array(self.sizes, np.int64), np.array(self.static, bool))  # fmt: skip


@contextmanager
def hooks(model: UNet | ControlNetPair, opt: torch.optim.Optimizer, units: list[str], on: Callable[[str, str], None]
          ) -> Iterator[None]:  # fmt: skip
    """Call ``on(unit, phase)`` when ``unit``'s forward or backward starts, and on the optimizer step."""
    handles = [opt.register_step_pre_hook(lambda *_: on(OPTIMIZER, "opt"))]
    for unit in units:
        for m in unit_modules(model, unit, "fwd"):
            handles.append(m.register_forward_pre_hook(lambda *_, u=unit: on(u, "fwd")))
        for m in unit_modules(model, unit, "bwd"):
            handles.append(m.register_full_backward_pre_hook(lambda *_, u=unit: on(u, "bwd")))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class ShapesOnly:
    """``FakeTensorMode`` (the tensors of ``.fake``), in which a value read (``.item()``) reads 1:
    Adafactor reads its step count and norms, which set scalars, not which tensors it makes."""

    def __init__(self) -> None:
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self._stacks: list[contextlib.ExitStack] = []

    def __enter__(self) -> ShapesOnly:
        stack = contextlib.ExitStack()
        stack.enter_context(self.fake)
        stack.enter_context(_ValuesReadOne())
        self._stacks.append(stack)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stacks.pop().__exit__(*exc)


class _ValuesReadOne(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            return True if args[0].dtype == torch.bool else 1
        return func(*args, **(kwargs or {}))


def fake_regime(model: torch.nn.Module, regime: Regime, mode: ShapesOnly) -> torch.nn.Module:
    """`apply_regime` on a model of fake tensors. peft's adapters are made outside the mode (peft
    moves them with ``Module.to``, which cannot swap fake parameters; they are small) and then
    made fake; the weights are cast tensor by tensor, as ``Module.to`` would, for the same reason."""
    if regime.lora_rank is not None:
        add_lora(model, regime.lora_rank)
    with mode.fake:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is None:
                        continue
                    new = t if isinstance(t, FakeTensor) else mode.fake.from_tensor(t)
                    weight = table is module._parameters
                    dtype = weight_dtype(regime, t.requires_grad) if weight else DTYPE[regime.param_dtype]
                    new = new.to(dtype) if new.is_floating_point() else new
                    table[name] = torch.nn.Parameter(new, t.requires_grad) if table is module._parameters else new
    return model


def setup(
    spec: StepSpec, batch_size: int, context_length: int, shapes: bool = False, regime: Regime = DEFAULT
) -> dict[str, Any]:
    """Model, optimizer and inputs in ``regime`` and a step function, after a warm-up step (the
    gradients and the optimizer state exist).

    ``shapes``: everything is a fake tensor (`ShapesOnly`); run steps inside ``s["mode"]``
    (outermost). The step is `step_loss` there (no loss read) and without a ``GradScaler`` (it
    skips a step whose gradients overflowed; its own state is two scalars, its unscaling in place).
    """
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
    return {"spec": spec, "model": model, "opt": opt, "batch": batch, "step": step, "mode": mode, "shapes": shapes,
            "tools": tools}  # fmt: skip


def existing(s: dict[str, Any]) -> list[torch.Tensor]:
    """Tensors alive before a step: parameters, last step's gradients, AdamW state, the inputs."""
    model, opt, ema = s["model"], s["opt"], s["tools"].ema
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    inputs = [torch.from_numpy(a) for a in step_arrays(s["batch"])]
    shadow = [] if ema is None else ema.shadow
    return [*model.parameters(), *model.buffers(), *grads, *state_tensors(opt), *shadow, *inputs]


def sharded_bytes(s: dict[str, Any]) -> dict[str, int]:
    """What FSDP would shard (`shared_configs.planning.budget.per_rank`): parameters, optimizer state
    and an EMA copy; the gradients (of the trained parameters only); the largest block's parameters
    (counted by size: fake tensors have no storage)."""
    model, ema = s["model"], s["tools"].ema

    def nbytes(tensors: Iterable[torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    params = nbytes(model.parameters())
    state = nbytes(v for st in s["opt"].state.values() for v in st.values() if isinstance(v, torch.Tensor))
    state += 0 if ema is None else nbytes(ema.shadow)
    grads = nbytes(trained_parameters(model))
    block = max(nbytes(p for m in unit_modules(model, b, FWD) for p in m.parameters()) for b in block_layers(s["spec"]))
    return {"static_bytes": params + state, "grad_bytes": grads, "block_param_bytes": block}


def memory_run(s: dict[str, Any], assignment: dict[str, str]) -> tuple[dict[str, Cost], int, int]:
    """One step under ``assignment``: per-unit bytes, the optimizer's peak, the step's peak."""
    s["model"].enable_gradient_checkpointing(policy_string(assignment))
    units = [u for u, _ in leaf_units(s["spec"], assignment)]
    # No list of the existing tensors is kept: it would keep last step's gradients alive through a
    # step whose first act is to free them (train_step's zero_grad).
    recorder = Recorder(existing(s))
    with s["mode"], hooks(s["model"], s["opt"], units, lambda unit, phase: recorder.enter((unit, phase))), recorder:
        s["step"]()
    return unit_costs(recorder.timeline(), units)


def timed_step(s: dict[str, Any], assignment: dict[str, str]) -> tuple[dict[str, tuple[float, float]], float]:
    """One step under ``assignment``: per unit, the seconds its forward and its backward (recompute
    included) take, from one unit hook to the next; and the step's seconds."""
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
    """Per assignment, medians over ``repeats`` rounds of `timed_step`, the assignments in turn
    within each round: a process's first steps run slower (its heap still grows: page faults), and
    timed one run after another that drift fell on the plain run, timed first, and made every
    recompute look cheaper than a later process measures it."""
    samples: list[list[tuple[dict[str, tuple[float, float]], float]]] = [[] for _ in assignments]
    for _ in tracked(range(repeats), "timing rounds", lambda r: f"{len(assignments)} steps"):
        for i, assignment in enumerate(assignments):
            samples[i].append(timed_step(s, assignment))
    out = []
    for runs in samples:
        per_unit = {u: [statistics.median(r[0][u][k] for r in runs) for k in (0, 1)] for u in runs[0][0]}
        out.append((per_unit, statistics.median(r[1] for r in runs)))
    return out


def profile(
    spec: StepSpec,
    batch_size: int,
    context_length: int = 77,
    shapes: bool = False,
    repeats: int = 1,
    regime: Regime = DEFAULT,
) -> dict:
    """The `shared_configs.planning.budget.Profile` fields of ``spec`` at ``batch_size`` trained in
    ``regime`` (``repeats=0``: bytes only; adamw8bit: see `Regime.profiled`)."""
    s = setup(spec, batch_size, context_length, shapes, regime.profiled)
    flops = unit_flops(spec, batch_size, context_length)
    units: dict[str, dict[str, Cost]] = {}
    runs: dict[str, Any] = {}
    opt_peak = 0
    assignments = [{} if choice == PLAIN else uniform(spec, choice, level) for choice, level in PROFILE_RUNS]
    named = tracked(zip(PROFILE_RUNS, assignments, strict=True), "memory runs", lambda run: " ".join(run[0]))
    measured = [memory_run(s, a) for _, a in named]  # each also warms its plan up
    for (choice, _), assignment, (costs, run_opt, peak) in zip(PROFILE_RUNS, assignments, measured, strict=True):
        runs[policy_string(assignment)] = {"peak_bytes": peak, "step_time_s": None}
        opt_peak = run_opt if choice == PLAIN else opt_peak
        for unit, cost in costs.items():
            mine = assignment.get(unit, PLAIN)
            if mine == choice:
                units.setdefault(unit, {})[mine] = replace(cost, flops=recompute_flops(flops[unit], mine))
    timing = not shapes and repeats > 0
    plain_flops = step_flops(spec, batch_size, context_length, regime.profiled)
    units, step_time, rates = priced(s, units, assignments, repeats, runs, plain_flops) if timing else (units, 0.0, {})
    return {
        "framework": "torch",
        "units": units,
        "opt_peak": opt_peak,
        **sharded_bytes(s),
        "step_time_s": step_time,
        "mode": "measured" if timing else "shapes",
        "meta": {
            "runs": runs,
            "method": "live tensor-storage bytes filed by unit (module hooks) in torch_impl.train.train_step; "
            "recompute seconds: FLOPs and bytes no longer kept at the rates fitted to the per-layer runs' "
            "measured extras (each layer's forward + backward CPU seconds, single thread, minus the plain "
            "step's), the runs timed in turn",
            "time_rates": rates,
            "versions": {"torch": torch.__version__},
            "regime": regime.describe(),
            # torch's CPU default (foreach runs on CUDA only): shared_configs.planning.optimizer_step
            "optimizer_step": optimizer_step.describe(regime.profiled.optimizer, "per-parameter"),
            **modelled_state(s, regime),
        },
    }


# The runs timed: the plain step and the per-layer plans, whose recomputed units are single layers
# (their seconds from unit hook to unit hook are the layer's own). Every (unit, choice), blocks
# included, is then priced at the rates those seconds give (`stepclock.fitted_rates`).
TIMED_LEVEL = "layers"


def priced(
    s: dict[str, Any], units: dict[str, dict[str, Cost]], assignments: list[dict[str, str]], repeats: int,
    runs: dict[str, Any], plain_flops: float,
) -> tuple[dict[str, dict[str, Cost]], float, dict[str, float]]:  # fmt: skip
    """``units`` with recompute seconds (``time_s``) at the rates fitted to `timing_runs` of the
    per-layer runs (``repeats`` rounds; each run's median step filed in ``runs``), the plain step's
    seconds and the rates; ``plain_flops``: the plain step's FLOPs, for when no extra is measured."""
    timed = [a for (_, level), a in zip(PROFILE_RUNS, assignments, strict=True) if level == TIMED_LEVEL]
    results = timing_runs(s, timed, repeats)
    plain_keep = plain_keeps(s["spec"], units)
    plain = {u: sum(t) for u, t in results[0][0].items()}  # the plain run is PROFILE_RUNS' first
    samples = []
    for assignment, (per_unit, seconds) in zip(timed, results, strict=True):
        runs[policy_string(assignment)]["step_time_s"] = seconds
        for unit, (fwd, bwd) in per_unit.items():
            choice = assignment.get(unit, PLAIN)
            if choice == PLAIN and not assignment:
                units[unit][PLAIN] = replace(units[unit][PLAIN], fwd_time_s=fwd)
            elif choice != PLAIN:  # the extra unclamped: the fit averages the noise out
                units[unit][choice] = replace(units[unit][choice], fwd_time_s=fwd)
                samples.append((*work(units[unit][choice], plain_keep[unit]), fwd + bwd - plain[unit]))
    step_time = results[0][1]
    per_flop, per_byte = fitted_rates(samples)
    if not per_flop and not per_byte:  # nothing measured above noise: FLOPs at the plain step's throughput
        per_flop = step_time / plain_flops
    return at_rates(s["spec"], units, per_flop, per_byte), step_time, {"per_flop_s": per_flop, "per_byte_s": per_byte}


def measure(
    spec: StepSpec,
    batch_size: int,
    policies: list[str],
    context_length: int = 77,
    steps: int = 3,
    race_to: dict[str, Any] | None = None,
    regime: Regime = DEFAULT,
) -> dict:
    """Per policy: the step's peak (the benchmark's `StepTracker`), its allocator-level peak
    (`allocator_peak`, the instrument torch.compile rows need), its step times (``rounds_s``, taken
    in turn) and their median; ``race_to``: raced (`shared_configs.planning.stepclock.measured_rounds`)."""
    s = setup(spec, batch_size, context_length, regime=regime)
    peaks = {}
    for policy in policies:
        s["model"].enable_gradient_checkpointing(policy)
        s["step"]()  # warm-up under this plan
        peaks[policy] = {"peak_bytes": tracked_peak(s), "allocator_peak_bytes": allocator_peak(s, s["step"])}

    def under(policy: str) -> Callable[[], None]:
        return lambda: (s["model"].enable_gradient_checkpointing(policy), s["step"]())

    rounds = measured_rounds({p: under(p) for p in policies}, {p: r["peak_bytes"] for p, r in peaks.items()}, steps,
                             race_to)  # fmt: skip
    rows = {p: peaks[p] | times(rounds[p]) for p in policies}
    return {"framework": "torch", "rows": rows, "method": "torch_impl.memory.StepTracker around train_step"}


def peaks(
    spec: StepSpec, batch_size: int, policies: list[str], context_length: int = 77, regime: Regime = DEFAULT
) -> dict:
    """Per policy, `tracked_peak` (what `measure` reports) of a step of fake tensors: nothing is
    allocated. Up to 0.04% under the real step's (64 KiB for every policy in float32, 160-400 KiB in
    bf16-mixed, on `small` 32x32 b4; tested on tiny: tests/test_plan_model.py)."""
    s = setup(spec, batch_size, context_length, shapes=True, regime=regime.profiled)
    delta = modelled_state(s, regime).get("modelled_state_bytes", 0)
    out = {}
    for policy in policies:
        s["model"].enable_gradient_checkpointing(policy)
        with s["mode"]:
            out[policy] = tracked_peak(s) + delta
    return {"peaks": out}


def modelled_state(s: dict[str, Any], regime: Regime) -> dict[str, Any]:
    """For a regime profiled in another (`Regime.profiled`): the state bytes it holds beyond it."""
    trained = trained_parameters(s["model"])
    if not trained or regime.profiled == regime:
        return {}
    delta = modelled_state_delta(regime, [p.numel() for p in trained], trained[0].element_size())
    return {"modelled_state_bytes": delta, "modelled": STATE_MODEL}


def tracked_peak(s: dict[str, Any]) -> int:
    """One step's peak as the benchmark measures it (`torch_impl.memory.StepTracker`, the
    numpy batch counted as input): the instrument the profile itself does not use."""
    ema = s["tools"].ema
    tracker = StepTracker(s["model"], s["opt"], batch_bytes(s["batch"]), [] if ema is None else ema.shadow)
    # Eager: compiled code (torchao's 8-bit AdamW step) cannot run under a tensor-tracking mode.
    with torch.compiler.set_stance("force_eager"), tracker:
        s["step"]()
    assert tracker.result is not None
    return tracker.result.peak


def allocator_peak(s: dict[str, Any], step: Callable[[], Any]) -> int:
    """The bytes alive before the step plus the CPU allocator's peak above them during it
    (`torch_impl.memory.AllocatorPeak`: kernel scratch included). Unlike a dispatch mode it
    leaves torch.compile on: dynamo runs a model eagerly while a `TorchDispatchMode` is active."""
    inputs = existing(s)
    base = storage_bytes(inputs)
    with AllocatorPeak() as allocator:
        step()
    return base + allocator.peak


def measure_compiled(
    spec: UNetSpec, batch_size: int, ratios: list[float], context_length: int = 77, steps: int = 3
) -> dict:
    """torch.compile's own planner: the model compiled with ``activation_memory_budget`` = each ratio
    (AOTAutograd's knapsack over the joint graph), trained by the same `train_step` and measured
    at the allocator level (`allocator_peak`: the tensor tracker would turn compilation off). Compile
    seconds are reported apart (on CPU: minutes per ratio)."""
    import torch._dynamo
    import torch._functorch.config as functorch_config

    rows = {}
    for ratio in ratios:
        torch._dynamo.reset()  # the budget is not part of dynamo's guards: force a fresh compile
        functorch_config.activation_memory_budget = ratio
        s = setup(spec, batch_size, context_length)
        compiled = torch.compile(s["model"])
        start = time.perf_counter()
        train_step(compiled, s["opt"], s["batch"])
        compile_s = time.perf_counter() - start
        step = functools.partial(train_step, compiled, s["opt"], s["batch"])
        step()
        peak = allocator_peak(s, step)
        rows[f"torch.compile:{ratio:g}"] = {
            "allocator_peak_bytes": peak,
            "step_time_s": round_robin({"compiled": step}, steps)["compiled"],
            "compile_s": compile_s,
        }
    functorch_config.activation_memory_budget = 1.0
    return {"framework": "torch", "rows": rows, "method": "torch.compile(model) + activation_memory_budget; "
            "allocator-level peak (torch.profiler memory events) around train_step"}  # fmt: skip


def encoders(request: dict[str, Any]) -> dict[str, Any]:
    """The models beside the U-Net, from shapes (`torch_impl.encoders`)."""
    from torch_impl.encoders import encoders as measured

    return measured(request)


if __name__ == "__main__":  # the planner's torch worker (shared_configs.planning.workers)
    single_threaded()
    sys.exit(serve(sys.modules[__name__], sys.argv[1:]))
