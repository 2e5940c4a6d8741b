"""The units of a training step a plan chooses for, and plans <-> per-unit assignments: a block (``down.1``) or,
inside a block not recomputed whole, a layer, each one of `CHOICES`; always-plain pseudo-units (stem, samplers,
head) make every byte belong to one unit. Docs: docs/planning.md "What it does".
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from shared_configs.arch import down_blocks, up_blocks
from shared_configs.pair import CONTROLNET, ControlNetPairSpec, PairPlan, split_pair_plan
from shared_configs.spec import UNetSpec
from shared_configs.vocabulary import CheckpointPlan, block_names, layer_names, resolve_plan

PLAIN, FULL = "plain", "full"
SELECTIVE_OPS: tuple[str, ...] = ("conv", "matmul")
SELECTIVE = "save=" + ",".join(SELECTIVE_OPS)
CHOICES: tuple[str, ...] = (PLAIN, FULL, SELECTIVE)
STEM, HEAD = "stem", "head"
Assignment = Mapping[str, str]  # unit name -> choice; units left out are plain
StepSpec = UNetSpec | ControlNetPairSpec  # what a step trains: one U-Net, or the ControlNet pair


def block_layers(spec: StepSpec) -> dict[str, tuple[str, ...]]:
    """Per block, its leaf units in forward order when it is not recomputed as a whole."""
    if isinstance(spec, ControlNetPairSpec):
        encoder = {b: layers for b, layers in block_layers(spec.unet).items() if not b.startswith("up.")}
        mine = {CONTROLNET + b: tuple(CONTROLNET + n for n in layers) for b, layers in encoder.items()}
        return mine | block_layers(spec.unet)
    layers = layer_names(spec)
    samplers = {b.name: (f"{b.name}.downsample",) for b in down_blocks(spec) if b.downsample_padding is not None}
    samplers |= {b.name: (f"{b.name}.upsample",) for b in up_blocks(spec) if b.upsample}
    return {b: (*(n for n in layers if n.startswith(b + ".")), *samplers.get(b, ())) for b in block_names(spec)}


def segments(spec: StepSpec) -> list[tuple[str, tuple[str, ...]]]:
    """The step in forward order: (block, its layers), and (pseudo-unit, (itself,)) for stem and head."""
    if not isinstance(spec, ControlNetPairSpec):
        return [(STEM, (STEM,)), *block_layers(spec).items(), (HEAD, (HEAD,))]
    mine = [(b, layers) for b, layers in block_layers(spec).items() if b.startswith(CONTROLNET)]
    stem, head = CONTROLNET + STEM, CONTROLNET + HEAD
    return [(stem, (stem,)), *mine, (head, (head,)), *segments(spec.unet)]  # the ControlNet's, then the U-Net's


def is_pseudo(unit: str) -> bool:
    """Units no plan can name (always plain): stem, head, samplers (the ControlNet's too)."""
    return unit.removeprefix(CONTROLNET) in (STEM, HEAD) or unit.endswith((".downsample", ".upsample"))


def leaf_units(spec: StepSpec, assignment: Assignment) -> Iterator[tuple[str, str]]:
    """(unit, choice) in forward order: a recomputed block is one unit, a plain one its layers."""
    for block, layers in segments(spec):
        choice = assignment.get(block, PLAIN)
        if choice != PLAIN:
            yield block, choice
        else:
            yield from ((name, assignment.get(name, PLAIN)) for name in layers)


def uniform(spec: StepSpec, choice: str, level: str) -> dict[str, str]:
    """Every block (``level="blocks"``) or every layer (``"layers"``) under ``choice``."""
    if level == "blocks":
        return dict.fromkeys(block_layers(spec), choice)
    return {n: choice for layers in block_layers(spec).values() for n in layers if not is_pseudo(n)}


def choice_of(save: tuple[str, ...]) -> str:
    return "save=" + ",".join(save) if save else FULL


def resolve_any(spec: StepSpec, policy: str | CheckpointPlan | PairPlan | None) -> CheckpointPlan | PairPlan:
    """``policy`` resolved over ``spec``'s units: `resolve_plan`, or for the pair `split_pair_plan` (None: none)."""
    if isinstance(spec, ControlNetPairSpec):
        return split_pair_plan(spec, policy)  # type: ignore[arg-type]
    return resolve_plan(spec, policy)  # type: ignore[arg-type]


def assignment_of(spec: StepSpec, policy: str | CheckpointPlan | PairPlan) -> dict[str, str]:
    """The assignment a policy (any form `resolve_plan`, or for the pair `split_pair_plan`, takes) stands for."""
    plan = resolve_any(spec, policy)
    return {name: choice_of(plan.save_for(name)) for name in plan.recompute}


def policy_string(assignment: Assignment) -> str:
    """The policy string of an assignment, as `resolve_plan` (or for the pair `split_pair_plan`) takes it."""
    groups: dict[str, list[str]] = {}
    for name, choice in assignment.items():
        if choice != PLAIN:
            groups.setdefault(choice, []).append(name)
    return ";".join(",".join(names) + ("" if c == FULL else "/" + c) for c, names in sorted(groups.items())) or "none"
