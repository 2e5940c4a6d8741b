"""`torch_impl.compat` and `jax_impl.compat`: every reach into a library's private API is where it was checked.

Each reach is resolved on the libraries installed here, one test each, named by the reach: the day a
library moves one, its test fails with the reach's name. The patches are undone, also when the block raises.
"""

from __future__ import annotations

import pytest
import torch

from jax_impl import compat as jcompat
from shared_configs.compat import MovedError
from torch_impl import compat as tcompat


@pytest.mark.parametrize("name", sorted(tcompat.REACHES))
def test_torch_reach(name: str) -> None:
    assert tcompat.reach(name) is not None, name


@pytest.mark.parametrize("name", sorted(jcompat.REACHES))
def test_jax_reach(name: str) -> None:
    assert jcompat.reach(name) is not None, name


def test_a_moved_reach_fails_naming_itself_and_the_versions() -> None:
    with pytest.raises(MovedError, match=r"^torch:UntypedStorage\.resize_gone: not found .*torch 2\.\d+"):
        tcompat.reach("torch:UntypedStorage.resize_gone")
    with pytest.raises(MovedError, match=r"^jax\._src\.gone:x: not found .*jax 0\.\d+"):
        jcompat.reach("jax._src.gone:x")


def test_reaches_on_objects() -> None:
    """`INSTANCE_REACHES`: set on instances, so reached on one of each."""
    linear = torch.nn.Linear(2, 2)
    assert tcompat.compiled_inner(torch.compile(linear)) is linear  # OptimizedModule._orig_mod
    params, buffers = tcompat.tensor_tables(torch.nn.BatchNorm1d(2))  # nn.Module._parameters, _buffers
    assert set(params) == {"weight", "bias"} and "running_mean" in buffers
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    tracker = tcompat.mem_tracker([frozen])  # MemTracker._param_to_grad_hook_handles
    assert frozen in tracker._param_to_grad_hook_handles
    view = torch.ones(4)[1:]
    assert tcompat.view_base(view) is not None and tcompat.view_base(torch.ones(1)) is None
    assert set(tcompat.INSTANCE_REACHES) == {
        "OptimizedModule._orig_mod",
        "MemTracker._param_to_grad_hook_handles",
        "nn.Module._parameters, nn.Module._buffers",
    }


def test_the_patches_are_undone_when_the_block_raises() -> None:
    from torch.distributed._tools import mod_tracker

    resize, hook = torch.UntypedStorage.resize_, mod_tracker.register_multi_grad_hook
    seen: list[int] = []
    with pytest.raises(RuntimeError, match="inside"), tcompat.resizes_to(lambda real, st, size: seen.append(size)):
        torch.ones(4).untyped_storage().resize_(8)
        raise RuntimeError("inside")
    with pytest.raises(RuntimeError, match="inside"), tcompat.multi_grad_hooks_any():
        assert mod_tracker.register_multi_grad_hook is not hook
        raise RuntimeError("inside")
    assert seen == [8]
    assert torch.UntypedStorage.resize_ is resize and mod_tracker.register_multi_grad_hook is hook


def test_accelerates_sync_flag_is_put_back() -> None:
    from accelerate.state import GradientState

    state = GradientState()
    holder = type("Accelerator", (), {"gradient_state": state})()
    for sync in (False, True):
        tcompat.set_sync_gradients(holder, sync)
        assert state.sync_gradients is sync
