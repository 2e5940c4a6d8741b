"""Weight conversion between the PyTorch and Flax U-Nets (and ControlNets), both directions.

The trees mirror name for name (``down.1`` is ``down_1``, conv OIHW <-> HWIO ``kernel``, norm ``weight`` <->
``scale``); both directions check the result against the spec's tree, naming any mismatched parameter.
Docs: docs/remat_vs_checkpoint.md, docs/diffusers.md.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import traverse_util

from jax_impl.lora import LORA_A, LORA_LEAVES
from shared_configs import UNetSpec
from shared_configs.controlnet import ControlNetSpec
from shared_configs.diffusers.folders import ours_to_diffusers

Spec = UNetSpec | ControlNetSpec  # a U-Net's, or a ControlNet's (`jax_impl.controlnet`): the same conversion

LIST_ATTRS = ("down", "up", "resnets", "attentions", "transformer_blocks", "blocks", "controlnet_down_blocks")
_LIST_RE = re.compile(rf"^({'|'.join(LIST_ATTRS)})_(\d+)$")  # a list of modules: torch ModuleList, Flax list
# torch BatchNorm buffer -> Flax batch_stats leaf; the step counter has no Flax twin.
STATS_LEAVES = {"running_mean": "mean", "running_var": "var"}
COUNTER = "num_batches_tracked"
EMBEDDING = "embedding"  # nn.Embed's table, (rows, width) as torch's nn.Embedding weight
# Flax layout -> torch layout by ndim: conv HWIO -> OIHW, linear (in, out) -> (out, in); the inverse below.
TO_TORCH = {4: (3, 2, 0, 1), 2: (1, 0)}
TO_FLAX = {4: (2, 3, 1, 0), 2: (1, 0)}


def torch_to_flax(state_dict: Mapping[str, Any], spec: Spec, lora_rank: int | None = None) -> dict:
    """A torch `state_dict` (tensors or arrays; parameters only converts too) -> Flax ``params`` for
    ``jax_impl.UNet(spec)``, BatchNorm buffers left out. ``lora_rank``: with peft's adapters
    (``to_q.base_layer.weight``, ``to_q.lora_A.default.weight``), for ``UNet(spec, lora_rank=R)``."""
    params, stats = _split(state_dict, _embeddings(spec))
    _check_tree(params, spec, lora_rank=lora_rank)
    if stats:
        _check_tree(stats, spec, "batch_stats")
    return traverse_util.unflatten_dict(params)


def torch_to_flax_variables(state_dict: Mapping[str, Any], spec: Spec) -> dict:
    """A torch `state_dict` -> Flax variables: ``params``, and ``batch_stats`` when the spec has BatchNorms."""
    params, stats = _split(state_dict, _embeddings(spec))
    _check_tree(params, spec)
    _check_tree(stats, spec, "batch_stats")
    variables = {"params": params} | ({"batch_stats": stats} if stats else {})
    return {name: traverse_util.unflatten_dict(flat) for name, flat in variables.items()}


def flax_to_torch(
    params: Mapping[str, Any],
    spec: Spec,
    batch_stats: Mapping[str, Any] | None = None,
    num_batches_tracked: int = 0,
    lora_rank: int | None = None,
) -> dict[str, Any]:
    """Flax ``params`` -> a torch `state_dict` for ``load_state_dict(strict=True)``; BatchNorms get ``batch_stats``
    (default: torch's initial ones), ``lora_rank`` names the adapters as peft does."""
    import torch  # only this direction needs torch

    flat = traverse_util.flatten_dict(dict(params))
    _check_tree(flat, spec, lora_rank=lora_rank)
    adapted = {path[:-2] for path in flat if len(path) > 2 and path[-2] == LORA_A}
    out = {}
    for path, value in flat.items():
        *modules, leaf = path
        array = np.asarray(value)
        layout = array if leaf == EMBEDDING else _to_layout(array, TO_TORCH)
        name = _torch_name(modules) + _peft_suffix(tuple(modules), adapted)
        out[f"{name}.{'bias' if leaf == 'bias' else 'weight'}"] = torch.from_numpy(layout.copy())
    expected = traverse_util.flatten_dict(_variable_shapes(spec).get("batch_stats", {}))
    if not expected:
        return out
    if batch_stats is None:
        stats = {k: np.full(v.shape, 0.0 if k[-1] == "mean" else 1.0, np.float32) for k, v in expected.items()}
    else:
        stats = traverse_util.flatten_dict(dict(batch_stats))
    _check_tree(stats, spec, "batch_stats")
    torch_leaf = {v: k for k, v in STATS_LEAVES.items()}
    for (*modules, leaf), value in stats.items():
        name = _torch_name(modules)
        out[f"{name}.{torch_leaf[leaf]}"] = torch.from_numpy(np.array(value, dtype=np.float32))
        out[f"{name}.{COUNTER}"] = torch.tensor(num_batches_tracked, dtype=torch.long)
    return out


def _embeddings(spec: Spec) -> frozenset[str]:
    """Torch module names holding an embedding table (their ``weight`` is a Flax ``embedding``)."""
    ce = (spec.unet if isinstance(spec, ControlNetSpec) else spec).class_embedding
    return frozenset({"class_embedding"} if ce is not None and ce.kind == "embedding" else ())


def _split(state_dict: Mapping[str, Any], embeddings: frozenset[str] = frozenset()) -> tuple[dict, dict]:
    """Flat Flax ``params`` and ``batch_stats`` from a torch state_dict; the counter is dropped."""
    params, stats = {}, {}
    for key, value in state_dict.items():
        *path, leaf = _torch_path(key)
        if leaf == COUNTER:
            continue
        array = _to_numpy(value)
        if leaf in STATS_LEAVES:
            stats[(*path, STATS_LEAVES[leaf])] = array
        elif leaf == "weight" and ".".join(path) in embeddings:
            params[(*path, EMBEDDING)] = array
        elif leaf == "bias":
            params[(*path, leaf)] = array
        else:  # a norm's 1-D weight is Flax's scale
            params[(*path, "scale" if array.ndim == 1 else "kernel")] = _to_layout(array, TO_FLAX)
    return params, stats


def _torch_name(modules: list[str]) -> str:
    """``[down_1, resnets_0, conv1]`` -> ``down.1.resnets.0.conv1``."""
    return ".".join(_LIST_RE.sub(r"\1.\2", m) for m in modules)


# peft's wrapping names: ``to_q.base_layer.weight`` is ``to_q.weight``; "default" names the one adapter added.
PEFT_PARTS = ("base_layer", "default")


def _peft_suffix(modules: tuple[str, ...], adapted: set[tuple[str, ...]]) -> str:
    """``.base_layer`` for an adapted layer's own weights, ``.default`` for its adapters' (peft's names)."""
    if modules in adapted:
        return ".base_layer"
    return ".default" if modules[:-1] in adapted and modules[-1] in LORA_LEAVES else ""


def _torch_path(key: str) -> list[str]:
    """``down.1.resnets.0.conv1.weight`` -> ``[down_1, resnets_0, conv1, weight]``, peft's parts dropped."""
    return [part for part in re.sub(r"\.(\d+)(?=\.|$)", r"_\1", key).split(".") if part not in PEFT_PARTS]


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor; avoid importing torch for numpy input
        value = value.detach().cpu().float().numpy() if value.dtype.is_floating_point else value.numpy()
    # A copy: `Tensor.numpy()` shares memory, and torch updates running statistics and weights in place.
    return np.array(value, copy=True)


def _to_layout(array: np.ndarray, perms: dict[int, tuple[int, ...]]) -> np.ndarray:
    return array.transpose(perms[array.ndim]) if array.ndim in perms else array


def _check_tree(
    flat: Mapping[tuple[str, ...], Any], spec: Spec, collection: str = "params", lora_rank: int | None = None
) -> None:
    """Raise a one-line error unless ``flat`` has exactly the paths and shapes the spec implies."""
    tree = _variable_shapes(spec, lora_rank).get(collection, {})
    expected = {k: tuple(v.shape) for k, v in traverse_util.flatten_dict(tree).items()}
    got = {k: tuple(np.shape(v)) for k, v in flat.items()}
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    where = "" if collection == "params" else f"{collection} "
    if missing or extra:
        what = f"missing {where}{'/'.join(missing[0])}" if missing else f"unexpected {where}{'/'.join(extra[0])}"
        raise ValueError(
            f"weights do not match spec {spec.name!r}: {what} ({len(missing)} missing, {len(extra)} unexpected)"
        )
    if bad := next((key for key, shape in expected.items() if got[key] != shape), None):
        raise ValueError(
            f"weights do not match spec {spec.name!r}: {where}{'/'.join(bad)} has shape {got[bad]}, "
            f"expected {expected[bad]}"
        )


@functools.lru_cache(maxsize=16)
def diffusers_flax_paths(spec: Spec) -> dict[tuple[str, ...], tuple[str, ...]]:
    """Our Flax parameter paths -> those of diffusers' Flax classes (diffusers <= 0.39): the torch names' renames
    (``down_blocks``, ``to_out.0``, ...: `shared_configs.diffusers.folders.KEY_RENAMES`), indices joined by ``_``."""
    flat = traverse_util.flatten_dict(_variable_shapes(spec)["params"])
    names = {f"{_torch_name(modules)}.{leaf}": (*modules, leaf) for *modules, leaf in flat}
    return {
        ours: tuple(re.sub(r"\.(\d+)(?=\.)", r"_\1", key).split(".")) for key, ours in ours_to_diffusers(names).items()
    }


def to_diffusers_flax(params: Mapping[str, Any], spec: Spec) -> dict:
    """Our Flax ``params`` -> the same leaves under diffusers' Flax names (`diffusers_flax_paths`)."""
    flat = traverse_util.flatten_dict(dict(params))
    _check_tree(flat, spec)
    paths = diffusers_flax_paths(spec)
    return traverse_util.unflatten_dict({paths[k]: v for k, v in flat.items()})


def from_diffusers_flax(params: Mapping[str, Any], spec: Spec) -> dict:
    """Parameters under diffusers' Flax names (a ``diffusion_flax_model.msgpack``'s) -> our Flax ``params``."""
    ours = {theirs: k for k, theirs in diffusers_flax_paths(spec).items()}
    flat = {ours.get(k, ("?", *k)): v for k, v in traverse_util.flatten_dict(dict(params)).items()}
    _check_tree(flat, spec)  # an unknown name stays under "?", named by the error
    return traverse_util.unflatten_dict(flat)


def torch_shapes(spec: Spec) -> dict[str, tuple[int, ...]]:
    """The torch ``state_dict`` names and shapes of ``spec``, from the Flax tree (shapes only)."""
    variables = _variable_shapes(spec)
    out = {}
    for (*modules, leaf), value in traverse_util.flatten_dict(variables["params"]).items():
        perm = None if leaf == EMBEDDING else TO_TORCH.get(value.ndim)
        shape = tuple(value.shape) if perm is None else tuple(value.shape[i] for i in perm)
        out[f"{_torch_name(modules)}.{'bias' if leaf == 'bias' else 'weight'}"] = shape
    for (*modules, leaf), value in traverse_util.flatten_dict(variables.get("batch_stats", {})).items():
        name = _torch_name(modules)
        out[f"{name}.{'running_mean' if leaf == 'mean' else 'running_var'}"] = tuple(value.shape)
        out[f"{name}.{COUNTER}"] = ()
    return out


@functools.lru_cache(maxsize=16)
def _variable_shapes(spec: Spec, lora_rank: int | None = None) -> dict:
    """All Flax variable collections of ``spec`` as shape structs (cached: each conversion checks against it)."""
    from jax_impl.controlnet import ControlNet, abstract_controlnet_inputs
    from jax_impl.unet import UNet, abstract_inputs

    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    # parent=None: a top-level module even when first asked from inside another's method (a drop-in's setup)
    cls, inputs = (
        (ControlNet, abstract_controlnet_inputs) if isinstance(spec, ControlNetSpec) else (UNet, abstract_inputs)
    )
    return jax.eval_shape(cls(spec=spec, lora_rank=lora_rank, parent=None).init, rngs, **inputs(spec))
