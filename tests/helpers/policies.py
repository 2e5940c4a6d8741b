"""The check every plan must pass: the un-checkpointed model's loss and gradients, in each framework.

`assert_plans_keep_loss_and_grads` runs a step under ``none`` and under each plan and compares them
with `assert_same_loss_and_grads`; `torch_loss_and_grads` and `jax_loss_and_grads` are such steps.
`torch_policy_grads` / `jax_policy_grads` are the step of `tiny` the grammar and op-level tests share;
`checkpointed_names` lists the torch modules a plan wraps.
Frameworks are imported inside, so a test module imports only the one it uses.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from tests.helpers.specs import FAST_COMPILE, variant

LossAndGrads = tuple[float, dict[str, Any]]  # the loss, and the gradients by name (torch tensors or arrays)


def assert_same_loss_and_grads(
    got: LossAndGrads, ref: LossAndGrads, tol: float = 0.0, atol: float = 0.0, loss_tol: float | None = None
) -> None:
    """The same gradient names, each gradient within ``tol`` of ``ref``'s, relative by norm, or within
    ``atol`` by norm (for gradients that are zero in exact arithmetic, as the key projections' biases
    are: softmax ignores a shift shared by all keys), and the loss within ``loss_tol`` (default
    ``tol``) relative. ``tol=0``: bit for bit."""
    (loss, grads), (ref_loss, ref_grads) = got, ref
    loss_tol = tol if loss_tol is None else loss_tol
    assert abs(loss - ref_loss) <= loss_tol * abs(ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
    for name, want in ref_grads.items():
        g, w = np.asarray(grads[name], np.float64), np.asarray(want, np.float64)
        err = float(np.linalg.norm(g - w))
        assert err <= max(tol * float(np.linalg.norm(w)), atol), (name, err, float(np.linalg.norm(w)))


def assert_plans_keep_loss_and_grads(
    step: Callable[[Any], LossAndGrads],
    plans: Iterable[Any],
    tol: float = 0.0,
    atol: float = 0.0,
    loss_tol: float | None = None,
    reference: Any = "none",
) -> LossAndGrads:
    """``step(plan)`` gives ``step(reference)``'s loss and gradients for every plan (as
    `assert_same_loss_and_grads`); returns the reference's. The gradients must not all be zero."""
    ref = step(reference)
    assert any(np.any(np.asarray(g) != 0) for g in ref[1].values()), "no gradient reaches the parameters"
    for plan in plans:
        try:
            assert_same_loss_and_grads(step(plan), ref, tol, atol, loss_tol)
        except AssertionError as error:
            raise AssertionError(f"plan {plan!r}: {error}") from error
    return ref


def ramp(shape: tuple[int, ...]) -> np.ndarray:
    """Weights -1 .. 1 over the elements: a loss weighted so that a swapped element or channel changes it."""
    return np.linspace(-1, 1, int(np.prod(shape)), dtype=np.float32).reshape(shape)


def torch_loss_and_grads(
    model: Any,
    inputs: tuple | Mapping[str, Any],
    seed: int | None = None,
    loss: Callable[[Any], Any] | None = None,
    wrt: Mapping[str, Any] | None = None,
) -> LossAndGrads:
    """One forward/backward of ``model`` on ``inputs`` (positional, or by name): ``loss(out)``
    (default: the ramp-weighted mean of the output) and the gradients of ``wrt`` (default: the
    trained parameters, by name). ``seed``: the RNG before the forward, so every plan draws the
    same dropout masks."""
    import torch

    wrt = dict(wrt) if wrt is not None else {n: p for n, p in model.named_parameters() if p.requires_grad}
    for tensor in wrt.values():
        tensor.grad = None
    if seed is not None:
        torch.manual_seed(seed)
    out = model(**inputs) if isinstance(inputs, Mapping) else model(*inputs)
    value = loss(out) if loss is not None else (out * torch.from_numpy(ramp(tuple(out.shape)))).mean()
    value.backward()
    return value.item(), {n: t.grad.clone() for n, t in wrt.items()}


def jax_loss_and_grads(loss: Callable[..., Any], params: Any, *args: Any, jit: bool = True) -> LossAndGrads:
    """``jax.value_and_grad(loss)(params, *args)``, compiled whole with `FAST_COMPILE` (``jit=False``:
    op by op); the gradients by key path."""
    import jax

    step = jax.value_and_grad(loss)
    if jit:
        step = jax.jit(step).lower(params, *args).compile(FAST_COMPILE)
    value, grads = step(params, *args)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    return float(value), {jax.tree_util.keystr(path): np.asarray(g) for path, g in flat}


@functools.cache  # a function of the policy (seeded): each process computes `none`'s once
def torch_policy_grads(policy: str) -> LossAndGrads:
    """Loss and gradients of one torch forward/backward of `tiny` (dropout 0.3, the same masks for
    every policy: a recompute replays the RNG) under ``policy``. Cached: do not modify the result."""
    import torch

    from torch_impl import UNet

    torch.manual_seed(0)
    model = UNet(variant("tiny", dropout=0.3)).train()
    model.enable_gradient_checkpointing(policy)
    gen = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(2, 4, 8, 8, generator=gen), torch.randn(2, 5, 12, generator=gen)
    return torch_loss_and_grads(model, (x, torch.tensor([3.0, 700.0]), ctx), seed=5, loss=lambda o: o.square().mean())


@functools.cache
def jax_policy_grads(policy: str) -> LossAndGrads:
    """Loss and gradients of one JAX value_and_grad of `tiny` (dropout 0) under ``policy``, op by op
    (the ops' programs are shared by every policy). Cached: do not modify the result."""
    import jax
    import jax.numpy as jnp

    from jax_impl import UNet

    spec = variant("tiny", dropout=0.0)
    rng = np.random.RandomState(0)
    x, ctx = jnp.asarray(rng.randn(2, 8, 8, 4), jnp.float32), jnp.asarray(rng.randn(2, 5, 12), jnp.float32)
    t = jnp.array([3.0, 700.0])
    params = UNet(spec=spec, policy="none").init(jax.random.key(0), x, t, ctx)
    model = UNet(spec=spec, policy=policy)
    return jax_loss_and_grads(lambda p: jnp.mean(model.apply(p, x, t, ctx) ** 2), params, jit=False)


def checkpointed_names(root: Any) -> list[str]:
    """Names of the torch modules that currently run under checkpoint (`torch_impl.checkpointing.apply_plan`'s)."""
    from torch_impl.checkpointing import _PRIOR

    return [name for name, m in root.named_modules() if _PRIOR in m.__dict__]
