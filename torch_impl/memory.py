"""The one PyTorch memory instrument on CPU, and its cross-checks (mirror: `jax_impl.memory`; docs/benchmark.md).

`StepTracker`: every tensor storage a step makes or frees (a dispatch mode, frees by weakref): the
peak, its parts by kind and block, or the planner's per-unit `Timeline` (one step under it:
`torch_impl.profile.measure_step`); `step_peak`: the peak alone, for the guard and the training loop.
`memtracker` (PyTorch's ``MemTracker``), `allocator_peak` (kernel scratch included), `saved_for_backward`
(bytes saved for backward): checks and side views.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from shared_configs.memory import CATEGORIES, OUTSIDE, block_of, timeline
from shared_configs.planning.timeline import FWD, Timeline
from shared_configs.planning.units import STEM
from torch_impl import compat
from torch_impl.checkpointing import record_saved
from torch_impl.compat import TorchDispatchMode, _EventType, is_traceable_wrapper_subclass, tree_leaves

TRACKER_METHOD = (
    "live tensor storages over the step (TorchDispatchMode), kinds as MemTracker's: made in the forward or a "
    "recompute = activations, in the backward/optimizer = temporaries unless left as .grad or optimizer state"
)
FSDP_METHOD = (
    "; under FSDP2 this rank's only: DTensors by their local shards, all-gathered parameters as params while "
    "gathered (storage resizes watched), collective buffers as temporaries"
)
# Ops whose outputs are communication buffers (FSDP2's all-gather copy-in, c10d collectives).
_COMM_NAMESPACES = ("fsdp", "c10d", "_c10d_functional")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local shard; DTensor told by name, as ``torch.distributed.tensor``'s
    import is long)."""
    return t.to_local() if type(t).__name__ == "DTensor" else t


def plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors holding ``t``'s memory: this rank's shard of a DTensor; the inner tensors of a
    tensor subclass (torchao's 8-bit optimizer state: codes, scales, code map); else ``t``."""
    t = local(t)
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [inner for name in names for inner in plain(getattr(t, name))]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    storages = (part.untyped_storage() for t in tensors for part in plain(t))
    return sum({st.data_ptr(): st.nbytes() for st in storages}.values())


def state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state tensors (as `plain` gives them)."""
    return [x for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) for x in plain(v)]


@dataclass
class StepMemory:
    """What `StepTracker` saw: the peak, its parts (adding up to it) and the timeline record."""

    peak: int
    baseline: int  # live bytes when the step began
    breakdown: dict[str, int]
    timeline: dict[str, Any] = field(repr=False)


class StepTracker(TorchDispatchMode):
    """``with StepTracker(model, optimizer) as tracker: step()``; then ``tracker.result``.

    The starting level: parameters, buffers, gradients, the optimizer(s)' state, ``held`` (an EMA,
    counted as ``optimizer``) and ``inputs`` (the batch). ``reads``: storages an op reads that no step
    made (a frozen VAE's weights) join it. ``detail``: kinds by phase and block (ModTracker); without
    it every storage made is an activation. `mark` files what follows under a unit. The step runs
    eagerly (a compiled step's ops would not pass through a dispatch mode).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
        held: Iterable[torch.Tensor] = (),
        inputs: Iterable[torch.Tensor] = (),
        *,
        reads: bool = False,
        detail: bool = True,
    ) -> None:
        super().__init__()
        self._model, self._optimizers, self._held, self._inputs = model, _listed(optimizer), list(held), list(inputs)
        self._reads, self._detail = reads, detail
        self._sizes: list[int] = []  # per storage ever seen
        self._kinds: list[str] = []
        # id(storage) -> (index into _sizes, the weakref whose callback files its free) while the step runs
        self._live: dict[int, tuple[int, weakref.ref]] = {}
        self._events: list[tuple[int, int, str]] = []  # (storage index, +1 made / -1 freed, block)
        self._static: list[bool] = []  # per storage: of the starting level
        self._entry_ptrs: set[int] = set()  # their addresses: a numpy array's fresh tensor is no new memory
        self._marks: list[tuple[int, str, str]] = [(0, STEM, FWD)]  # (event index, unit, phase)
        self._baseline = dict.fromkeys(CATEGORIES, 0)
        self._mods = compat.mod_tracker() if detail else None  # (torch.distributed._tools' import is long)
        # The blocks by module; those running, innermost or latest reached last (ModTracker's own
        # `parents` is unordered, and in the backward holds several blocks at once).
        self._block_modules = {m: n for n, m in model.named_modules() if n and block_of(n) == n} if detail else {}
        self._running: list[str] = []
        self._last = OUTSIDE  # the block entered last
        self._in_optimizer = False
        self._recompute_depth = 0
        self._phases: dict[str, int] = {}
        self.result: StepMemory  # set at exit

    # -- bookkeeping ---------------------------------------------------------------------------

    def _add(self, t: torch.Tensor, kind: str, at_entry: bool = False, read: bool = False) -> None:
        for part in plain(t):
            st = part.untyped_storage()
            # ``read`` by an op: not at an address of the starting level either (a numpy array's fresh tensor)
            if part.device.type != "meta" and not (read and st.data_ptr() in self._entry_ptrs):
                self._add_storage(st, kind, at_entry)

    def _state(self) -> list[torch.Tensor]:
        return [x for opt in self._optimizers for x in state_tensors(opt)]

    def _known(self, st: torch.UntypedStorage) -> bool:
        entry = self._live.get(id(st))
        return entry is not None and entry[1]() is st

    def _add_storage(self, st: torch.UntypedStorage, kind: str, at_entry: bool = False) -> None:
        if self._known(st):
            return
        key, index = id(st), len(self._sizes)
        self._sizes.append(st.nbytes())
        self._kinds.append(kind)
        self._static.append(at_entry)
        self._live[key] = (index, weakref.ref(st, functools.partial(self._freed, key, index)))
        if at_entry:
            self._baseline[kind] += st.nbytes()
            if self._reads:  # (a fake tensor has no address)
                self._entry_ptrs.add(st.data_ptr())
        else:
            self._events.append((index, 1, self._block()))

    def _read(self, args: Any) -> None:
        """Storages read that neither the step nor the starting level holds: alive before the step."""
        for t in tree_leaves(args):
            if isinstance(t, torch.Tensor) and type(t).__name__ != "DTensor":
                self._add(t, "params", at_entry=True, read=True)

    def _resized(self, resize: Callable[[Any, int], None], st: torch.UntypedStorage, size: int) -> None:
        """FSDP2 gathers a parameter by growing a storage and frees it by shrinking it to 0: the old
        size is freed, the new one made (as ``params``)."""
        if self._known(st):
            index, _ = self._live.pop(id(st))  # its free callback goes with its weakref: this is the free
            self._events.append((index, -1, self._block()))
        resize(st, size)
        if size > 0:
            self._add_storage(st, "params")

    def _freed(self, key: int, index: int, ref: weakref.ref) -> None:
        if self._live.get(key, (None, None))[1] is ref:
            del self._live[key]
        self._events.append((index, -1, self._block()))

    def _block(self) -> str:
        # The block entered last, while it runs: once it is left, what follows (the backward's tail:
        # conv_in's and the time embedding's gradients) is outside every block.
        return self._last if self._last in self._running else OUTSIDE

    def _phase(self) -> str:
        running = "optimizer" if self._in_optimizer else "backward" if self._mods.is_bw else None
        if running is not None:  # the first event of each phase is filed
            self._phases.setdefault(running, len(self._events))
            return running
        return "backward" if "backward" in self._phases else "forward"

    def mark(self, unit: str, phase: str) -> None:
        """What follows runs in ``unit``'s ``phase`` (fwd, bwd, opt)."""
        self._marks.append((len(self._events), unit, phase))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(kind.__name__ == "DTensor" for kind in types):  # DTensor runs its local ops, seen here (FSDP2's shards)
            return NotImplemented
        if self._reads:
            self._read(args)
        out = func(*args, **(kwargs or {}))
        kind = "activation"
        if self._detail:
            phase = self._phase()
            recomputing = phase == "backward" and self._recompute_depth > 0
            if (phase != "forward" and not recomputing) or func.namespace in _COMM_NAMESPACES:
                kind = "temporary"
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t, kind)
        return out

    # -- entry and exit ------------------------------------------------------------------------

    def __enter__(self) -> StepTracker:
        for kind, tensors in (
            ("params", [*self._model.parameters(), *self._model.buffers()]),
            ("grads", [p.grad for p in self._model.parameters() if p.grad is not None]),
            ("optimizer", [*self._state(), *self._held]),
            ("input", self._inputs),
        ):
            for t in tensors:
                self._add(t, kind, at_entry=True)
        self._patches = contextlib.ExitStack()  # undone at exit, in reverse
        if self._detail:
            # before and after a module's forward, then its backward
            self._mods.register_user_hooks(
                *(functools.partial(self._hook, f, e) for f in (True, False) for e in (True, False))
            )
            self._patches.callback(self._mods.clear_user_hooks)
            for hook in (
                register_optimizer_step_pre_hook(lambda *a: setattr(self, "_in_optimizer", True)),
                register_optimizer_step_post_hook(lambda *a: setattr(self, "_in_optimizer", False)),
            ):
                self._patches.callback(hook.remove)
            self._patches.enter_context(compat.multi_grad_hooks_any())
            self._patches.enter_context(self._mods)
        self._patches.enter_context(compat.resizes_to(self._resized))
        self._patches.enter_context(torch.compiler.set_stance("force_eager"))
        return super().__enter__()

    def _hook(self, forward: bool, entering: bool, module: Any, *args: Any) -> None:
        """ModTracker's user hook where a module's forward (``forward``) or backward is entered or left: a forward
        inside the backward is a checkpointed block recomputed; else a block's entry and exit are filed."""
        if forward and self._mods.is_bw:
            self._recompute_depth += 1 if entering else -1
        elif module in self._block_modules:
            name = self._block_modules[module]
            if entering:
                self._last = name
                self._running.append(name)
            elif name in self._running:
                self._running.remove(name)

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._patches.__exit__(*exc)
        # What the step leaves behind decides the kind: its gradients and (new) optimizer state.
        for kind, tensors in (("grads", [p.grad for p in self._model.parameters()]), ("optimizer", self._state())):
            for t in tensors:
                entry = None if t is None else self._live.get(id(local(t).untyped_storage()))
                if entry is not None:
                    self._kinds[entry[0]] = kind
        self._live.clear()  # no free is filed after the step: the weakrefs go, and their callbacks with them
        self.result = self._summary()

    def _summary(self) -> StepMemory:
        delta = np.zeros((len(CATEGORIES), len(self._events)), dtype=np.int64)
        for i, (index, sign, _) in enumerate(self._events):
            delta[CATEGORIES.index(self._kinds[index]), i] = sign * self._sizes[index]
        base = np.array([self._baseline[c] for c in CATEGORIES], dtype=np.int64)[:, None]
        live = base + np.cumsum(delta, axis=1)
        if live.shape[1] == 0:
            live = base
        top = int(np.argmax(live.sum(axis=0)))
        series = {c: live[i] for i, c in enumerate(CATEGORIES)}
        blocks = [b for _, _, b in self._events] or [OUTSIDE]
        return StepMemory(
            peak=int(live[:, top].sum()),
            baseline=int(base.sum()),
            breakdown={c: int(live[i, top]) for i, c in enumerate(CATEGORIES)},
            timeline=timeline(series, blocks, self._phases, TRACKER_METHOD) if self._detail else {},
        )

    def unit_timeline(self) -> Timeline:
        """The step as the planner's `Timeline`: a position per storage made and per `mark`; the
        starting level static."""
        positions: list[tuple[str, str]] = []  # (unit, phase)
        starts = np.zeros(len(self._sizes), np.int64)
        ends = np.full(len(self._sizes), -1, np.int64)
        until = [at for at, _, _ in self._marks[1:]] + [len(self._events)]
        for (at, unit, phase), end in zip(self._marks, until, strict=True):  # the events up to the next mark
            positions.append((unit, phase))
            for index, sign, _ in self._events[at:end]:
                if sign > 0:  # a new position: the level after this allocation
                    positions.append((unit, phase))
                    starts[index] = len(positions) - 1
                else:
                    ends[index] = len(positions) - 1
        units, phases = map(list, zip(*positions, strict=True))
        sizes = np.array(self._sizes, np.int64)
        return Timeline(
            units, phases, starts, np.where(ends < 0, len(units) - 1, ends), sizes, np.array(self._static, bool)
        )


