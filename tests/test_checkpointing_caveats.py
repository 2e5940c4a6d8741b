"""The caveats of checkpointing, shown rather than told: BatchNorm, dropout RNG, reentrant autograd.

* BatchNorm: a checkpointed torch BatchNorm updates its running statistics twice (PyTorch issue
  96136) unless the recompute is told not to (`torch_impl.checkpointing.with_frozen_running_stats`); Flax returns
  ``batch_stats`` from the forward, so `nn.remat` updates them once. Torch and Flax BatchNorm
  U-Nets agree after conversion, up to one documented convention (the running variance).
* Dropout: torch replays the RNG state on recompute only with ``preserve_rng_state=True``.
* Reentrant checkpoint: parameters silently get no gradient when no input requires grad.
"""

from __future__ import annotations

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import traverse_util
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from jax_impl import UNet as FlaxUNet
from jax_impl.convert import flax_to_torch, torch_to_flax, torch_to_flax_variables
from tests.helpers.policies import LossAndGrads, assert_same_loss_and_grads, torch_loss_and_grads
from tests.helpers.specs import FAST_COMPILE, variant
from tests.helpers.tensors import randomize_, rel_err
from torch_impl import UNet as TorchUNet
from torch_impl.checkpointing import RUNNING_BUFFERS, with_frozen_running_stats

MOMENTUM = 0.1  # the spec's default norm_momentum (torch convention)


def _bn_block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU(), nn.Conv2d(4, 4, 1)).train()


def _bn_step(block: nn.Module, how: str) -> nn.BatchNorm2d:
    """One forward + backward of ``block`` plainly, checkpointed, or checkpointed with the fix."""
    x = 2 * torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1)) + 1
    if how == "plain":
        out = block(x)
    elif how == "checkpoint":
        out = checkpoint(block, x, use_reentrant=False)
    else:
        out = checkpoint(block, x, use_reentrant=False, context_fn=with_frozen_running_stats(block))
    out.square().mean().backward()
    return block[1]


def test_plain_torch_checkpoint_updates_batchnorm_stats_twice() -> None:
    """PyTorch issue 96136, reproduced: the recompute runs BatchNorm in train mode again."""
    block = _bn_block()
    plain = _bn_step(copy.deepcopy(block), "plain")
    twice = _bn_step(copy.deepcopy(block), "checkpoint")
    fixed = _bn_step(copy.deepcopy(block), "fixed")
    assert plain.num_batches_tracked.item() == 1
    assert twice.num_batches_tracked.item() == 2  # counted twice
    # the mean moved towards the batch mean twice: (1 - (1-m)^2) / m = 2 - m times as far
    assert torch.allclose(twice.running_mean, (2 - MOMENTUM) * plain.running_mean, rtol=1e-5, atol=1e-7)
    assert (twice.running_mean - plain.running_mean).abs().max() > 1e-2
    for name in RUNNING_BUFFERS:  # the fix: exactly the plain step's statistics
        assert torch.equal(getattr(fixed, name), getattr(plain, name)), name


def _bn_unet(dropout: float = 0.0) -> TorchUNet:
    torch.manual_seed(0)
    model = TorchUNet(variant("tiny", norm_kind="batch", dropout=dropout)).train()
    randomize_(model, seed=5)
    return model


def _torch_inputs(spec: object, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(batch, spec.in_channels, spec.sample_size, spec.sample_size, generator=gen)
    ctx = torch.randn(batch, 3, spec.cross_attention_dim, generator=gen) if spec.cross_attention_dim else None
    return x, torch.tensor([5.0, 600.0])[:batch], ctx


def _unet_step(model: TorchUNet, seed: int = 0) -> LossAndGrads:
    """One training forward + backward; the loss and gradients (buffers are read off the model)."""
    return torch_loss_and_grads(model, _torch_inputs(model.spec), seed=seed)


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers()}


@pytest.fixture(scope="module")
def plain_step() -> tuple[LossAndGrads, dict]:
    model = _bn_unet()
    return _unet_step(model), _buffers(model)


