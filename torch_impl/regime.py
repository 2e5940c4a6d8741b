"""A training regime (`shared_configs.regime.Regime`) in PyTorch: precision, LoRA, optimizer, EMA.

`step_tools` gathers what `torch_impl.step.train_step` needs. Mirror: `jax_impl.regime`. Docs: docs/regimes.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shared_configs.regime import DEFAULT, LORA_TARGETS, Regime
from shared_configs.spec import SpecError
from torch_impl import compat

DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# diffusers' attention keeps its output projection in a list (``to_out.0``); ours is the Linear itself.
DIFFUSERS_LORA_TARGETS = tuple("to_out.0" if t == "to_out" else t for t in LORA_TARGETS)


def add_lora(model: nn.Module, rank: int, targets: Iterable[str] = LORA_TARGETS) -> nn.Module:
    """Rank-``rank`` peft LoRA adapters (alpha = rank, B zero: outputs unchanged) on ``targets``; the rest frozen."""
    from peft import LoraConfig, inject_adapter_in_model  # peft imports slowly: only when asked

    model = inject_adapter_in_model(
        LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets), init_lora_weights=True), model
    )
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    return model


def apply_regime(model: nn.Module, regime: Regime, targets: Iterable[str] = LORA_TARGETS) -> nn.Module:
    """``model`` in ``regime``: adapters added (lora), weights cast (bf16; *-frozen: the frozen ones). Returns it."""
    if regime.lora_rank is not None:
        model = add_lora(model, regime.lora_rank, targets)
    if regime.param_dtype != "float32":
        model = model.to(DTYPE[regime.param_dtype])
    for param in model.parameters():  # *-frozen: the frozen weights in half precision (diffusers' weight_dtype)
        param.data = param.data.to(weight_dtype(regime, param.requires_grad))
    return model


def weight_dtype(regime: Regime, trained: bool) -> torch.dtype:
    """The dtype ``regime`` keeps a trained or a frozen weight in."""
    return DTYPE[regime.param_dtype if trained else regime.frozen_dtype]


def trained_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters the optimizer updates (all of them, or the adapters under LoRA)."""
    return [p for p in model.parameters() if p.requires_grad]


def make_optimizer(model: nn.Module, lr: float, weight_decay: float, regime: Regime = DEFAULT) -> torch.optim.Optimizer:
    """``regime.optimizer`` over the trained parameters, every hyperparameter explicit (torch's AdamW
    weight_decay default, 0.01, differs from optax's)."""
    params = trained_parameters(model)
    if regime.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    if regime.optimizer == "adafactor":
        return torch.optim.Adafactor(params, lr=lr, weight_decay=weight_decay)
    try:
        from torchao.optim import AdamW8bit
    except ImportError:
        raise SpecError("optimizer: adamw8bit needs torchao (pip install torchao)") from None
    return AdamW8bit(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)


@dataclass(frozen=True)
class StepTools:
    """`torch_impl.step.train_step`'s regime pieces; the default: fp32, no EMA (a plain step)."""

    autocast_dtype: torch.dtype | None = None  # the forward under torch.autocast in this dtype (mixed precision)
    scaler: torch.amp.GradScaler | None = None  # float16: the loss scaled before the backward
    ema: EMA | None = None  # moved toward the trained parameters after each step
    keep_grads: bool = False  # zero_grad(set_to_none=False): the gradients stay allocated between steps

    def state(self) -> dict[str, Any]:
        """The pieces with a state to checkpoint beside the model's and optimizer's, by name."""
        return {k: v for k, v in (("scaler", self.scaler), ("ema", self.ema)) if v is not None}


PLAIN_STEP = StepTools()


def step_tools(model: nn.Module, regime: Regime, scaler: bool = True) -> StepTools:
    """The `StepTools` of ``regime`` for ``model``: autocast in a mixed regime (none in fp32 and pure bf16), a
    ``GradScaler`` for float16 compute, whose gradients underflow unscaled (``scaler=False``: none, for steps
    whose values cannot be read)."""
    return StepTools(
        autocast_dtype=DTYPE[regime.compute_dtype] if regime.autocast else None,
        scaler=torch.amp.GradScaler(next(model.parameters()).device.type) if scaler and regime.loss_scaling else None,
        ema=EMA(trained_parameters(model)) if regime.ema else None,
        keep_grads=regime.keep_grads,
    )


class EMA:
    """A float32 exponential moving average of ``params``, moved by each `update` (diffusers' EMAModel, no warm-up)."""

    def __init__(self, params: Iterable[nn.Parameter], decay: float = 0.9999) -> None:
        self.params = list(params)
        self.decay = decay
        self.shadow = [p.detach().float().clone() for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        compat.foreach_lerp_(self.shadow, [p.detach().float() for p in self.params], 1.0 - self.decay)

    def state_dict(self) -> dict[str, list[torch.Tensor]]:
        return {"shadow": self.shadow}

    def load_state_dict(self, state: dict[str, list[torch.Tensor]]) -> None:
        for mine, saved in zip(self.shadow, state["shadow"], strict=True):
            mine.copy_(saved)
