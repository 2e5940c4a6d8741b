"""The training regime: the precision, what is trained, the optimizer, an EMA copy, kept gradients.

A plan is only right for the regime it was profiled in, so the regime is one value, spelled the same
on every CLI (`add_regime_arguments`), carried by the training loops, the benchmark and the planner,
and part of every profile's cache key. Each value, and what it means in each framework:
docs/regimes.md "The regime, the same four flags everywhere". No torch or jax import.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

from shared_configs.spec import SpecError

PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16", "bf16-frozen", "fp16-frozen")
OPTIMIZERS = ("adamw", "adafactor", "adamw8bit")
# The attention projections LoRA adapts, by the module names both U-Nets use (diffusers' ``to_out``
# is a list whose first entry is the projection: ``to_out.0`` there).
LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out")
_LORA = re.compile(r"lora:([1-9][0-9]*)")
TRAINABLE = "all or lora:R (R a positive rank, e.g. lora:8)"
# The dtype each precision computes in (None: float32, no casts) and keeps the weights in.
COMPUTE_DTYPE = {
    "fp32": None,
    "bf16-mixed": "bfloat16",
    "fp16-mixed": "float16",
    "bf16": "bfloat16",
    "bf16-frozen": "bfloat16",
    "fp16-frozen": "float16",
}
PARAM_DTYPE = {
    "fp32": "float32",
    "bf16-mixed": "float32",
    "fp16-mixed": "float32",
    "bf16": "bfloat16",
    "bf16-frozen": "float32",
    "fp16-frozen": "float32",
}


@dataclass(frozen=True)
class Regime:
    """How a step trains: `PRECISIONS`, ``trainable`` ("all" or "lora:R"), `OPTIMIZERS`, ``ema``,
    ``keep_grads`` (gradients kept allocated between steps, zeroed in place)."""

    precision: str = "fp32"
    trainable: str = "all"
    optimizer: str = "adamw"
    ema: bool = False
    keep_grads: bool = False

    def __post_init__(self) -> None:
        for name, allowed in (("precision", PRECISIONS), ("optimizer", OPTIMIZERS)):
            if getattr(self, name) not in allowed:
                raise SpecError(f"{name}: expected one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        if self.trainable != "all" and not _LORA.fullmatch(str(self.trainable)):
            raise SpecError(f"trainable: expected {TRAINABLE}, got {self.trainable!r}")
        for name in ("ema", "keep_grads"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(f"{name}: expected true or false, got {getattr(self, name)!r}")

    @property
    def lora_rank(self) -> int | None:
        """The adapters' rank, or None when every weight is trained."""
        match = _LORA.fullmatch(self.trainable)
        return int(match.group(1)) if match else None

    @property
    def compute_dtype(self) -> str | None:
        """The forward's dtype name ("bfloat16", "float16"), or None for float32 without casts."""
        return COMPUTE_DTYPE[self.precision]

    @property
    def param_dtype(self) -> str:
        """The dtype the weights, gradients and optimizer state are kept in."""
        return PARAM_DTYPE[self.precision]

    @property
    def frozen_dtype(self) -> str:
        """The dtype the frozen weights are kept in (the ``*-frozen`` precisions' half one)."""
        return self.compute_dtype if self.precision.endswith("-frozen") else self.param_dtype

    @property
    def autocast(self) -> bool:
        """The forward runs under autocast (float32 weights, or float32 trained ones, beside half compute)."""
        return self.precision.endswith(("-mixed", "-frozen"))

    @property
    def loss_scaling(self) -> bool:
        """float16's narrow exponent: the loss is scaled up before the backward, gradients down."""
        return self.precision in ("fp16-mixed", "fp16-frozen")

    def describe(self) -> str:
        """One line: ``fp32, all weights trained, adamw`` / ``bf16-mixed, lora:8, adafactor, EMA, grads kept``."""
        trained = "all weights trained" if self.lora_rank is None else self.trainable
        extras = (["EMA"] if self.ema else []) + (["grads kept"] if self.keep_grads else [])
        return ", ".join([self.precision, trained, self.optimizer, *extras])

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def profiled(self) -> Regime:
        """The regime a planner's step runs in: adamw8bit's is AdamW's, its state bytes modelled
        (`state_bytes`): torchao's compiled 8-bit step runs under no tensor-tracking mode, and JAX
        has no 8-bit AdamW at all."""
        return replace(self, optimizer="adamw") if self.optimizer == "adamw8bit" else self


