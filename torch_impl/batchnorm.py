"""Checkpointing BatchNorm in PyTorch without updating its running statistics twice.

`torch.utils.checkpoint` recomputes a block's forward during the backward pass, in the mode the
block is in. In train mode every BatchNorm in the block then updates ``running_mean``,
``running_var`` and ``num_batches_tracked`` a second time (PyTorch issue 96136): the counter reads
2 after one step and the running mean drifts. JAX has no such problem: Flax returns the
``batch_stats`` collection as an output of the forward, so `nn.remat` updates it once.

The fix here is a *recompute* context (``checkpoint(..., context_fn=...)``) that snapshots the
BatchNorm buffers of the checkpointed module on enter and restores them on exit. The recomputed
outputs are unaffected: in train mode BatchNorm normalises with the statistics of the batch and
never reads the running ones. The forward context is left as it is.
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
    """The BatchNorms in ``module`` (itself included) that keep running statistics."""
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
    """``context_fn`` for checkpointing ``module``, its recompute context freezing BatchNorm stats.

    Composes with another ``context_fn`` (e.g. selective checkpointing's): its forward context is
    kept, and its recompute context runs *inside* the freeze, so the snapshot's copies are never
    seen by (or cached in) a selective-checkpointing dispatch mode. A module without tracking
    BatchNorms gets ``context_fn`` back unchanged.
    """
    if not tracking_batchnorms(module):
        return context_fn

    def composed() -> tuple[AbstractContextManager, AbstractContextManager]:
        forward, recompute = context_fn()
        return forward, _nested(frozen_running_stats(module), recompute)

    return composed
