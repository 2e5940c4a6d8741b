"""What `torch_impl.BudgetGuard` plans for: the trained model as a training script holds it.

`step_spec` reads the spec of our `UNet`, a diffusers U-Net (peft adapters or not) or a
`ControlNetPair` (wrappers taken off by `torch_impl.wrappers.unwrap`); `take_over_checkpointing`
turns diffusers' own gradient checkpointing off so that the guard's plan replaces it; `lora_rank`
reads the rank of peft adapters. docs/guard.md has the rules.
"""

from __future__ import annotations

from torch import nn

from shared_configs.pair import ControlNetPairSpec
from shared_configs.spec import UNetSpec
from torch_impl.controlnet import ControlNet
from torch_impl.diffusers_plan import diffusers_spec
from torch_impl.pair import ControlNetPair
from torch_impl.regime import DIFFUSERS_LORA_TARGETS
from torch_impl.unet import UNet


def step_spec(model: nn.Module) -> UNetSpec | ControlNetPairSpec:
    """What the planner plans for ``model``'s step (unwrapped): a U-Net's spec, or a ControlNet pair's."""
    if isinstance(model, ControlNetPair):
        return model.pair_spec
    return model.spec if isinstance(model, UNet) else diffusers_spec(model)


def networks(model: nn.Module) -> list[nn.Module]:
    """The networks a plan goes on: a pair's two, else the model."""
    return [model.unet, model.controlnet] if isinstance(model, ControlNetPair) else [model]


def take_over_checkpointing(model: nn.Module) -> list[str]:
    """Turn off diffusers' own gradient checkpointing (``enable_gradient_checkpointing()``) in each
    network of ``model`` that has it on; returns their class names (the guard says one line)."""
    taken = []
    for net in networks(model):
        ours = isinstance(net, UNet | ControlNet)  # ours has no checkpointing but its plan
        if ours or not any(getattr(m, "gradient_checkpointing", False) for m in net.modules()):
            continue
        net.disable_gradient_checkpointing()
        taken.append(type(net).__name__)
    return taken


def lora_rank(model: nn.Module) -> int | None:
    """The rank of the peft adapters ``model`` trains (diffusers' ``add_adapter``: ``peft_config``),
    if they are one adapter on the projections the planner adapts."""
    configs = list(getattr(model, "peft_config", {}).values())
    if len(configs) != 1:
        return None
    targets = {str(t) for t in (configs[0].target_modules or ())}
    return configs[0].r if targets == set(DIFFUSERS_LORA_TARGETS) else None
