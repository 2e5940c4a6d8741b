"""Tensor-level memory accounting for PyTorch, used where no allocator statistics exist (CPU).

* `LiveBytesTracker`: the peak of live tensor-storage bytes while it is active. Every aten op
  result passes through a `TorchDispatchMode`; each new storage is counted once (views share
  it) and uncounted by a weakref callback when the last tensor using it dies. Storages that
  exist before (parameters, optimizer state, the batch) are registered up front, so the peak
  is that of the whole process's tensors, as ``torch.cuda.max_memory_allocated`` is on GPU.
* `AllocatorPeak`: an independent count one level lower, from the CPU allocator's own events
  (``torch.profiler`` with ``profile_memory=True``): it also sees kernels' private scratch space
  (im2col buffers of convolutions, attention workspaces), which no tensor-level view can.
* `SavedBytesCounter`: the bytes autograd keeps for backward, seen through
  ``torch.autograd.graph.saved_tensors_hooks`` (distinct storages, parameters excluded), plus the
  outputs a selective (op-level) plan keeps (``MUST_SAVE``, which the checkpoint's own hooks hide).
  Inside a non-reentrant checkpoint region the checkpoint's own hooks take over, so what is
  counted there is what the checkpoint keeps: its inputs.

The tracker and the counter see tensors only: neither kernel scratch space nor allocator rounding.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from torch_impl.checkpointing import record_saved


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class LiveBytesTracker(TorchDispatchMode):
    """Peak of live tensor bytes while active. ``with LiveBytesTracker(existing) as tr: ...``."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._sizes: dict[int, int] = {}  # id(storage) -> bytes
        self._refs: dict[int, weakref.ref] = {}  # keeps the callbacks alive
        self.current = 0
        self.peak = 0
        self.baseline = 0
        for t in existing:
            self._track(t)
        self.baseline = self.peak = self.current

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        st = t.untyped_storage()
        key = id(st)
        if key in self._sizes and self._refs[key]() is st:
            return
        size = st.nbytes()
        self._sizes[key] = size
        self._refs[key] = weakref.ref(st, lambda _ref, key=key: self._release(key))
        self.current += size
        self.peak = max(self.peak, self.current)

    def _release(self, key: int) -> None:
        self.current -= self._sizes.pop(key, 0)
        self._refs.pop(key, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        return out


class AllocatorPeak:
    """Peak of the bytes the CPU allocator hands out while active, above its level at entry."""

    def __init__(self) -> None:
        self.peak = 0
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)

    def __enter__(self) -> AllocatorPeak:
        self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._prof.__exit__(*exc)
        events = [e for e in self._prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        current = 0
        for event in sorted(events, key=lambda e: e.start_ns()):
            current += event.nbytes()
            self.peak = max(self.peak, current)


class SavedBytesCounter(torch.autograd.graph.saved_tensors_hooks):
    """Distinct storage bytes saved for backward while active, ``exclude`` (parameters) left out."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._saved: dict[int, int] = {}
        self._policy_bytes = 0  # outputs kept by selective plans (largest of the entered steps)
        self._recording: Any = None
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self._excluded and t.device.type != "meta":
            self._saved[ptr] = max(self._saved.get(ptr, 0), st.nbytes())
        return t

    @property
    def bytes(self) -> int:
        return sum(self._saved.values()) + self._policy_bytes

    def __enter__(self) -> SavedBytesCounter:
        super().__enter__()
        self._recording = record_saved()
        self._records = self._recording.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._recording.__exit__(*exc)
        kept = sum(o.numel() * o.element_size() for r in self._records if not r.recompute for o in r.outputs)
        self._policy_bytes = max(self._policy_bytes, kept)
        super().__exit__(*exc)
