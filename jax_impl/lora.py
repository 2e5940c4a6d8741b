"""LoRA adapters for the Flax U-Net's attention projections (peft's ``lora.Linear``, mirrored)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name

Array = jax.Array

LORA_A, LORA_B = "lora_A", "lora_B"  # the adapters' module names (peft's, less ``.default``)
LORA_LEAVES = (LORA_A, LORA_B)


class LoRADense(nn.Module):
    """``x @ kernel + bias + (x @ lora_A) @ lora_B``, as peft's ``lora.Linear`` with ``lora_alpha`` = rank; the
    base weights keep the plain Dense's names, ``lora_B`` starts at zero. Output tagged ``"matmul"``."""

    features: int
    rank: int
    use_bias: bool = True

    @nn.compact
    def __call__(self, x: Array) -> Array:
        y = jnp.matmul(x, self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features)))
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros_init(), (self.features,))
        # peft's init: A as torch's Linear default (uniform, bound 1/sqrt(fan_in)), B zero
        a_init = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")
        low = nn.Dense(self.rank, use_bias=False, kernel_init=a_init, name=LORA_A)(x)
        y = y + nn.Dense(self.features, use_bias=False, kernel_init=nn.initializers.zeros_init(), name=LORA_B)(low)
        return checkpoint_name(y, "matmul")
