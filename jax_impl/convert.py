"""Weight conversion between the PyTorch and Flax U-Nets, both directions, every layer type.

The two module trees are mirrored name for name, so conversion is mechanical:

* a torch ModuleList index ``down.1`` is the Flax list attribute ``down_1``;
* ``weight`` of a conv (OIHW) is a Flax ``kernel`` (HWIO), of a linear (out, in) a ``kernel``
  (in, out), of a norm (1-D) a ``scale``; ``bias`` stays ``bias``.

Both functions check the result against the parameter tree the spec implies, so a mismatch is a
clear error naming the parameter instead of a silent wrong model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import traverse_util

from shared_configs import UNetSpec

# Attributes that hold lists of modules (torch ModuleList <-> Flax list in setup()).
LIST_ATTRS = ("down", "up", "resnets", "attentions", "transformer_blocks")
_LIST_RE = re.compile(rf"^({'|'.join(LIST_ATTRS)})_(\d+)$")


def torch_to_flax(state_dict: Mapping[str, Any], spec: UNetSpec) -> dict:
    """A torch `state_dict` (tensors or arrays) -> Flax ``params`` for ``jax_impl.UNet(spec)``."""
    flat = {}
    for key, value in state_dict.items():
        *path, leaf = _torch_path(key)
        array = _to_numpy(value)
        flat[(*path, _flax_leaf(leaf, array.ndim))] = _to_flax_layout(array)
    _check_tree(flat, spec)
    return traverse_util.unflatten_dict(flat)


def flax_to_torch(params: Mapping[str, Any], spec: UNetSpec) -> dict[str, Any]:
    """Flax ``params`` -> a torch `state_dict`, loadable with ``load_state_dict(strict=True)``."""
    import torch  # only this direction needs torch

    flat = traverse_util.flatten_dict(dict(params))
    _check_tree(flat, spec)
    out = {}
    for path, value in flat.items():
        *modules, leaf = path
        array = np.asarray(value)
        name = ".".join(_LIST_RE.sub(r"\1.\2", m) for m in modules)
        out[f"{name}.{'bias' if leaf == 'bias' else 'weight'}"] = torch.from_numpy(_to_torch_layout(array).copy())
    return out


def _torch_path(key: str) -> list[str]:
    """``down.1.resnets.0.conv1.weight`` -> ``[down_1, resnets_0, conv1, weight]``."""
    parts: list[str] = []
    for part in key.split("."):
        if part.isdigit():
            parts[-1] = f"{parts[-1]}_{part}"
        else:
            parts.append(part)
    return parts


def _flax_leaf(leaf: str, ndim: int) -> str:
    if leaf == "bias":
        return "bias"
    return "scale" if ndim == 1 else "kernel"


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor; avoid importing torch for numpy input
        value = value.detach().cpu().float().numpy() if value.dtype.is_floating_point else value.numpy()
    return np.asarray(value)


def _to_flax_layout(array: np.ndarray) -> np.ndarray:
    if array.ndim == 4:  # conv OIHW -> HWIO
        return array.transpose(2, 3, 1, 0)
    if array.ndim == 2:  # linear (out, in) -> (in, out)
        return array.T
    return array


def _to_torch_layout(array: np.ndarray) -> np.ndarray:
    if array.ndim == 4:  # conv HWIO -> OIHW
        return array.transpose(3, 2, 0, 1)
    if array.ndim == 2:
        return array.T
    return array


def _check_tree(flat: Mapping[tuple[str, ...], Any], spec: UNetSpec) -> None:
    """Raise a one-line error unless ``flat`` has exactly the paths and shapes the spec implies."""
    expected = {k: tuple(v.shape) for k, v in traverse_util.flatten_dict(param_shapes(spec)).items()}
    got = {k: tuple(np.shape(v)) for k, v in flat.items()}
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    if missing or extra:
        what = f"missing {'/'.join(missing[0])}" if missing else f"unexpected {'/'.join(extra[0])}"
        raise ValueError(f"weights do not match spec {spec.name!r}: {what} "
                         f"({len(missing)} missing, {len(extra)} unexpected)")
    for key, shape in expected.items():
        if got[key] != shape:
            raise ValueError(f"weights do not match spec {spec.name!r}: {'/'.join(key)} has shape "
                             f"{got[key]}, expected {shape}")


def param_shapes(spec: UNetSpec) -> dict:
    """The Flax parameter tree of ``spec`` as shape structs, without allocating weights."""
    from jax_impl.unet import UNet

    f32 = jax.numpy.float32
    x = jax.ShapeDtypeStruct((1, spec.sample_size, spec.sample_size, spec.in_channels), f32)
    t = jax.ShapeDtypeStruct((1,), f32)
    context = jax.ShapeDtypeStruct((1, 1, spec.cross_attention_dim), f32) if spec.cross_attention_dim else None
    model = UNet(spec=spec)
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    return jax.eval_shape(model.init, rngs, x, t, context)["params"]
