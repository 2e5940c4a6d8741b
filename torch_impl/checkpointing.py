"""Apply a framework-free `CheckpointPlan` to a PyTorch module tree, from the outside.

A recomputed block keeps its place and its `state_dict` keys: only its instance ``forward`` is
shadowed by one under `torch.utils.checkpoint.checkpoint`; save sets use selective checkpointing
(`make_context_fn`). A recompute in train mode would update every BatchNorm's running statistics a
second time (PyTorch issue 96136): `with_frozen_running_stats` gives it a context that restores them
(Flax returns ``batch_stats`` from the forward, so `nn.remat` updates them once). Mirror:
`jax_impl/checkpointing.py`. Docs: docs/spec_and_plans.md, docs/compile.md, docs/remat_vs_checkpoint.md.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from shared_configs.vocabulary import OP_CLASSES, CheckpointPlan
from torch_impl import compat

aten = torch.ops.aten
# Op class -> the aten ops that produce it. On CPU nn.Linear decomposes to addmm (with bias) or
# mm (without), 3-D inputs folded to 2-D; F.scaled_dot_product_attention to the *_for_cpu kernel.
ATEN_OPS: dict[str, tuple[Any, ...]] = {
    "conv": (aten.convolution,),
    "matmul": (aten.mm, aten.addmm, aten.bmm, aten.baddbmm),
    "attention": tuple(compat.aten(name) for name in compat.SDPA_KERNELS),
    "norm": (aten.native_group_norm, aten.native_layer_norm),
}
assert set(ATEN_OPS) == set(OP_CLASSES)
_OP_CLASS = {packet: name for name, packets in ATEN_OPS.items() for packet in packets}
# Set on each module `apply_plan` wraps: the instance forward it had before (None: its class's).
_PRIOR = "_checkpoint_plan_prior_forward"
OFFLOAD_ON_CPU = (
    "offload: tensors on CPU already live in host memory; saving them in place instead "
    "(the plan runs as save without offload)"
)


@dataclass
class SavedRecord:
    """One output a selective policy chose to save."""

    block: str
    op_class: str
    op: str
    recompute: bool
    outputs: list[torch.Tensor] = field(default_factory=list)  # meta tensors: shape and dtype only


# The lists of the active `record_saved` blocks, by id (the instruments read what selective policies keep).
_RECORDS: dict[int, list[SavedRecord]] = {}


@contextlib.contextmanager
def record_saved() -> Iterator[list[SavedRecord]]:
    """Every save decision of selective policies while active (forward and recompute)."""
    records: list[SavedRecord] = []
    _RECORDS[id(records)] = records
    try:
        yield records
    finally:
        del _RECORDS[id(records)]


def op_class(op: Any) -> str | None:
    """The `OP_CLASSES` name of an aten op (overload or packet), or None."""
    return _OP_CLASS.get(getattr(op, "overloadpacket", op))


def _policy_fn(
    block: str, save: tuple[str, ...], offload: bool, warned: list[bool], ctx: Any, op: Any, *args: Any, **kw: Any
) -> Any:
    cls = op_class(op)
    if cls not in save:
        return CheckpointPolicy.PREFER_RECOMPUTE
    decision = CheckpointPolicy.MUST_SAVE
    if offload:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        if device is not None and device.type == "cpu":
            if not warned[0]:
                warnings.warn(OFFLOAD_ON_CPU, UserWarning, stacklevel=2)
                warned[0] = True
        else:
            decision = CheckpointPolicy.MUST_CPU_OFFLOAD
    if _RECORDS:  # the op's outputs as meta tensors: no data, no compute
        meta = compat.tree_map_only(torch.Tensor, lambda t: torch.empty_like(t, device="meta"), (args, kw))
        out = op(*meta[0], **meta[1])
        outputs = [t for t in (out if isinstance(out, tuple | list) else (out,)) if isinstance(t, torch.Tensor)]
        for records in _RECORDS.values():
            records.append(SavedRecord(block, cls, str(op), ctx.is_recompute, outputs))
    return decision


def _compiled_policy_fn(save: tuple[str, ...], offload: bool, ctx: Any, op: Any, *args: Any, **kw: Any) -> Any:
    # offload: the partitioner knows only save/recompute tags, so the tensor is saved in place
    return CheckpointPolicy.MUST_SAVE if op_class(op) in save else CheckpointPolicy.PREFER_RECOMPUTE


def make_context_fn(block: str, plan: CheckpointPlan, compiled: bool = False) -> Callable[[], tuple[Any, Any]] | None:
    """The checkpoint ``context_fn`` for ``block`` under ``plan``; None keeps torch's default. ``compiled``:
    a partial over constants, which Dynamo traces (the eager policy closes over observers and a flag)."""
    save = plan.save_for(block)
    if not save:
        return None
    policy = (
        functools.partial(_compiled_policy_fn, tuple(save), bool(plan.offload))
        if compiled
        else functools.partial(_policy_fn, block, save, plan.offload, [False])
    )
    return functools.partial(create_selective_checkpoint_contexts, policy)


def apply_plan(
    root: nn.Module,
    plan: CheckpointPlan,
    preserve_rng_state: bool = True,
    modules: Mapping[str, nn.Module] | None = None,
) -> None:
    """Checkpoint every unit ``plan`` recomputes: ``modules[name]``, by default ``root.get_submodule(name)``."""
    remove_plan(root)
    for name in plan.recompute:
        _checkpoint_forward(
            root.get_submodule(name) if modules is None else modules[name], name, plan, preserve_rng_state
        )


def _checkpoint_forward(module: nn.Module, name: str, plan: CheckpointPlan, preserve_rng_state: bool) -> None:
    # An instance forward someone else set (accelerate's and peft's hooks do) is wrapped and kept.
    prior = module.__dict__.get("forward")
    plain = prior if prior is not None else type(module).forward.__get__(module)
    # BatchNorm: the recompute must not update running statistics twice (`with_frozen_running_stats`).
    eager = with_frozen_running_stats(module, make_context_fn(name, plan) or noop_context_fn)
    module.forward = functools.partial(
        _checkpointed,
        plain,
        preserve_rng_state,
        None if eager is noop_context_fn else eager,
        make_context_fn(name, plan, compiled=True),
    )
    module.__dict__[_PRIOR] = prior


def _checkpointed(
    plain: Callable[..., Any], preserve_rng_state: bool, eager: Any, compiled: Any, *args: Any, **kwargs: Any
) -> Any:
    """``plain`` under checkpoint, with the context for how it runs now (eager or traced by Dynamo)."""
    context_fn = compiled if torch.compiler.is_compiling() else eager
    # use_reentrant=False: the reentrant variant gives parameters no gradient when no
    # *input* requires grad, and cannot handle keyword arguments or nested outputs.
    return checkpoint(
        plain,
        *args,
        use_reentrant=False,
        preserve_rng_state=preserve_rng_state,
        **({} if context_fn is None else {"context_fn": context_fn}),
        **kwargs,
    )


def remove_plan(root: nn.Module) -> None:
    """Undo `apply_plan`: every module it wrapped gets back the forward it had before."""
    for module in root.modules():
        if _PRIOR in module.__dict__:
            prior = module.__dict__.pop(_PRIOR)
            if prior is None:
                del module.__dict__["forward"]
            else:
                module.forward = prior


ContextFn = Callable[[], tuple[AbstractContextManager, AbstractContextManager]]

# The buffers a BatchNorm updates in train mode (`num_batches_tracked` is None without stats).
RUNNING_BUFFERS: tuple[str, ...] = ("running_mean", "running_var", "num_batches_tracked")


def tracking_batchnorms(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


@contextlib.contextmanager
def frozen_running_stats(module: nn.Module, inner: AbstractContextManager) -> Iterator[None]:
    """Run ``inner`` inside; restore, on exit, the BatchNorm buffers of ``module`` as they were on enter."""
    norms = tracking_batchnorms(module)
    with torch.no_grad():
        saved = [{name: getattr(m, name).clone() for name in RUNNING_BUFFERS} for m in norms]
    try:
        with inner:
            yield
    finally:  # also when checkpoint's early stop ends the recompute with an exception
        with torch.no_grad():
            for norm, buffers in zip(norms, saved, strict=True):
                for name, value in buffers.items():
                    getattr(norm, name).copy_(value)


def with_frozen_running_stats(module: nn.Module, context_fn: ContextFn = noop_context_fn) -> ContextFn:
    """``context_fn`` for checkpointing ``module``, its recompute context freezing BatchNorm stats (a module
    without tracking BatchNorms gets ``context_fn`` back). ``context_fn``'s recompute context runs *inside*
    the freeze, so the snapshot's copies are never seen by (or cached in) a selective-checkpointing mode."""
    if not tracking_batchnorms(module):
        return context_fn

    def composed() -> tuple[AbstractContextManager, AbstractContextManager]:
        forward, recompute = context_fn()
        return forward, frozen_running_stats(module, recompute)

    return composed
