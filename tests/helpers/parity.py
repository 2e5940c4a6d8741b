"""The torch <-> Flax parity pair: a randomised torch variant, its Flax twin, their inputs and outputs."""

from __future__ import annotations

import zlib

import jax
import numpy as np
import torch

from jax_impl import UNet as FlaxUNet
from jax_impl.convert import torch_to_flax
from shared_configs import UNetSpec
from shared_configs.inputs import example_inputs
from tests.helpers.specs import variant
from tests.helpers.tensors import as_flax, as_torch, randomize_
from torch_impl import UNet as TorchUNet


def parity_pair(name: str) -> tuple[TorchUNet, FlaxUNet, dict]:
    """A randomised torch model of variant ``name``, its Flax twin and the converted parameters."""
    spec = variant(name, dropout=0.0)
    torch.manual_seed(0)
    tmodel = TorchUNet(spec).eval()
    randomize_(tmodel, seed=zlib.crc32(name.encode()) % 1000)  # stable across processes
    return tmodel, FlaxUNet(spec=spec), torch_to_flax(tmodel.state_dict(), spec)


def parity_inputs(spec: UNetSpec, batch: int = 2) -> dict[str, np.ndarray | None]:
    """Every forward input of ``spec`` (NCHW numpy), at one early and one late timestep."""
    inputs = example_inputs(spec, np.random.default_rng(7), batch, context_len=3)
    inputs["t"] = np.array([11.0, 860.0], dtype=np.float32)[:batch]  # one early, one late timestep
    return inputs


def torch_out(model: TorchUNet, inputs: dict[str, np.ndarray | None]) -> torch.Tensor:
    return model(**as_torch(inputs))


def flax_out(model: FlaxUNet, params: dict, inputs: dict[str, np.ndarray | None]) -> jax.Array:
    out = jax.jit(model.apply)({"params": params}, **as_flax(inputs))  # one compile, not one per op
    return out.transpose(0, 3, 1, 2)  # NHWC -> NCHW