@pytest.mark.parametrize("policy", ["full", "balanced", "layers"])
def test_checkpointed_unet_updates_running_stats_once(policy: str, plain_step: tuple[dict, dict]) -> None:
    ref, ref_buffers = plain_step
    model = _bn_unet()
    model.enable_gradient_checkpointing(policy)
    got = _unet_step(model)
    assert any(n.endswith("num_batches_tracked") for n in ref_buffers)
    for name, value in _buffers(model).items():
        assert torch.allclose(value, ref_buffers[name], rtol=1e-6, atol=1e-7), name
        if name.endswith("num_batches_tracked"):
            assert value.item() == 1, name
    assert_same_loss_and_grads(got, ref)  # bit for bit


def test_unet_without_the_fix_counts_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """The negative control: with the recompute context removed, the U-Net shows issue 96136."""
    import torch_impl.checkpointing as ckpt

    monkeypatch.setattr(ckpt, "with_frozen_running_stats", lambda module, context_fn=noop_context_fn: context_fn)
    model = _bn_unet()
    plan = model.enable_gradient_checkpointing("full")
    if not plan.recompute:
        pytest.skip("nothing checkpointed")
    _unet_step(model)
    counts = {n: b.item() for n, b in model.named_buffers() if n.endswith("num_batches_tracked")}
    assert counts["down.0.resnets.0.norm1.num_batches_tracked"] == 2  # inside a recomputed block
    assert counts["conv_norm_out.num_batches_tracked"] == 1  # the output norm is never recomputed


# --- BatchNorm in Flax: remat updates batch_stats once; torch <-> Flax parity ---------------------


def _nhwc(x: torch.Tensor) -> jax.Array:
    return jnp.asarray(x.numpy().transpose(0, 2, 3, 1))


def _flax_inputs(spec: object) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    x, t, ctx = _torch_inputs(spec)
    return _nhwc(x), jnp.asarray(t.numpy()), None if ctx is None else jnp.asarray(ctx.numpy())


@pytest.fixture(scope="module")
def flax_bn() -> dict:
    """A BatchNorm tiny U-Net with dropout: random torch weights converted, inputs, a loss weight."""
    tmodel = _bn_unet(dropout=0.1)
    spec = tmodel.spec
    inputs = _flax_inputs(spec)
    shape = (inputs[0].shape[0], spec.sample_size, spec.sample_size, spec.out_channels)
    weight = jnp.linspace(-1, 1, int(np.prod(shape))).reshape(shape)
    return {
        "spec": spec,
        "variables": torch_to_flax_variables(tmodel.state_dict(), spec),
        "inputs": inputs,
        "w": weight,
    }


def _flax_train_step(flax_bn: dict, policy: str | None) -> tuple[LossAndGrads, dict]:
    """Loss, gradients and the updated ``batch_stats`` of one training step, compiled (fast) and run."""
    model = FlaxUNet(spec=flax_bn["spec"], policy=policy)
    stats = flax_bn["variables"]["batch_stats"]

    def loss(params: dict, key: jax.Array) -> tuple[jax.Array, dict]:
        out, updates = model.apply(
            {"params": params, "batch_stats": stats},
            *flax_bn["inputs"],
            train=True,  # train: batch statistics, dropout on
            rngs={"dropout": key},
            mutable=["batch_stats"],
        )
        return jnp.mean(out * flax_bn["w"]), updates["batch_stats"]

    step = jax.jit(jax.value_and_grad(loss, has_aux=True))
    params, key = flax_bn["variables"]["params"], jax.random.key(3)
    (value, new_stats), grads = step.lower(params, key).compile(FAST_COMPILE)(params, key)
    return (float(value), traverse_util.flatten_dict(grads)), traverse_util.flatten_dict(new_stats)


