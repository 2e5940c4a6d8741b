"""What `torch_impl.BudgetGuard` reads from the model as a training script holds it, and from its step.

`step_spec`: the spec of our `UNet`, a diffusers U-Net (peft adapters or not) or a `ControlNetPair`;
`take_over_checkpointing` turns diffusers' own gradient checkpointing off (the guard's plan replaces
it); `regime_seen` reads the regime the parameters show (what is trained, in which dtypes) and
`RegimeWatch` the one the first optimizer step shows (autocast, the optimizer, kept gradients) and
`HeldWatch` what the script updates from the trained weights after it (an EMA); `gpu_flavour` the
planner's device for the model's. docs/guard.md has the rules.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import nn

from shared_configs.pair import ControlNetPairSpec
from shared_configs.planning.optimizer_step import SOURCES, implementation
from shared_configs.planning.pipeline import Workload
from shared_configs.regime import Regime
from shared_configs.spec import UNetSpec
from torch_impl.compat import TorchDispatchMode, innermost_mode, tree_leaves
from torch_impl.diffusers_adapter import diffusers_spec
from torch_impl.memory import local
from torch_impl.pair import ControlNetPair
from torch_impl.regime import DIFFUSERS_LORA_TARGETS
from torch_impl.unet import UNet

HALF = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# Optimizer classes by name -> the regime's optimizer (torchao's and bitsandbytes' 8-bit AdamW alike).
OPTIMIZERS = {"AdamW": "adamw", "Adam": "adamw", "Adafactor": "adafactor", "AdamW8bit": "adamw8bit"}


def step_spec(model: nn.Module) -> UNetSpec | ControlNetPairSpec:
    """What the planner plans for ``model``'s step (unwrapped): a U-Net's spec, or a ControlNet pair's."""
    if isinstance(model, ControlNetPair):
        return model.pair_spec
    return model.spec if isinstance(model, UNet) else diffusers_spec(model)


def gpu_flavour(device: torch.device) -> str:
    """The planner's device (`Workload.device`) for a model on ``device``: "cpu" off CUDA, else the GPU flavour,
    "cuda-sm90" from compute capability 9 on (torch's 32 MiB cuBLAS workspaces), "cuda" before it."""
    if device.type != "cuda":
        return "cpu"
    return "cuda-sm90" if torch.cuda.get_device_capability(device)[0] >= 9 else "cuda"


def take_over_checkpointing(model: nn.Module) -> list[str]:
    """Turn off diffusers' own gradient checkpointing in each network of ``model``; returns their class names. (Ours,
    a UNet or a ControlNet, has no checkpointing but its plan, and no ``is_gradient_checkpointing``.)"""
    nets = [model.unet, model.controlnet] if isinstance(model, ControlNetPair) else [model]
    taken = [net for net in nets if getattr(net, "is_gradient_checkpointing", False)]  # diffusers' ModelMixin's
    for net in taken:
        net.disable_gradient_checkpointing()
    return [type(net).__name__ for net in taken]


def lora_rank(model: nn.Module) -> int | None:
    """The rank of ``model``'s peft adapters (``peft_config``) if one adapter on the projections the planner adapts."""
    configs = list(getattr(model, "peft_config", {}).values())
    if len(configs) != 1:
        return None
    targets = {str(t) for t in (configs[0].target_modules or ())}
    return configs[0].r if targets == set(DIFFUSERS_LORA_TARGETS) else None


def regime_seen(model: nn.Module, autocast: torch.dtype | None = None) -> tuple[Regime, list[str]]:
    """The regime ``model``'s parameters show, with ``autocast`` (its dtype during the forward, None:
    off; before the first step the guard assumes autocast when the frozen weights are half, as
    diffusers' scripts run them), and the lines to say about what it cannot tell."""
    trained = [p for p in model.parameters() if p.requires_grad]
    if not trained:
        raise ValueError("model: no parameter requires a gradient; the guard plans a training step")
    frozen = [p for p in model.parameters() if not p.requires_grad]
    notes, rank = [], lora_rank(model)
    adapters = rank is not None and not isinstance(model, ControlNetPair)
    if not adapters and any("lora_" in n for n, p in model.named_parameters() if p.requires_grad):
        notes.append("LoRA adapters without one rank on to_q, to_k, to_v, to_out.0: planned as all weights trained")
    return Regime(
        precision=_precision(trained, frozen, autocast), trainable=f"lora:{rank}" if adapters else "all"
    ), notes


def _precision(trained: list[nn.Parameter], frozen: list[nn.Parameter], autocast: torch.dtype | None) -> str:
    if {p.dtype for p in trained} <= set(HALF):
        return "bf16"  # half trained weights: pure half precision, autocast or not
    half_frozen = {p.dtype for p in frozen} & set(HALF)
    if half_frozen:
        return f"{HALF[autocast or next(iter(half_frozen))]}-frozen"
    return f"{HALF[autocast]}-mixed" if autocast in HALF else "fp32"


