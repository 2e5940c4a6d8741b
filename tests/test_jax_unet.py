"""The Flax U-Net: parameter tree mirrors torch, checkpoint plans change memory, never results.

Torch <-> Flax output parity after weight conversion lives in `test_parity.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import traverse_util

from jax_impl import UNet
from jax_impl.unet import abstract_inputs
from shared_configs import CheckpointPlan, SpecError, UNetSpec, layer_names, load_spec, resolve_plan
from tests.helpers.policies import assert_same_loss_and_grads
from tests.helpers.specs import FAST_COMPILE
from torch_impl import UNet as TorchUNet

POLICIES = ("full", "balanced", "layers", "every:2")


def _param_shapes(spec: UNetSpec, policy: object = "none") -> dict[str, tuple[int, ...]]:
    """``{"down_1/resnets_0/conv1/kernel": shape}`` without allocating (sd15 is 3.4 GB)."""
    tree = jax.eval_shape(UNet(spec=spec, policy=policy).init, jax.random.key(0), **abstract_inputs(spec))
    return {"/".join(k): v.shape for k, v in traverse_util.flatten_dict(tree["params"]).items()}


def _torch_shapes(spec: UNetSpec) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):  # shapes only, no memory
        return {k: tuple(v.shape) for k, v in TorchUNet(spec).state_dict().items()}


# --- parameter tree ----------------------------------------------------------------------------


@pytest.mark.slow_for("sd15-859520964", "sd21-865910724", "sdxl-2567463684")
@pytest.mark.parametrize(
    ("preset", "count"),
    [
        ("tiny", None),
        ("small", None),
        ("ddpm_cifar10", 35_746_307),
        ("sd15", 859_520_964),
        ("sd21", 865_910_724),
        ("sdxl", 2_567_463_684),
    ],
)
def test_parameter_count_matches_torch(preset: str, count: int | None) -> None:
    spec = load_spec(preset)
    flax_count = sum(int(np.prod(s)) for s in _param_shapes(spec).values())
    assert flax_count == sum(int(np.prod(s)) for s in _torch_shapes(spec).values())
    if count is not None:
        assert flax_count == count


@pytest.mark.slow_for("sd15", "sdxl")
@pytest.mark.parametrize("preset", ["tiny", "ddpm_cifar10", "sd15", "sdxl"])
def test_parameter_paths_mirror_torch_state_dict(preset: str) -> None:
    """``down.1.resnets.0.conv1.weight`` (OIHW) <-> ``down_1/resnets_0/conv1/kernel`` (HWIO), and so on."""
    spec = load_spec(preset)
    mirrored = {}
    for key, shape in _torch_shapes(spec).items():
        *path, leaf = key.split(".")
        leaf = "bias" if leaf == "bias" else ("scale" if len(shape) == 1 else "kernel")
        # conv OIHW -> HWIO, linear (out, in) -> (in, out), 1-D unchanged
        layout = {4: (2, 3, 1, 0), 2: (1, 0), 1: (0,)}[len(shape)]
        mirrored[f"{_flax_path(path)}/{leaf}"] = tuple(shape[i] for i in layout)
    assert _param_shapes(spec) == mirrored


def _flax_path(parts: list[str]) -> str:
    out: list[str] = []
    for part in parts:
        if part.isdigit():  # ModuleList index -> suffix of the list attribute, as linen names it
            out[-1] += f"_{part}"
        else:
            out.append(part)
    return "/".join(out)


@pytest.mark.slow
def test_parameter_tree_is_the_same_for_every_policy() -> None:
    spec = load_spec("tiny")
    plain = _param_shapes(spec)
    for policy in POLICIES:
        assert _param_shapes(spec, policy) == plain, policy


# --- checkpointing: applied, and numerically invisible -----------------------------------------


# The primitive behind jax.checkpoint ("remat2" in jax 0.10), looked up rather than spelled out.
REMAT = jax.make_jaxpr(jax.checkpoint(jnp.sin))(1.0).eqns[0].primitive


def _count_remat(jaxpr: jax.extend.core.Jaxpr) -> int:
    """Remat equations, including ones nested inside other equations' sub-jaxprs."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive is REMAT
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            count += _count_remat(sub)
    return count


@pytest.mark.parametrize(
    "policy", [*POLICIES, ("down.1", "mid.attentions.0", "up.1.resnets.1"), CheckpointPlan("mine", ("mid",))]
)
def test_one_remat_per_planned_block(policy: object, tiny: dict, plain_remats: int) -> None:
    # Beyond the layers' own (each norm with its activation, each GEGLU: `layers.norm_act`, `layers.geglu`).
    assert _remats(tiny, policy) - plain_remats == len(resolve_plan(tiny["spec"], policy).recompute) > 0


def _remats(tiny: dict, plan: object) -> int:
    model = UNet(spec=tiny["spec"], policy=plan)
    args = (tiny["x"], tiny["t"], tiny["ctx"])
    return _count_remat(jax.make_jaxpr(lambda p: model.apply({"params": p}, *args))(tiny["params"]).jaxpr)


@pytest.fixture(scope="module")
def plain_remats(tiny: dict) -> int:
    return _remats(tiny, "none")


def _residual_bytes(loss: Callable, params: dict) -> int:
    """Bytes the forward pass keeps for backward: the leaves of the VJP closure (shapes only)."""
    residuals = jax.eval_shape(lambda p: jax.vjp(loss, p)[1], params)
    return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(residuals))


@pytest.mark.slow
def test_remat_shrinks_saved_residuals(tiny: dict) -> None:
    saved = {
        p: _residual_bytes(_loss_fn(tiny, p, jax.random.key(0)), tiny["params"]) for p in ("none", "full", "layers")
    }
    assert saved["full"] < 0.5 * saved["none"], saved
    assert saved["layers"] < saved["none"], saved