@contextlib.contextmanager
def step_peak(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    inputs: Iterable[torch.Tensor] = (),
    held: Iterable[torch.Tensor] = (),
) -> Iterator[dict[str, int]]:
    """The peak bytes of the step run in the block (``found["peak"]`` at exit): on CUDA the allocator's
    (``found["reserved"]`` too); on CPU `StepTracker`'s, every storage the step reads counted (frozen
    encoders), ``inputs`` standing for the batch, ``held`` for what the device holds beside the step (an
    EMA)."""
    found: dict[str, int] = {}
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        yield found
        found.update(peak=torch.cuda.max_memory_allocated(device), reserved=torch.cuda.max_memory_reserved(device))
        return
    with StepTracker(model, optimizer, held, inputs, reads=True, detail=False) as tracker:
        yield found
    found["peak"] = tracker.result.peak


@contextlib.contextmanager
def memtracker(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
    inputs: Iterable[torch.Tensor | torch.nn.Module] = (),
) -> Iterator[dict[str, Any]]:
    """The block under PyTorch's own ``MemTracker`` (the check on `StepTracker`): the dict it yields
    gets ``peak`` and ``parts`` (kinds at the peak) at exit. ``inputs``: tensors standing for memory
    torch does not allocate, and other modules the step runs (frozen encoders), as `step_peak`'s."""
    inputs = list(inputs)
    modules = [model, *(m for m in inputs if isinstance(m, torch.nn.Module))]
    tracker = compat.mem_tracker(p for m in modules for p in m.parameters() if not p.requires_grad)
    tracker.track_external(model, *_listed(optimizer), *inputs)
    found: dict[str, Any] = {}
    with compat.multi_grad_hooks_any(), tracker:
        yield found
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    parts = {str(getattr(k, "value", k)): int(v) for k, v in snapshot.items()}
    found.update(peak=parts.pop("Total", 0), parts=parts)