class RegimeWatch:
    """What the first optimizer step shows: autocast at the model's forward, the optimizer, kept gradients.
    ``given``: the regime was given (kept, not replaced); ``impl_given``: so was the optimizer's update."""

    def __init__(self, model: nn.Module, given: bool = False, impl_given: bool = False) -> None:
        self.model, self.given, self.impl_given = model, given, impl_given
        self.autocast: torch.dtype | None = None
        self.forwarded = False
        self.ema = False  # an EMA seen after the first optimizer step (`HeldWatch`)
        # conv_in, the first layer of every U-Net and ControlNet: inside a forward that a wrapper
        # (accelerate's) runs under autocast; a pair's trained network, which the script calls
        trained = model.controlnet if isinstance(model, ControlNetPair) else model
        first = getattr(trained, "conv_in", trained)
        self._handle = first.register_forward_pre_hook(self._forward)

    def _forward(self, module: nn.Module, args: Any) -> None:
        device = next(self.model.parameters()).device.type
        self.forwarded = True
        self.autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        self._handle.remove()

    def seen(self, planned: Regime, optimizers: list[torch.optim.Optimizer]) -> tuple[Regime, list[str]]:
        """The regime the first optimizer step shows (an EMA where seen or planned), and the lines on what it cannot
        tell."""
        regime, notes = regime_seen(self.model, self.autocast)
        names = {type(o).__name__ for o in optimizers}
        known = {OPTIMIZERS[n] for n in names if n in OPTIMIZERS}
        optimizer = next(iter(known)) if len(known) == 1 else planned.optimizer
        if names and not known:
            notes.append(f"optimizer {', '.join(sorted(names))}: planned as {planned.optimizer}")
        trained = [p.grad for p in self.model.parameters() if p.requires_grad]
        kept = all(g is not None for g in trained) and not any(bool(g.any()) for g in trained)
        return replace(regime, optimizer=optimizer, ema=planned.ema or self.ema, keep_grads=kept), notes

    def workload(self, planned: Workload, optimizers: list[torch.optim.Optimizer]) -> tuple[Workload, list[str]]:
        """The workload the step shows after its first optimizer step (``planned`` until a forward is seen) and
        the lines to say: a guessed regime replaced, a given one kept (one line where the step differs); on a
        GPU also the update the optimizer runs (`update`), unless given."""
        if not self.forwarded:
            return planned, []
        seen, notes = self.seen(planned.regime, optimizers)
        if self.given:
            line = f"the step runs in {seen.describe()}, not in the regime given ({planned.regime.describe()})"
            seen, notes = planned.regime, [] if seen == planned.regime else [f"{line}; planned for the one given"]
        impl = planned.optimizer_impl
        if planned.device != "cpu" and not self.impl_given:  # on a GPU: the update as the optimizer says
            impl = self.update(optimizers, seen.optimizer)
        found = replace(planned, regime=seen, optimizer_impl=impl)
        return found, notes if self.given or found != planned else []

    @staticmethod
    def update(optimizers: list[torch.optim.Optimizer], optimizer: str) -> str | None:
        """How ``optimizers`` update on a GPU where they say so (`optimizer_step.SOURCES`): bitsandbytes' kernel,
        ``fused=True``, ``foreach`` given. None (torch's default) when they say nothing, disagree, name the default
        or an update ``optimizer`` does not run."""
        found = {_update_of(o) for o in optimizers}
        name = found.pop() if len(found) == 1 else None
        return name if (optimizer, name) in SOURCES and name != implementation(optimizer, "cuda") else None


class HeldWatch(TorchDispatchMode):
    """What a script updates from the trained weights between two guarded calls: the tensors an op reads beside a
    trained weight of their shape that existed before the watch (``found``, by storage): an EMA's shadow weights
    (diffusers' ``EMAModel.step``, foreach or not; this project's `torch_impl.regime.EMA`). A copy made while
    watched (``--offload_ema`` brings the shadow to the device for the update, then back) is not held. `end` also
    runs when the guard is collected: a loop that stops after its first optimizer step leaves no watch behind."""

    current: ClassVar[HeldWatch | None] = None  # the process's watch in force

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__()
        self.shapes = {p.untyped_storage().data_ptr(): p.shape for p in map(local, params)}  # FSDP2: the shards
        self.made: set[int] = set()
        self.found: dict[int, torch.Tensor] = {}
        self.ended = False

    def start(self) -> HeldWatch:
        """Watch from now on, ending the process's earlier watch first: modes nest, and only the innermost can leave
        the stack, so a second guard's watch entered over a first one would leave the first there for good."""
        if HeldWatch.current is not None:
            HeldWatch.current.end()
        HeldWatch.current = self
        return self.__enter__()

    def end(self) -> dict[int, torch.Tensor]:
        """Stop watching; leave the mode stack where this is innermost (else a mode entered since would be left).
        Returns ``found``."""
        self.ended = True
        if HeldWatch.current is self:
            HeldWatch.current = None
        if innermost_mode() is self:
            self.__exit__(None, None, None)
        return self.found

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.ended:
            return func(*args, **(kwargs or {}))
        if any(t not in (torch.Tensor, nn.Parameter) for t in types):  # FSDP2's DTensor: its local ops are watched
            return NotImplemented
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        shapes = {self.shapes.get(t.untyped_storage().data_ptr()) for t in tensors}
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if t.shape in shapes and key not in self.shapes and key not in self.made:
                self.found[key] = t
        out = func(*args, **(kwargs or {}))
        self.made.update(t.untyped_storage().data_ptr() for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def described(workload: Workload) -> str:
    """The regime planned for, with the update where one is named."""
    return workload.regime.describe() + (f" ({workload.optimizer_impl} update)" if workload.optimizer_impl else "")


def _update_of(opt: torch.optim.Optimizer) -> str | None:
    if type(opt).__module__.partition(".")[0] == "bitsandbytes":
        return "bitsandbytes"
    if opt.defaults.get("fused"):
        return "fused"
    foreach = opt.defaults.get("foreach")
    return None if foreach is None else "foreach" if foreach else "per-parameter"