def _loss_fn(tiny: dict, policy: str, dropout_key: jax.Array) -> Callable[[dict], jax.Array]:
    model = UNet(spec=tiny["spec"], policy=policy)

    def loss(params: dict) -> jax.Array:
        out = model.apply(
            {"params": params}, tiny["x"], tiny["t"], tiny["ctx"], train=True, rngs={"dropout": dropout_key}
        )
        return jnp.mean((out - tiny["target"]) ** 2)

    return loss


def _value_and_grad(tiny: dict, policy: str, seeds: tuple[int, ...]) -> list[tuple[float, dict]]:
    """``(loss, flat grads)`` per dropout seed, with dropout on, in float64.

    float64 because in float32 the plain and the rematerialised programs round differently (XLA
    fuses and orders reductions differently), which moves a few ill-conditioned leaves (attention
    q/k kernels: a small difference of softmax terms) by ~2e-6 relative. In float64 a wrong dropout
    mask or a broken recompute still shows up at O(1), and rounding stays below 1e-15.
    """
    with jax.enable_x64(True):
        tiny = {
            k: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), v) if k != "spec" else v for k, v in tiny.items()
        }

        def step(params: dict, key: jax.Array) -> tuple:
            return jax.value_and_grad(_loss_fn(tiny, policy, key))(params)

        compiled = jax.jit(step).lower(tiny["params"], jax.random.key(0)).compile(FAST_COMPILE)
        results = [compiled(tiny["params"], jax.random.key(seed)) for seed in seeds]
        return [(float(loss), traverse_util.flatten_dict(jax.tree.map(np.asarray, g))) for loss, g in results]


@pytest.fixture(scope="module")
def reference(tiny: dict) -> dict:
    (loss, grads), (other_mask, _) = _value_and_grad(tiny, "none", seeds=(5, 6))
    # Dropout is live: another key gives another loss, so equal losses below mean equal masks.
    assert abs(other_mask - loss) > 1e-4 * abs(loss)
    return {"loss": loss, "grads": grads}


@pytest.mark.slow  # two whole-gradient compiles at least (the inner loop keeps the remat counts)
@pytest.mark.parametrize("policy", POLICIES)
def test_checkpointed_gradients_equal_plain(policy: str, tiny: dict, reference: dict) -> None:
    [got] = _value_and_grad(tiny, policy, seeds=(5,))
    # A few gradients are zero in exact arithmetic (to_k's bias: softmax ignores a shift shared
    # by all keys), i.e. pure rounding noise; those are measured against the whole gradient.
    floor = 1e-6 * max(np.linalg.norm(g) for g in reference["grads"].values())
    assert_same_loss_and_grads(got, (reference["loss"], reference["grads"]), tol=1e-6, atol=1e-6 * floor)


# --- API -----------------------------------------------------------------------------------------


def test_missing_context_is_an_error() -> None:
    inputs = abstract_inputs(load_spec("tiny"))
    with pytest.raises(
        ValueError, match=r"context: spec 'tiny' has cross-attention; pass context of shape \(B, L, 12\)"
    ):
        jax.eval_shape(UNet(spec="tiny").init, jax.random.key(0), inputs["x"], inputs["t"])


def test_unbound_module_lists_names_and_accepts_a_preset_name() -> None:
    spec = load_spec("tiny")
    assert UNet(spec="tiny").block_names() == ["down.0", "down.1", "mid", "up.0", "up.1"]
    assert UNet(spec=spec).block_names(layers=True) == layer_names(spec)
    assert UNet(spec="tiny", policy="balanced").plan.recompute == ("down.1", "mid", "up.0")


@pytest.mark.slow
def test_scalar_and_batched_timesteps_agree(tiny: dict) -> None:
    model = UNet(spec=tiny["spec"])

    def out(t: jax.Array) -> jax.Array:
        return model.apply({"params": tiny["params"]}, tiny["x"], t, tiny["ctx"])

    # One compiled program: the model given a scalar t, and given it as a (B,) vector.
    both = jax.jit(lambda t: (out(t), out(jnp.full((2,), t))))
    scalar, batched = both.lower(7.0).compile(FAST_COMPILE)(7.0)
    np.testing.assert_array_equal(scalar, batched)


@pytest.fixture(scope="module")
def tiny() -> dict:
    """The tiny preset (dropout 0.1) with random weights, inputs and a regression target."""
    spec = load_spec("tiny")
    rng = np.random.default_rng(0)
    shapes = jax.eval_shape(UNet(spec=spec).init, jax.random.key(0), **abstract_inputs(spec))
    params = jax.tree.map(lambda s: jnp.asarray(0.2 * rng.standard_normal(s.shape, dtype=np.float32)), shapes)
    x = rng.standard_normal((2, spec.sample_size, spec.sample_size, spec.in_channels), dtype=np.float32)
    return {
        "spec": spec,
        "params": params["params"],
        "x": jnp.asarray(x),
        "t": jnp.asarray([11.0, 860.0]),
        "ctx": jnp.asarray(rng.standard_normal((2, 3, spec.cross_attention_dim), dtype=np.float32)),
        "target": jnp.asarray(
            rng.standard_normal((2, spec.sample_size, spec.sample_size, spec.out_channels), dtype=np.float32)
        ),
    }


@pytest.mark.parametrize(("policy", "spec"), [("nosuch", "tiny"), (["down.9"], "tiny"), ("full", "nosuch")])
def test_a_bad_policy_or_spec_fails_at_construction(policy: Any, spec: str) -> None:
    """As torch's UNet: a one-line SpecError when the module is made, not later at init."""
    with pytest.raises(SpecError, match=r"policy: |config: unknown preset"):
        UNet(spec=spec, policy=policy)