@pytest.fixture(scope="module")
def flax_plain_step(flax_bn: dict) -> tuple[LossAndGrads, dict]:
    return _flax_train_step(flax_bn, "none")


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full"])  # one compile per policy (~10 s); "layers", "balanced" pass too
def test_flax_remat_updates_batch_stats_once(policy: str, flax_bn: dict, flax_plain_step: tuple) -> None:
    """`nn.remat` returns the mutated collection from the forward: no double update, no fix needed.

    Dropout is on here too. JAX has no ``preserve_rng_state`` switch: the dropout key is an input
    of the rematerialised function, so the recompute draws the same masks by construction and the
    gradients match the plain step's.
    """
    ref, ref_stats = flax_plain_step
    got, stats = _flax_train_step(flax_bn, policy)
    before = traverse_util.flatten_dict(flax_bn["variables"]["batch_stats"])
    assert stats.keys() == ref_stats.keys() == before.keys()
    for key, value in stats.items():
        assert not np.allclose(value, before[key]), key  # the statistics did move
        # the same update up to float32 rounding (XLA fuses the two programs differently); a
        # second update would be off by about (1 - m) = 90% of it
        assert rel_err(value - before[key], ref_stats[key] - before[key]) <= 1e-5, "/".join(key)
    # relative per leaf, or float32 noise on leaves that are 0 in exact arithmetic (to_k bias)
    scale = np.sqrt(sum(np.sum(np.square(g)) for g in ref[1].values()))
    assert_same_loss_and_grads(got, ref, tol=1e-4, atol=1e-6 * scale, loss_tol=1e-6)


def test_running_variance_convention_differs_by_bessel_factor() -> None:
    """torch's running_var takes the unbiased batch variance (n/(n-1)), Flax's the biased one."""
    from jax_impl.layers import batch_norm

    x = 3 * torch.randn(2, 4, 5, 3, generator=torch.Generator().manual_seed(4)) + 1
    n = 2 * 5 * 3  # elements per channel
    tnorm = nn.BatchNorm2d(4, momentum=MOMENTUM).train()
    tnorm(x)
    fnorm = batch_norm(1e-5, MOMENTUM)
    variables = fnorm.init(jax.random.key(0), _nhwc(x), use_running_average=True)
    _, updates = fnorm.apply(variables, _nhwc(x), use_running_average=False, mutable=["batch_stats"])
    mean, var = (np.asarray(updates["batch_stats"][k]) for k in ("mean", "var"))
    np.testing.assert_allclose(mean, tnorm.running_mean.numpy(), rtol=1e-5)
    # both start from var = 1: new = (1 - m) + m * batch_var
    torch_batch_var = (tnorm.running_var.numpy() - (1 - MOMENTUM)) / MOMENTUM
    flax_batch_var = (var - (1 - MOMENTUM)) / MOMENTUM
    np.testing.assert_allclose(torch_batch_var, flax_batch_var * n / (n - 1), rtol=1e-5)
    np.testing.assert_allclose(flax_batch_var, x.var(dim=(0, 2, 3), unbiased=False).numpy(), rtol=1e-5)


def _flax_apply(
    spec: object, variables: dict, x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor | None, train: bool
) -> tuple[np.ndarray, dict]:
    args = (variables, _nhwc(x), jnp.asarray(t.numpy()), None if ctx is None else jnp.asarray(ctx.numpy()))
    apply = functools.partial(FlaxUNet(spec=spec).apply, train=train, mutable=["batch_stats"])
    out, updates = jax.jit(apply).lower(*args).compile(FAST_COMPILE)(*args)  # one compile, not one per op
    return np.asarray(out).transpose(0, 3, 1, 2), traverse_util.flatten_dict(updates["batch_stats"])


