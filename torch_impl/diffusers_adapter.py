"""A checkpoint plan on diffusers' own U-Net or ControlNet, from the outside: diffusers is not edited.

``apply_plan(model, plan)`` reads a live diffusers model's spec from its config and checkpoints
exactly the plan's units with `torch_impl.checkpointing` (``down.1`` is ``down_blocks.1``, ``mid`` is
``mid_block``); ``remove_plan`` undoes it. Docs: docs/diffusers.md.
"""

from __future__ import annotations

from torch import nn

from shared_configs import CheckpointPlan, UNetSpec, all_names, from_diffusers_config, resolve_plan
from shared_configs.controlnet import ControlNetSpec, controlnet_names, resolve_controlnet_plan
from shared_configs.diffusers.controlnet_config import controlnet_from_diffusers_config
from shared_configs.diffusers.folders import live_config
from shared_configs.vocabulary import Policy
from torch_impl import checkpointing
from torch_impl.unet import UNetTrunk

UNET_CLASSES: tuple[str, ...] = ("UNet2DModel", "UNet2DConditionModel")
DIFFUSERS_CLASSES: tuple[str, ...] = (*UNET_CLASSES, "ControlNetModel")
# The plan's block lists -> diffusers' attribute names (the rest of a name is the same path).
_BLOCKS = {"down": "down_blocks", "mid": "mid_block", "up": "up_blocks"}
# diffusers' classes -> our spec of their config
_SPEC_OF = dict.fromkeys(UNET_CLASSES, from_diffusers_config) | {"ControlNetModel": controlnet_from_diffusers_config}


def diffusers_path(name: str) -> str:
    """The diffusers module path of a plan unit: ``down.1.resnets.0`` -> ``down_blocks.1.resnets.0``."""
    head, dot, rest = name.partition(".")
    return _BLOCKS[head] + dot + rest


def diffusers_spec(
    model: nn.Module, classes: tuple[str, ...] = UNET_CLASSES, field: str = "model: expected", ours: str = ""
) -> UNetSpec | ControlNetSpec:
    """The spec of a live diffusers model of one of ``classes`` (`SpecError` naming the option we cannot plan
    for); another class is a `TypeError` naming ``field`` and the classes taken (``ours``: our own too)."""
    cls = type(model).__name__
    if cls not in classes:
        raise TypeError(f"{field} diffusers' {' or '.join(classes)}{ours}, not {cls}")
    return _SPEC_OF[cls](live_config(model))


def unit_modules(model: nn.Module, spec: UNetSpec | ControlNetSpec) -> dict[str, nn.Module]:
    """Every name a plan for ``spec`` can use -> the diffusers module it checkpoints."""
    modules: dict[str, nn.Module] = {}
    names = (
        controlnet_names(spec) + controlnet_names(spec, True) if isinstance(spec, ControlNetSpec) else all_names(spec)
    )
    for name in names:
        path = diffusers_path(name)
        try:
            modules[name] = model.get_submodule(path)
        except AttributeError:
            raise ValueError(f"plan: unit {name!r} has no module {path!r} in this {type(model).__name__}") from None
    return modules


def apply_plan(
    model: nn.Module, plan: Policy | CheckpointPlan = "full", preserve_rng_state: bool = True
) -> CheckpointPlan:
    """Recompute exactly ``plan``'s units of ``model`` (diffusers' or ours) in the backward pass, replacing
    any plan applied; returns the resolved plan. diffusers' own checkpointing on is refused in one line."""
    if isinstance(model, UNetTrunk):  # ours: a UNet or a ControlNet
        return model.enable_gradient_checkpointing(plan, preserve_rng_state)
    spec = diffusers_spec(
        model, DIFFUSERS_CLASSES, "model: apply_plan takes", ", a torch_impl.UNet or torch_impl.ControlNet"
    )
    if any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        raise ValueError(
            "gradient_checkpointing: diffusers' own checkpointing is on, and a plan would recompute the "
            "same layers twice; call model.disable_gradient_checkpointing() first"
        )
    resolved = resolve_controlnet_plan(spec, plan) if isinstance(spec, ControlNetSpec) else resolve_plan(spec, plan)
    checkpointing.apply_plan(model, resolved, preserve_rng_state, modules=unit_modules(model, spec))
    return resolved


def remove_plan(model: nn.Module) -> None:
    """Undo `apply_plan`: every unit runs its plain forward again."""
    if isinstance(model, UNetTrunk):
        model.disable_gradient_checkpointing()
    else:
        checkpointing.remove_plan(model)