def _listed(optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)


@contextlib.contextmanager
def allocator_peak() -> Iterator[dict[str, int]]:
    """Peak of the bytes the CPU allocator hands out in the block, above its level at entry (``found["peak"]`` at
    exit). Frees count only for blocks allocated in the block: an older block's size may be an earlier run's."""
    found = {"peak": 0}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        yield found
    live: dict[int, int] = {}  # address -> bytes, of the blocks allocated in the block
    current = 0
    for _, ptr, size in sorted(_allocation_events(prof.profiler.kineto_results.experimental_event_tree())):
        if size > 0:
            live[ptr] = size
            current += size
        elif ptr in live:
            current -= live.pop(ptr)
        found["peak"] = max(found["peak"], current)


def _allocation_events(events: Iterable[Any]) -> Iterator[tuple[int, int, int]]:
    """(time, address, signed bytes) of every allocator event in a profiler event tree."""
    for event in events:
        if event.tag == _EventType.Allocation:
            yield event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size
        yield from _allocation_events(event.children)


@contextlib.contextmanager
def saved_for_backward(exclude: Iterable[torch.Tensor] = ()) -> Iterator[dict[str, int]]:
    """Distinct storage bytes saved for backward in the block (``found["bytes"]`` at exit), ``exclude``
    (parameters) left out, and the outputs selective plans keep (`record_saved`)."""
    excluded = {local(t).untyped_storage().data_ptr() for t in exclude}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        # A parameter FSDP2 gathered for the block (or a view of one) is a parameter, not a residual.
        gathered = isinstance(t, torch.nn.Parameter) or isinstance(compat.view_base(t), torch.nn.Parameter)
        if ptr not in excluded and not gathered and t.device.type != "meta":
            saved[ptr] = max(saved.get(ptr, 0), st.nbytes())
        return t

    found: dict[str, int] = {}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), record_saved() as records:
        yield found
    kept = sum(o.numel() * o.element_size() for r in records if not r.recompute for o in r.outputs)
    found["bytes"] = sum(saved.values()) + kept