def test_batchnorm_unet_parity_train_and_eval() -> None:
    """Train mode (batch statistics) and eval mode (converted running statistics) match torch."""
    tmodel = _bn_unet()
    spec, inputs = tmodel.spec, _torch_inputs(tmodel.spec)
    variables = torch_to_flax_variables(tmodel.state_dict(), spec)
    with torch.no_grad():
        ref = tmodel(*inputs).numpy()  # train mode: updates torch's running statistics once
    out, stats = _flax_apply(spec, variables, *inputs, train=True)
    assert np.abs(ref).mean() > 1e-2
    assert rel_err(out, ref) <= 1e-5
    # the running means agree; the running variances differ by n/(n-1) on the batch term, n = B*H*W
    # at the norm's resolution (8x8 or 4x4 here)
    sizes = {2 * s * s for s in (spec.sample_size, spec.sample_size // 2)}
    for (*path, leaf), value in stats.items():
        name = ".".join(path).replace("_", ".").replace("conv.norm.out", "conv_norm_out")
        torch_value = tmodel.get_buffer(f"{name}.running_{leaf}").numpy()
        if leaf == "mean":
            np.testing.assert_allclose(value, torch_value, rtol=1e-4, atol=1e-6, err_msg=name)
        else:
            ratio = np.median((torch_value - (1 - MOMENTUM)) / (value - (1 - MOMENTUM)))
            assert min(abs(ratio - n / (n - 1)) for n in sizes) <= 1e-4, (name, ratio)

    tmodel.eval()  # eval mode: torch's running statistics, converted
    with torch.no_grad():
        ref_eval = tmodel(*inputs).numpy()
    out_eval, _ = _flax_apply(spec, torch_to_flax_variables(tmodel.state_dict(), spec), *inputs, train=False)
    assert rel_err(ref_eval, ref) > 1e-3  # eval really differs from train
    assert rel_err(out_eval, ref_eval) <= 1e-5


def test_batchnorm_conversion_round_trip() -> None:
    tmodel = _bn_unet()
    _unet_step(tmodel)  # running statistics away from their initial values
    spec, state = tmodel.spec, tmodel.state_dict()
    variables = torch_to_flax_variables(state, spec)
    assert torch_to_flax(state, spec).keys() == variables["params"].keys()  # params only
    back = flax_to_torch(variables["params"], spec, variables["batch_stats"], num_batches_tracked=1)
    TorchUNet(spec).load_state_dict(back, strict=True)
    for key, value in state.items():
        assert torch.equal(back[key], value), key
    fresh = flax_to_torch(variables["params"], spec)  # no batch_stats: torch's initial statistics
    TorchUNet(spec).load_state_dict(fresh, strict=True)
    assert torch.equal(fresh["conv_norm_out.running_var"], torch.ones(spec.block_out_channels[0]))
    assert fresh["conv_norm_out.num_batches_tracked"].item() == 0
    bad = dict(variables["batch_stats"], conv_norm_out={"mean": np.zeros(3), "var": np.ones(3)})
    with pytest.raises(ValueError, match="batch_stats conv_norm_out/mean has shape"):
        flax_to_torch(variables["params"], spec, bad)


# --- dropout: the RNG state must be replayed in torch ---------------------------------------------


def test_torch_dropout_needs_preserved_rng_state() -> None:
    """Without ``preserve_rng_state`` the recompute draws new dropout masks: wrong gradients."""
    torch.manual_seed(0)
    model = TorchUNet(variant("tiny", dropout=0.3)).train()
    ref = _unet_step(model)
    got = {}
    for preserve in (True, False):
        model.enable_gradient_checkpointing("full", preserve_rng_state=preserve)
        got[preserve] = _unet_step(model)
        model.disable_gradient_checkpointing()
    assert_same_loss_and_grads(got[True], ref)  # bit for bit
    assert max(rel_err(g, ref[1][n]) for n, g in got[False][1].items()) > 1e-2


# --- reentrant checkpoint: silently no parameter gradients ---------------------------------------


def test_reentrant_checkpoint_drops_parameter_gradients() -> None:
    """Why `torch_impl.checkpointing` uses ``use_reentrant=False``.

    The U-Net's first block sees an input that does not require grad (the noisy image). The
    reentrant checkpoint then returns an output that does not require grad either, so its
    parameters get no gradient at all (only a warning); the non-reentrant one is correct.
    """
    torch.manual_seed(0)
    block, head = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.SiLU()), nn.Conv2d(4, 1, 1)
    x = torch.randn(2, 3, 8, 8)
    assert not x.requires_grad

    def block_grad(run: object) -> torch.Tensor | None:
        block.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
        head(run(x)).square().mean().backward()
        assert head.weight.grad is not None  # the rest of the model trains as usual
        return block[0].weight.grad

    plain = block_grad(block)
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad"):
        reentrant = block_grad(lambda v: checkpoint(block, v, use_reentrant=True))
    assert reentrant is None
    torch.testing.assert_close(block_grad(lambda v: checkpoint(block, v, use_reentrant=False)), plain)
