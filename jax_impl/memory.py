"""XLA's own memory plan for a compiled JAX step: its peak split into kinds, and the timeline.

From ``xla_dump_to``'s schedule, live ranges, buffer assignment and optimized HLO (whose ``op_name``
names the Flax module): the live bytes at every position by kind, adding up to ``memory_analysis()``'s
total (`compiled_peak`). Mirror: `torch_impl.memory` (live tensors). Docs: docs/benchmark.md.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from shared_configs.files import atomic_write
from shared_configs.memory import CATEGORIES, block_of, timeline

# Buffer assignment precedes code generation: memory figures are the same at -O0, and sooner; also
# for init_state (a random-number kernel per parameter, run once: optimising them takes longer).
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
DUMP = {"xla_dump_hlo_as_text": True, "xla_dump_hlo_module_re": "jit_train_step"}
METHOD = (
    "XLA's buffer assignment and live ranges (xla_dump_to) of the compiled step: arguments fixed, the temp "
    "allocation's buffers by the op that made them (forward/recompute = activations, backward = gradients if the "
    "optimizer reads them, else temporaries); temp-heap fragmentation counted as temporaries"
)
_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*):$")
# " value: <31837 while.177{1} (phi) @0> (size=4096,offset=1016832): f32[...]"
_VALUE = re.compile(r"^ value: <\d+ ([^ {>]+)(\{[\d,]*\})?(?: \([^)]*\))? @[^>]*> \(size=(\d+),offset=(\d+)\)")
_RANGE = re.compile(r"^    ([^ {]+)(\{[\d,]*\}):(\d+)-(\d+)$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_OPERAND = re.compile(r"%([\w.\-]+)")
_STATED_PEAK = re.compile(r"Stack trace breakdown for peak usage: ([\d ]+) bytes")
_STATED_AT = re.compile(r"Live ranges at (\d+) \(peak\)")
_OPCODE = re.compile(r"^([\w-]+)\(")
# An allocation's attributes -> its kind (`_Allocation`), the first that matches.
_KINDS = (("preallocated-temp", "temp"), ("parameter", "parameter"), ("maybe-live-out", "output"))


@dataclass
class MemoryPlan:
    """The peak (memory_analysis's total), its parts by kind (adding up to it) and the timeline."""

    peak: int
    parts: dict[str, int]
    fragmentation: int  # temp-allocation bytes never live at the peak position (inside ``temporary``)
    # The check: the bytes of live values at the position XLA's live-range dump names as its peak,
    # rebuilt here from the dump's values, sizes and ranges, and as XLA states them.
    live_peak: int
    xla_live_peak: int
    timeline: dict[str, Any] = field(repr=False)


def compiled_peak(compiled: Any) -> int:
    """XLA's peak of a compiled step: arguments + outputs - aliased (donated) + temporaries."""
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def compile_with_plan(
    lowered: Any, cache_dir: str | None, options: dict[str, Any] | None = None
) -> tuple[Any, MemoryPlan, float]:
    """Compile ``lowered``, dumping XLA's plan -> (compiled, plan, compile seconds); the plan from ``cache_dir``
    when this step's was stored there."""
    options = {**(options or {}), **DUMP}
    key = _key(lowered, options)
    plan = _read(cache_dir, key)
    with tempfile.TemporaryDirectory(prefix="xla-dump-") as folder:
        t0 = time.perf_counter()
        compiled = lowered.compile(compiler_options={"xla_dump_to": folder, **options})
        seconds = time.perf_counter() - t0
        dump = Path(folder)
        if plan is None and not _stems(dump):  # loaded from the persistent cache: compile it again
            dump = dump / "again"  # new options: not JAX's in-memory cache either
            compiled = compile_uncached(lowered, {"xla_dump_to": str(dump), **options})
        if plan is None:
            plan = _parse(dump, compiled_peak(compiled))
            _write(cache_dir, key, plan)
    return compiled, plan, seconds


def compile_uncached(lowered: Any, options: dict[str, Any]) -> Any:
    """Compile ``lowered`` past JAX's persistent cache (a cache hit dumps nothing)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        return lowered.compile(compiler_options=options)
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


def _key(lowered: Any, options: dict[str, Any]) -> str:
    import jax  # the worker's: this module is imported only there

    parts = [lowered.as_text(), repr(sorted(options.items())), os.environ.get("XLA_FLAGS", ""), jax.__version__]
    return hashlib.sha256("\n".join([*parts, jax.default_backend()]).encode()).hexdigest()[:32]


def _read(cache_dir: str | None, key: str) -> MemoryPlan | None:
    """The plan cached under ``key``; None (compile again) when there is none or it cannot be read."""
    path = None if cache_dir is None else Path(cache_dir) / "xla-memory" / f"{key}.json"
    if path is None or not path.is_file():
        return None
    try:
        return MemoryPlan(**json.loads(path.read_bytes()))
    except (OSError, ValueError, TypeError) as err:
        print(f"note: {path}: unreadable cache entry ({type(err).__name__}); compiling again", file=sys.stderr)
        return None


def _write(cache_dir: str | None, key: str, plan: MemoryPlan) -> None:
    if cache_dir is not None:  # atomic: processes filling the same entry each write a whole one
        atomic_write(Path(cache_dir) / "xla-memory" / f"{key}.json", json.dumps(asdict(plan)).encode())


@dataclass
class Dump:
    """The dump files of one compiled ``jit_train_step``, parsed (`jax_impl.xla_dump` files them by unit)."""

    sequence: list[str]  # XLA's schedule: instruction names in order
    ranges: dict[tuple[str, str], tuple[int, int]]  # (instruction, shape index) -> [start, end] position
    allocations: list[_Allocation]
    hlo: _Hlo
    live_range_text: str

    def buffers(self) -> list[tuple[str, int, int, int]]:
        """(instruction, start, end, size) of every value with a live range, as XLA counts live bytes."""
        return [
            (name, *self.ranges[(name, index)], size)
            for allocation in self.allocations
            for name, index, _, size in allocation.values
            if (name, index) in self.ranges
        ]


def read_dump(folder: str | Path) -> Dump:
    """Parse the dump XLA wrote into ``folder`` for the compiled training step."""
    folder = Path(folder)
    stems = _stems(folder)
    if not stems:
        raise RuntimeError(f"XLA wrote no live-range dump for jit_train_step in {folder}")
    stem = stems[-1]
    live_range = (folder / f"{stem}-live-range.txt").read_text()
    sequence, ranges = _live_ranges(live_range)
    allocations = _allocations((folder / f"{stem}-buffer-assignment.txt").read_text())
    return Dump(sequence, ranges, allocations, _Hlo((folder / f"{stem}.txt").read_text()), live_range)


def _parse(folder: Path, total: int) -> MemoryPlan:
    """The plan from one dump of a step peaking at ``total``."""
    dump = read_dump(folder)
    sequence, hlo = dump.sequence, dump.hlo
    series, live = _live_bytes(dump, len(sequence))
    top = int(np.argmax(sum(series.values())))
    parts = {c: int(series[c][top]) for c in CATEGORIES}
    fragmentation = total - sum(parts.values())  # the temp allocation's bytes free at the peak position
    parts["temporary"] += fragmentation
    # The picture's positions: XLA's schedule without the arguments and constants it lists first.
    ops = [i for i, name in enumerate(sequence) if hlo.opcodes.get(name) not in ("parameter", "constant")]
    names = [hlo.op_names.get(sequence[i], "") for i in ops]
    picture = {c: series[c][ops] for c in CATEGORIES}
    record = timeline(picture, [block_of(n) for n in names], _phases(names), METHOD)
    at, stated = _stated_peak(dump.live_range_text)
    return MemoryPlan(total, parts, fragmentation, int(live[at]), stated, record)


def _stated_peak(text: str) -> tuple[int, int]:
    """(position, bytes): XLA's own peak of live values, from the live-range dump's last sections (it
    counts an operand and the update written in place over it twice; the parts count them once)."""
    position = _STATED_AT.search(text)
    size = _STATED_PEAK.search(text)
    return (int(position[1]) if position else 0), (int(size[1].replace(" ", "")) if size else 0)


def _stems(folder: Path) -> list[str]:
    found = sorted(folder.glob("*jit_train_step*after_optimizations-live-range.txt"))
    return [f.name.removesuffix("-live-range.txt") for f in found]


def _live_ranges(text: str) -> tuple[list[str], dict[tuple[str, str], tuple[int, int]]]:
    """XLA's schedule (instruction names in order) and each value's [start, end] position."""
    head, _, rest = text.partition("  BufferLiveRange:\n")
    sequence = [line.split(":", 1)[1] for line in head.splitlines()[2:] if ":" in line]
    # up to the "Live ranges at N (peak)" section
    matches = itertools.takewhile(bool, map(_RANGE.match, rest.splitlines()))
    return sequence, {(m[1], m[2]): (int(m[3]), int(m[4])) for m in matches}


@dataclass
class _Allocation:
    kind: str  # "parameter" (an argument's buffer, maybe reused), "output", "temp"
    size: int
    values: list[tuple[str, str, int, int]]  # (instruction, shape index, offset, size)


def _allocations(text: str) -> list[_Allocation]:
    """The allocations memory_analysis() counts (arguments, outputs, the temp heap), with their values."""
    out: list[_Allocation] = []
    current: _Allocation | None = None
    for line in text.splitlines():
        header = _ALLOCATION.match(line)
        if header is not None:
            kind = next((name for marker, name in _KINDS if marker in header[3]), None)
            current = None if kind is None else _Allocation(kind, int(header[2]), [])  # constants, thread-local
            if current is not None:
                out.append(current)
        elif current is not None and (match := _VALUE.match(line)) is not None:
            current.values.append((match[1], match[2] or "{}", int(match[4]), int(match[3])))
    return out


class _Hlo:
    """The optimized module's instructions: op_name, opcode, operands and users of each."""

    def __init__(self, text: str) -> None:
        self.op_names: dict[str, str] = {}
        self.opcodes: dict[str, str] = {}
        self.operands: dict[str, list[str]] = {}
        self.users: dict[str, list[str]] = defaultdict(list)
        for match in filter(None, map(_INSTRUCTION.match, text.splitlines())):
            name, rest = match[1], match[2]
            op = _OP_NAME.search(rest)
            self.op_names[name] = op[1] if op else ""
            body = rest.split(", metadata=", 1)[0]
            # The opcode follows the type; a tuple-typed instruction (a while loop's state) is given none.
            call = None if body.startswith("(") else _OPCODE.match(body.split(" ", 1)[-1])
            self.opcodes[name] = call[1] if call else ""
            self.operands[name] = _OPERAND.findall(body)
            for operand in self.operands[name]:
                self.users[operand].append(name)
        self._kinds: dict[str, str] = {}

    def kind(self, name: str) -> str:
        """The kind of the buffer ``name`` makes (see the module docstring)."""
        if name not in self._kinds:
            self._kinds[name] = "temporary"  # a guard against cycles (while-loop parameters)
            self._kinds[name] = self._kind(name)
        return self._kinds[name]

    def _kind(self, name: str) -> str:
        op = self.op_names.get(name, "")
        if self.opcodes.get(name) == "parameter" and op.startswith("state."):
            return "optimizer" if op.startswith("state.opt_state") else "params"  # params, batch_stats
        if self.opcodes.get(name) == "parameter" and op:
            return "input"  # the batch and the dropout key
        if not op.startswith("jit("):  # copies, bitcasts, tuples XLA added: their operand's kind
            operands = self.operands.get(name)
            return self.kind(operands[0]) if operands else "temporary"
        stage = _stage(op)
        if stage == "backward" and any(_stage(self.op_names.get(u, "")) == "optimizer" for u in self.users[name]):
            return "grads"
        return {"forward": "activation", "backward": "temporary", "optimizer": "temporary"}[stage]


def _stage(op_name: str) -> str:
    """forward (recomputation included) / backward / optimizer, from an instruction's op_name."""
    if "transpose(" in op_name:
        return "forward" if "rematted_computation" in op_name else "backward"
    return "forward" if "jvp(" in op_name else "optimizer"


def _live_bytes(dump: Dump, positions: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Bytes held per kind at every schedule position, and the bytes of live values alone (as XLA counts).
    An argument's (or output's) allocation is held all step; the temp allocation counts what is live;
    values sharing one slot while live (an alias, an update in place) count once, as the one that made it."""
    delta = {c: np.zeros(positions + 1, dtype=np.int64) for c in CATEGORIES}
    live = np.zeros(positions + 1, dtype=np.int64)
    for _, start, end, size in dump.buffers():
        live[start] += size
        live[min(end, positions - 1) + 1] -= size
    for allocation in dump.allocations:
        owner = _owner(allocation, dump.hlo)
        if allocation.kind != "temp":
            delta[owner][0] += allocation.size
        for size, start, end, kind in _spans(allocation, dump.ranges, dump.hlo, owner, positions):
            delta[kind][start] += size
            delta[kind][end + 1] -= size
            if allocation.kind != "temp":  # the value occupies its argument's buffer meanwhile
                delta[owner][start] -= size
                delta[owner][end + 1] += size
    return {c: np.cumsum(d)[:positions] for c, d in delta.items()}, np.cumsum(live)[:positions]


def _spans(
    allocation: _Allocation, ranges: dict[tuple[str, str], tuple[int, int]], hlo: _Hlo, owner: str, positions: int
) -> list[tuple[int, int, int, str]]:
    """(size, start, end, kind) of each buffer in ``allocation``: values merged per slot."""
    slots: dict[tuple[int, int], list[tuple[int, int, str]]] = defaultdict(list)
    for name, index, offset, size in allocation.values:
        if (name, index) not in ranges:
            continue
        start, end = ranges[(name, index)]
        end = min(end, positions - 1)
        # The step's results (new parameters, optimizer state) are written into their argument's buffer.
        kind = owner if allocation.kind != "temp" and end == positions - 1 else hlo.kind(name)
        slots[(offset, size)].append((start, end, kind))
    return [(size, *span) for (_, size), spans in slots.items() for span in _merge(spans)]


def _owner(allocation: _Allocation, hlo: _Hlo) -> str:
    """What an argument's (or output's) allocation holds when no value is live in it."""
    for name, _, _, _ in allocation.values:
        if allocation.kind == "parameter" and hlo.opcodes.get(name) == "parameter":
            return hlo.kind(name)
    return "temporary"  # an output of its own: the loss


def _merge(spans: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Overlapping (or touching) spans as one, keeping the earliest one's kind."""
    merged: list[tuple[int, int, str]] = []
    for start, end, kind in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end), merged[-1][2])
        else:
            merged.append((start, end, kind))
    return merged


def _phases(op_names: list[str]) -> dict[str, int]:
    """Where the backward starts, and where the last of it ends (XLA applies some updates early)."""
    backward = [i for i, op in enumerate(op_names) if "transpose(" in op]
    return {"backward": backward[0], "optimizer": backward[-1] + 1} if backward else {}