# Why JAX refuses ``keep_grads`` (the planner here; the compare command before its workers start).
JAX_KEEPS_NO_GRADS = (
    "a jitted JAX step's gradients are temporaries of the step (its state donated), none live "
    "between steps to keep; use --framework torch"
)


def check_planned(regime: Regime, framework: str, device: str = "cpu") -> None:
    """Refuse, in one line (and in the planner before any worker starts), a regime ``framework``
    cannot run on ``device``."""
    if framework != "jax":
        return
    if regime.keep_grads:
        raise SpecError(f"keep_grads: {JAX_KEEPS_NO_GRADS}")
    if regime.precision.endswith("-frozen"):
        raise SpecError(
            f"precision: {regime.precision} (half frozen weights, float32 trained ones under autocast) "
            "is planned in torch only; use bf16-mixed, or --framework torch"
        )
    if regime.precision == "fp16-mixed" and device == "cpu":
        raise SpecError(
            "precision: fp16-mixed has no XLA:CPU matmul (dot_general F16_F16_F32 is not supported on "
            "CPU); use bf16-mixed, or --framework torch"
        )


# torchao's AdamW8bit (and bitsandbytes'): a tensor of at least this many values, a whole number of
# blocks, keeps each moment as uint8 codes with a float32 scale per block and a 256-entry float32
# code map; smaller tensors keep them in the parameter's dtype.
QUANTIZED_MIN, BLOCK, QMAP_BYTES = 4096, 256, 256 * 4
STATE_MODEL = "adamw8bit state modelled from torchao's layout (the step profiled with AdamW)"


def state_bytes(optimizer: str, numels: list[int], itemsize: int) -> int:
    """AdamW's or AdamW8bit's moment bytes for trained tensors of ``numels`` values of ``itemsize``."""
    if optimizer == "adamw":
        return 2 * itemsize * sum(numels)
    if optimizer != "adamw8bit":
        raise ValueError(f"optimizer: state bytes are modelled for adamw and adamw8bit, not {optimizer!r}")

    def moment(n: int) -> int:
        quantized = n >= QUANTIZED_MIN and n % BLOCK == 0
        return n + 4 * (n // BLOCK) + QMAP_BYTES if quantized else itemsize * n

    return 2 * sum(moment(n) for n in numels)


def modelled_state_delta(regime: Regime, numels: list[int], itemsize: int) -> int:
    """Bytes ``regime``'s optimizer state holds beyond those of the regime it was profiled in."""
    if regime.profiled == regime:
        return 0
    return state_bytes(regime.optimizer, numels, itemsize) - state_bytes(regime.profiled.optimizer, numels, itemsize)


DEFAULT = Regime()


def add_regime_arguments(parser: argparse.ArgumentParser) -> None:
    """The regime flags, the same on every CLI (their defaults: `DEFAULT`)."""
    group = parser.add_argument_group("training regime")
    group.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=DEFAULT.precision,
        help="fp32; bf16-mixed / fp16-mixed: float32 master weights, half-precision compute (fp16 with loss "
        "scaling); bf16: bfloat16 weights and state; bf16-frozen / fp16-frozen: half frozen weights, float32 "
        "trained ones, autocast (torch) (default %(default)s)",
    )
    group.add_argument(
        "--trainable",
        type=_trainable,
        default=DEFAULT.trainable,
        metavar="{all,lora:R}",
        help="all weights, or rank-R LoRA adapters on every attention's q/k/v/out (default all)",
    )
    group.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=DEFAULT.optimizer,
        help="adamw; adafactor (factored second moments); adamw8bit (torchao) (default %(default)s)",
    )
    group.add_argument("--ema", action="store_true", help="keep an EMA copy (float32) of the trained weights")
    group.add_argument(
        "--keep-grads",
        action="store_true",
        help="gradients stay allocated between steps, zeroed in place (zero_grad(set_to_none=False), diffusers' "
        "DreamBooth/ControlNet default); torch only",
    )


def _trainable(text: str) -> str:
    if text != "all" and not _LORA.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected {TRAINABLE}, got {text!r}")
    return text
