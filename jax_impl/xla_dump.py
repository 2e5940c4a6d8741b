"""XLA's own memory plan of a compiled step, filed by U-Net unit: the planner's view of the dump.

`jax_impl.memory` parses the dump (``xla_dump_to``); this module files every position of the schedule
under the plan unit whose Flax module its ``op_name`` names (``jvp(UNet)/down_1/resnets_0/conv1/...``).
Every value with a live range is one buffer (`jax_impl.memory.Dump.buffers`): the planner's live-byte
peak, which `Profile.scale` relates to the compiled ``memory_analysis()`` total.
"""

from __future__ import annotations

import re

from jax_impl.memory import Dump

_OWN = r"controlnet_cond_embedding|controlnet_down_blocks_\d+|controlnet_mid_block"  # a ControlNet's own modules
_MODULE = re.compile(
    r"(down|up)_\d+|mid|resnets_\d+|attentions_\d+|downsample|upsample|conv_in|time_embedding|"
    r"conv_norm_out|conv_out|" + _OWN
)
_TOP = re.compile(r"(down|up)_\d+|mid|conv_in|time_embedding|conv_norm_out|conv_out|" + _OWN)
GLUE = {
    "conv_in": "stem",
    "time_embedding": "stem",
    "conv_norm_out": "head",
    "conv_out": "head",
    "controlnet_cond_embedding": "stem",
    "controlnet_mid_block": "head",
}
# The ControlNet step's two networks: the ControlNet's units carry this prefix (`shared_configs.pair`).
_NETWORK = re.compile(r"controlnet|unet")


def unit_of(op_name: str, units: set[str]) -> str | None:
    """The unit of ``units`` whose module the op belongs to, if any: the module path runs from the last
    top-level name on (``.../up_0/checkpoint/rematted_computation/resnets_1/conv1`` -> up.0.resnets.1)."""
    segs = op_name.split("/")
    networks = [seg for seg in segs if _NETWORK.fullmatch(seg)]
    prefix = "controlnet." if networks and networks[-1] == "controlnet" else ""
    mods = [seg for seg in segs if _MODULE.fullmatch(seg)]
    tops = [i for i, seg in enumerate(mods) if _TOP.fullmatch(seg)]
    if not tops:
        return None
    path = mods[tops[-1] :]
    top = "head" if path[0].startswith("controlnet_down_blocks_") else GLUE.get(path[0])
    if top is not None:
        return prefix + top
    block = prefix + path[0].replace("_", ".")
    if len(path) > 1 and (inner := f"{block}.{path[1].replace('_', '.')}") in units:
        return inner
    return block if block in units else None


def backward_start(dump: Dump) -> int:
    """The position of the loss's cotangent (``transpose(jvp())``), where the backward proper starts: XLA
    hoists some backward-only work into the forward, so the first ``transpose(...)`` op can come earlier."""
    names = [dump.hlo.op_names.get(n, "") for n in dump.sequence]
    first = next((i for i, op in enumerate(names) if "transpose(jvp())" in op), None)
    return first if first is not None else next((i for i, op in enumerate(names) if "transpose(" in op), len(names))


def segments(dump: Dump, units: set[str], first: str = "stem") -> list[tuple[str, str]]:
    """(unit, phase) of each schedule position: the unit its ``op_name`` names (positions outside any
    unit carry the last one, ``first`` before any); the phase by position, before or after `backward_start`."""
    split = backward_start(dump)
    current = first
    out = []
    for i, name in enumerate(dump.sequence):
        unit = unit_of(dump.hlo.op_names.get(name, ""), units)
        if unit is not None:
            current = unit
        elif i == split:
            current = "head"  # the loss's gradient: the backward starts at the head
        out.append((current, "fwd" if i < split else "bwd"))
    return out
