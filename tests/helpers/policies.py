"""Loss and gradients of `tiny` under a policy, in each framework: what every plan must reproduce.

Torch runs with dropout 0.3 and the same masks for every policy (a recompute replays the RNG);
JAX with dropout 0. Frameworks are imported inside, so a test module imports only the one it uses.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.helpers.specs import variant


def torch_policy_grads(policy: str) -> tuple[float, list[Any]]:
    """(loss, per-parameter gradients) of one torch forward/backward of `tiny` under ``policy``."""
    import torch

    from torch_impl import UNet

    torch.manual_seed(0)
    model = UNet(variant("tiny", dropout=0.3)).train()
    model.enable_gradient_checkpointing(policy)
    gen = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(2, 4, 8, 8, generator=gen), torch.randn(2, 5, 12, generator=gen)
    torch.manual_seed(5)  # same dropout masks for every policy
    loss = model(x, torch.tensor([3.0, 700.0]), ctx).square().mean()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def jax_policy_grads(policy: str) -> tuple[float, list[np.ndarray]]:
    """(loss, gradient leaves) of one JAX value_and_grad of `tiny` under ``policy``."""
    import jax
    import jax.numpy as jnp

    from jax_impl import UNet

    spec = variant("tiny", dropout=0.0)
    rng = np.random.RandomState(0)
    x, ctx = jnp.asarray(rng.randn(2, 8, 8, 4), jnp.float32), jnp.asarray(rng.randn(2, 5, 12), jnp.float32)
    t = jnp.array([3.0, 700.0])
    params = UNet(spec=spec, policy="none").init(jax.random.key(0), x, t, ctx)
    model = UNet(spec=spec, policy=policy)
    loss, grads = jax.value_and_grad(lambda p: jnp.mean(model.apply(p, x, t, ctx) ** 2))(params)
    return float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)]
