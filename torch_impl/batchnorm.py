"""Checkpointing BatchNorm in PyTorch without updating its running statistics twice.

A recompute in train mode updates every BatchNorm's running statistics a second time (PyTorch issue
96136). `with_frozen_running_stats` gives ``checkpoint`` a *recompute* context that snapshots them on
enter and restores them on exit; the outputs are unaffected (train mode never reads them). Flax
returns ``batch_stats`` from the forward, so `nn.remat` updates them once. Docs: docs/remat_vs_checkpoint.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch
from torch import nn
from torch.utils.checkpoint import noop_context_fn

ContextFn = Callable[[], tuple[AbstractContextManager, AbstractContextManager]]

# The buffers a BatchNorm updates in train mode (`num_batches_tracked` is None without stats).
RUNNING_BUFFERS: tuple[str, ...] = ("running_mean", "running_var", "num_batches_tracked")


def tracking_batchnorms(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


@contextlib.contextmanager
def frozen_running_stats(module: nn.Module) -> Iterator[None]:
    """Restore, on exit, the BatchNorm buffers of ``module`` as they were on enter."""
    norms = tracking_batchnorms(module)
    with torch.no_grad():
        saved = [{name: getattr(m, name).clone() for name in RUNNING_BUFFERS} for m in norms]
    try:
        yield
    finally:  # also when checkpoint's early stop ends the recompute with an exception
        with torch.no_grad():
            for norm, buffers in zip(norms, saved, strict=True):
                for name, value in buffers.items():
                    getattr(norm, name).copy_(value)


@contextlib.contextmanager
def _nested(outer: AbstractContextManager, inner: AbstractContextManager) -> Iterator[None]:
    with outer, inner:
        yield


def with_frozen_running_stats(module: nn.Module, context_fn: ContextFn = noop_context_fn) -> ContextFn:
    """``context_fn`` for checkpointing ``module``, its recompute context freezing BatchNorm stats (a module
    without tracking BatchNorms gets ``context_fn`` back). ``context_fn``'s recompute context runs *inside*
    the freeze, so the snapshot's copies are never seen by (or cached in) a selective-checkpointing mode."""
    if not tracking_batchnorms(module):
        return context_fn

    def composed() -> tuple[AbstractContextManager, AbstractContextManager]:
        forward, recompute = context_fn()
        return forward, _nested(frozen_running_stats(module), recompute)

    return composed
