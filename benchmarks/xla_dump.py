"""XLA's own memory plan of a compiled step, read from its dump files, filed by U-Net unit.

Compiling with ``xla_dump_to=DIR`` (and ``xla_dump_hlo_as_text``) makes XLA write, for the
optimised module: the schedule and every buffer's live range over it (``*-live-range.txt``),
each buffer's size (``*-buffer-assignment.txt``) and the instructions with their metadata
(``*cpu_after_optimizations.txt``), whose ``op_name`` carries the Flax module path
(``jvp(UNet)/down_1/resnets_0/conv1/...``; ``transpose(...)`` in the backward;
``rematted_computation`` in a recompute). This module turns them into live bytes at each
position of the schedule and the unit and phase each position belongs to. Plain text parsing:
no jax import (the tests run it on saved dumps).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_VALUE = re.compile(r"^ value: <\d+ (\S+?)(\{[\d,]*\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=\d+\)", re.M)
_SEQUENCE = re.compile(r"^    (\d+):(\S+)$", re.M)
_RANGE = re.compile(r"^    (\S+?\{[\d,]*\}):(\d+)-(\d+)$", re.M)
_PARAMETER = re.compile(r"^\s*%(\S+) = \S+ parameter\(", re.M)
OP_NAME = re.compile(r"^\s*(?:ROOT )?%(\S+) = .*?op_name=\"([^\"]*)\"", re.M)
_MODULE = re.compile(r"(down|up)_\d+|mid|resnets_\d+|attentions_\d+|downsample|upsample|conv_in|time_embedding|"
                     r"conv_norm_out|conv_out")  # fmt: skip
_TOP = re.compile(r"(down|up)_\d+|mid|conv_in|time_embedding|conv_norm_out|conv_out")
GLUE = {"conv_in": "stem", "time_embedding": "stem", "conv_norm_out": "head", "conv_out": "head"}


@dataclass(frozen=True)
class Buffer:
    name: str  # the defining instruction
    start: int  # schedule positions, inclusive
    end: int
    size: int


@dataclass(frozen=True)
class MemoryPlan:
    """The schedule (instruction names), each buffer, each instruction's ``op_name``, the parameters."""

    sequence: list[str]
    buffers: list[Buffer]
    op_names: dict[str, str]
    parameters: frozenset[str]

    def levels(self) -> list[int]:
        """Live bytes at each schedule position (every buffer alive there, parameters included).

        Live ranges may end one past the last instruction (the outputs): clipped to it.
        """
        last = len(self.sequence) - 1
        delta = [0] * (last + 2)
        for b in self.buffers:
            delta[min(b.start, last)] += b.size
            delta[min(b.end, last) + 1] -= b.size
        out, level = [], 0
        for d in delta[:-1]:
            level += d
            out.append(level)
        return out


def _one(folder: Path, suffix: str) -> str:
    found = sorted(folder.glob(f"*jit_train_step*{suffix}"))
    if not found:
        raise FileNotFoundError(f"no XLA dump *{suffix} in {folder}")
    return found[-1].read_text()


def read(folder: str | Path) -> MemoryPlan:
    """Parse the dump XLA wrote into ``folder`` for the compiled training step."""
    folder = Path(folder)
    assignment = _one(folder, "cpu_after_optimizations-buffer-assignment.txt")
    live = _one(folder, "cpu_after_optimizations-live-range.txt")
    hlo = _one(folder, "cpu_after_optimizations.txt")
    sizes = {m[1] + (m[2] or "{}"): int(m[3]) for m in _VALUE.finditer(assignment)}
    head, _, tail = live.partition("BufferLiveRange:")
    sequence = [name for _, name in sorted((int(i), n) for i, n in _SEQUENCE.findall(head))]
    tail = tail.split("Live ranges at")[0]
    buffers = [
        Buffer(name.split("{")[0], int(s), int(e), sizes[name]) for name, s, e in _RANGE.findall(tail) if name in sizes
    ]
    return MemoryPlan(sequence, buffers, dict(OP_NAME.findall(hlo)), frozenset(_PARAMETER.findall(hlo)))


def phase_of(op_name: str) -> str | None:
    """``fwd``, ``bwd`` (recompute included) or None (optimizer, constants: not the U-Net's)."""
    if "transpose(" in op_name:
        return "bwd"
    return "fwd" if "jvp(" in op_name else None


def unit_of(op_name: str, units: set[str]) -> str | None:
    """The unit (one of ``units``, plan names) whose module the op belongs to, if any.

    The module path is the run of module names from the last top-level one on
    (``.../up_0/jvp(UNet)/up_0/checkpoint/rematted_computation/resnets_1/conv1`` -> up.0, resnets.1).
    """
    mods = [seg for seg in re.split(r"[/]", op_name) if _MODULE.fullmatch(seg)]
    tops = [i for i, seg in enumerate(mods) if _TOP.fullmatch(seg)]
    if not tops:
        return None
    path = mods[tops[-1] :]
    if path[0] in GLUE:
        return GLUE[path[0]]
    block = path[0].replace("_", ".")
    if len(path) > 1:
        inner = f"{block}.{path[1].replace('_', '.')}"
        if inner in units:
            return inner
    return block if block in units else None


def backward_start(plan: MemoryPlan) -> int:
    """The position of the loss's cotangent (``transpose(jvp())``, the loss outside the U-Net): the
    backward proper starts there. XLA hoists some backward-only work (weight layouts, broadcasts)
    into the forward, so the first ``transpose(...)`` op can come much earlier."""
    names = [plan.op_names.get(n, "") for n in plan.sequence]
    first = next((i for i, op in enumerate(names) if "transpose(jvp())" in op), None)
    return first if first is not None else next((i for i, op in enumerate(names) if "transpose(" in op), len(names))


def segments(plan: MemoryPlan, units: set[str]) -> list[tuple[str, str]]:
    """(unit, phase) of each schedule position: the unit its ``op_name`` names (positions outside any
    unit carry the last one); the phase by position, before or after `backward_start`."""
    split = backward_start(plan)
    current = "stem"
    out = []
    for i, name in enumerate(plan.sequence):
        unit = unit_of(plan.op_names.get(name, ""), units)
        if unit is not None:
            current = unit
        elif i == split:
            current = "head"  # the loss's gradient: the backward starts at the head
        out.append((current, "fwd" if i < split else "bwd"))
    return out
