"""ControlNet in both frameworks against diffusers' ``ControlNetModel``: a ControlNet made with
``ControlNetModel.from_unet`` from a tiny random ``UNet2DConditionModel``, saved as a folder, loads
in torch (outputs to 1e-5, gradients equal diffusers') and in Flax (outputs to 1e-4, gradients
equal torch's after conversion); its options (scale, guess mode, pooling, bgr) match; plans name
its units as the U-Net's and leave gradients unchanged; it exports back.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_impl
from jax_impl.controlnet import ControlNet as FlaxControlNet
from jax_impl.controlnet import controlnet_from_unet
from jax_impl.convert import torch_to_flax
from jax_impl.diffusers_io import to_diffusers_state_dict
from shared_configs import SpecError, to_diffusers_config
from shared_configs.controlnet import ControlNetSpec, load_controlnet_spec, resolve_controlnet_plan
from shared_configs.diffusers.controlnet_config import controlnet_to_diffusers_config
from shared_configs.inputs import example_inputs
from tests.helpers.diffusers_ref import cache_repo
from tests.helpers.policies import (
    LossAndGrads,
    assert_plans_keep_loss_and_grads,
    jax_loss_and_grads,
    torch_loss_and_grads,
)
from tests.helpers.specs import variant
from tests.helpers.tensors import as_flax, as_torch, randomize_, rel_err
from torch_impl import ControlNet, UNet

WIDTHS = (8, 16)  # the conditioning embedding: the image at 2x the sample's size


def _diffusers_controlnet(name: str, **options: Any) -> torch.nn.Module:
    """``ControlNetModel.from_unet`` of a random diffusers U-Net of variant ``name``, every weight random."""
    import diffusers

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unet = diffusers.UNet2DConditionModel.from_config(to_diffusers_config(variant(name, dropout=0.0)))
        net = diffusers.ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=WIDTHS)
        if options:
            net = diffusers.ControlNetModel.from_config({**dict(net.config), **options})
    randomize_(net, seed=6)  # the zero convolutions too: a zero residual would hide every mistake
    return net.eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    net = _diffusers_controlnet("sdxl_style")
    root = tmp_path_factory.mktemp("controlnet")
    net.save_pretrained(root)
    return root, net


def _inputs(spec: ControlNetSpec) -> dict[str, Any]:
    """NCHW numpy inputs: the U-Net's, and a conditioning image at `conditioning_factor` x the size."""
    inputs = example_inputs(spec.unet, np.random.default_rng(3), batch=2, sample_size=8, context_len=3)
    inputs["t"] = np.array([11.0, 860.0], dtype=np.float32)
    x = inputs["x"]
    size = x.shape[2] * spec.conditioning_factor
    inputs["cond"] = np.random.default_rng(4).standard_normal((2, spec.conditioning_channels, size, size), np.float32)
    return inputs


def _theirs(net: torch.nn.Module, inputs: dict[str, Any], **kw: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
    named = as_torch(inputs)
    extra = {}
    if named.get("text_embeds") is not None:
        extra["added_cond_kwargs"] = {"text_embeds": named["text_embeds"], "time_ids": named["time_ids"]}
    down, mid = net(named["x"], named["t"], named["context"], named["cond"], return_dict=False, **extra, **kw)
    return list(down), mid


def _ours(model: ControlNet, inputs: dict[str, Any], **kw: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
    named = as_torch(inputs)
    x, t, ctx, cond = (named.pop(k) for k in ("x", "t", "context", "cond"))
    return model(x, t, ctx, cond, **named, **kw)


def _worst(ours: tuple[list, Any], theirs: tuple[list, Any]) -> float:
    pairs = [*zip(ours[0], theirs[0], strict=True), (ours[1], theirs[1])]
    return max(rel_err(np.asarray(a), np.asarray(b)) for a, b in pairs)


@pytest.mark.parametrize("kw", [{}, {"conditioning_scale": 0.6}, {"conditioning_scale": 0.6, "guess_mode": True}])
def test_torch_loads_a_diffusers_folder_with_equal_outputs(folder: tuple[Path, Any], kw: dict[str, Any]) -> None:
    root, net = folder
    model = ControlNet.from_diffusers(root)
    inputs = _inputs(model.spec)
    with torch.no_grad():
        theirs, ours = _theirs(net, inputs, **kw), _ours(model, inputs, **kw)
    assert len(ours[0]) == len(theirs[0]) == len(model.controlnet_down_blocks)
    assert _worst(ours, theirs) <= 1e-5


@pytest.mark.parametrize(
    "options", [{"global_pool_conditions": True}, {"controlnet_conditioning_channel_order": "bgr"}]
)
def test_torch_options_match_diffusers(options: dict[str, Any]) -> None:
    net = _diffusers_controlnet("sd_linear_proj", **options)
    model = ControlNet.from_diffusers(net)
    inputs = _inputs(model.spec)
    with torch.no_grad():
        assert _worst(_ours(model, inputs, guess_mode=True), _theirs(net, inputs, guess_mode=True)) <= 1e-5


def _loss(down: list[torch.Tensor], mid: torch.Tensor) -> torch.Tensor:
    # weights that differ per residual and position: a swapped residual or channel changes the loss
    return sum((r * torch.linspace(-1, 1, r.numel()).reshape(r.shape)).sum() for r in [*down, mid])


def test_torch_gradients_equal_diffusers(folder: tuple[Path, Any]) -> None:
    root, net = folder
    model = ControlNet.from_diffusers(root).train()
    inputs = _inputs(model.spec)
    _loss(*_ours(model, inputs, conditioning_scale=0.8)).backward()
    net.zero_grad()
    _loss(*_theirs(net.train(), inputs, conditioning_scale=0.8)).backward()
    theirs = {k: p.grad for k, p in net.named_parameters()}
    ours = model.to_diffusers_state_dict()  # names only: the gradients are read by the same names
    grads = dict(zip(ours, (p.grad for p in model.state_dict(keep_vars=True).values()), strict=True))
    assert set(grads) == set(theirs)
    worst = max(rel_err(g, theirs[name]) for name, g in grads.items())  # per tensor, by norm
    assert worst <= 1e-5, worst


@pytest.mark.slow
def test_flax_loads_a_diffusers_folder_and_gradients_equal_torch(folder: tuple[Path, Any]) -> None:
    root, net = folder
    module, params = jax_impl.controlnet_from_diffusers(root)
    inputs = _inputs(module.spec)
    flax_in = as_flax(inputs)
    cond = jnp.asarray(inputs["cond"].transpose(0, 2, 3, 1))
    rest = {k: v for k, v in flax_in.items() if k not in ("x", "t", "context", "cond")}

    def run(p: dict) -> tuple[list[jax.Array], jax.Array]:
        return module.apply({"params": p}, flax_in["x"], flax_in["t"], flax_in["context"], cond, 0.8, **rest)

    down, mid = run(params)
    with torch.no_grad():
        theirs = _theirs(net, inputs, conditioning_scale=0.8)
    nchw = ([np.asarray(r).transpose(0, 3, 1, 2) for r in down], np.asarray(mid).transpose(0, 3, 1, 2))
    assert _worst(nchw, theirs) <= 1e-4

    def loss(p: dict) -> jax.Array:
        d, m = run(p)
        return sum(jnp.sum(r * _ramp(r.transpose(0, 3, 1, 2).shape).transpose(0, 2, 3, 1)) for r in [*d, m])

    grads = jax.grad(loss)(params)
    model = ControlNet.from_diffusers(root).train()
    _loss(*_ours(model, inputs, conditioning_scale=0.8)).backward()
    want = torch_to_flax({k: p.grad for k, p in model.named_parameters()}, model.spec)
    flat_got, flat_want = jax.tree.leaves(grads), jax.tree.leaves(want)
    assert jax.tree.structure(grads) == jax.tree.structure(want)
    assert max(rel_err(a, b) for a, b in zip(flat_got, flat_want, strict=True)) <= 1e-4


def _ramp(shape: tuple[int, ...]) -> jax.Array:
    return jnp.linspace(-1, 1, int(np.prod(shape))).reshape(shape)


def _step(spec: ControlNetSpec, policy: str) -> LossAndGrads:
    torch.manual_seed(0)
    model = ControlNet(spec, policy=policy).train()
    randomize_(model, seed=2)
    return torch_loss_and_grads(
        lambda **kw: _ours(model, kw), _inputs(spec), loss=lambda out: _loss(*out), wrt=dict(model.named_parameters())
    )


@pytest.mark.parametrize("policy", ["full", "layers", "down.0;down.1.resnets.0,mid/save=conv,matmul"])
def test_torch_plans_leave_gradients_unchanged(policy: str) -> None:
    spec = ControlNetSpec(unet=variant("sd_linear_proj", dropout=0.0), conditioning_embedding_out_channels=WIDTHS)
    assert_plans_keep_loss_and_grads(lambda p: _step(spec, p), [policy])  # bit for bit


def test_plans_name_the_units_as_the_unets() -> None:
    spec = ControlNetSpec(unet=variant("sd_linear_proj", dropout=0.0), conditioning_embedding_out_channels=WIDTHS)
    assert resolve_controlnet_plan(spec, "full").recompute == ("down.0", "down.1", "mid")
    assert ControlNet(spec).block_names() == ["down.0", "down.1", "mid"]
    assert all(not n.startswith("up.") for n in resolve_controlnet_plan(spec, "layers").recompute)
    model = ControlNet(spec, policy="down.1,mid")
    from tests.helpers.policies import checkpointed_names

    assert checkpointed_names(model) == ["down.1", "mid"]
    with pytest.raises(SpecError, match=r"a ControlNet has no unit 'up\.0'"):
        resolve_controlnet_plan(spec, "down.1,up.0")


@pytest.mark.heavy  # minutes of CPU: left out of the default run
def test_flax_parameter_tree_and_gradients_are_the_same_under_plans() -> None:
    spec = ControlNetSpec(unet=variant("sd_linear_proj", dropout=0.0), conditioning_embedding_out_channels=WIDTHS)
    inputs = _inputs(spec)
    named = as_flax(inputs)
    args = (named["x"], named["t"], named["context"], jnp.asarray(inputs["cond"].transpose(0, 2, 3, 1)))
    params = FlaxControlNet(spec=spec).init(jax.random.key(0), *args)["params"]
    keys = iter(jax.random.split(jax.random.key(2), len(jax.tree.leaves(params))))
    params = jax.tree.map(lambda p: p + 0.2 * jax.random.normal(next(keys), p.shape), params)  # zero convs too

    def step(policy: str) -> LossAndGrads:
        module = FlaxControlNet(spec=spec, policy=policy)
        tree = jax.eval_shape(module.init, jax.random.key(0), *args)["params"]
        assert jax.tree.structure(tree) == jax.tree.structure(params)

        def loss(p: dict) -> jax.Array:
            down, mid = module.apply({"params": p}, *args)
            return sum(jnp.sum(r * _ramp(r.shape)) for r in [*down, mid])

        return jax_loss_and_grads(loss, params)

    policies = ("full", "down.0;down.1.resnets.0,mid/save=conv,matmul")
    assert_plans_keep_loss_and_grads(step, policies, tol=1e-5, atol=1e-6, loss_tol=1e-6)


@pytest.mark.slow
def test_export_loads_into_diffusers(folder: tuple[Path, Any], tmp_path: Path) -> None:
    import diffusers

    root, net = folder
    model = ControlNet.from_diffusers(root)
    out = model.save_diffusers(tmp_path / "cn")
    back = diffusers.ControlNetModel.from_pretrained(out).eval()
    inputs = _inputs(model.spec)
    with torch.no_grad():
        assert _worst(_theirs(back, inputs), _theirs(net, inputs)) == 0.0
    assert controlnet_to_diffusers_config(model.spec)["conditioning_embedding_out_channels"] == list(WIDTHS)
    flax_state = to_diffusers_state_dict(torch_to_flax(model.state_dict(), model.spec), model.spec)
    back.load_state_dict(flax_state, strict=True)


def test_residuals_drive_our_unet_as_diffusers(folder: tuple[Path, Any]) -> None:
    """The pair: our ControlNet's residuals into our U-Net equal diffusers' pair on the same weights."""
    import diffusers

    root, net = folder
    model = ControlNet.from_diffusers(root)
    unet = UNet(model.spec.unet).eval()
    randomize_(unet, seed=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs_unet = diffusers.UNet2DConditionModel.from_config(to_diffusers_config(unet.spec))
    theirs_unet.load_state_dict(unet.to_diffusers_state_dict(), strict=True)
    inputs = _inputs(model.spec)
    named = as_torch(inputs)
    cond = {"text_embeds": named["text_embeds"], "time_ids": named["time_ids"]}
    with torch.no_grad():
        down, mid = _theirs(net, inputs)
        ref = theirs_unet(
            named["x"],
            named["t"],
            named["context"],
            added_cond_kwargs=cond,
            down_block_additional_residuals=down,
            mid_block_additional_residual=mid,
        ).sample
        down, mid = _ours(model, inputs)
        out = unet(
            named["x"],
            named["t"],
            named["context"],
            **cond,
            down_block_additional_residuals=down,
            mid_block_additional_residual=mid,
        )
    assert rel_err(out, ref) <= 1e-5


def test_from_unet_copies_the_encoder_and_starts_at_zero() -> None:
    spec = variant("sd_linear_proj", dropout=0.0)
    unet = UNet(spec)
    randomize_(unet, seed=1)
    model = ControlNet.from_unet(unet, conditioning_embedding_out_channels=WIDTHS)
    assert torch.equal(model.down[1].resnets[0].conv1.weight, unet.down[1].resnets[0].conv1.weight)
    with torch.no_grad():
        down, mid = _ours(model, _inputs(model.spec))
    assert all(not r.any() for r in down) and not mid.any()


@pytest.mark.slow
def test_flax_from_unet_copies_the_encoder_and_starts_at_zero() -> None:
    spec = variant("sd_linear_proj", dropout=0.0)
    unet = UNet(spec)
    randomize_(unet, seed=1)
    unet_params = torch_to_flax(unet.state_dict(), spec)
    module, params = controlnet_from_unet(unet_params, spec, conditioning_embedding_out_channels=WIDTHS)
    torch_params = torch_to_flax(
        ControlNet.from_unet(unet, conditioning_embedding_out_channels=WIDTHS).state_dict(), module.spec
    )
    assert jax.tree.structure(params) == jax.tree.structure(torch_params)
    np.testing.assert_array_equal(
        params["down_1"]["resnets_0"]["conv1"]["kernel"], unet_params["down_1"]["resnets_0"]["conv1"]["kernel"]
    )
    inputs = _inputs(module.spec)
    named = as_flax(inputs)
    cond = jnp.asarray(inputs["cond"].transpose(0, 2, 3, 1))
    down, mid = module.apply({"params": params}, named["x"], named["t"], named["context"], cond)
    assert all(not np.asarray(r).any() for r in [*down, mid])


def test_spec_takes_a_preset_and_refuses_what_diffusers_cannot_build() -> None:
    spec = load_controlnet_spec({"unet": "sd_narrow", "conditioning_embedding_out_channels": [16, 32]})
    assert spec.unet.name == "sd_narrow" and spec.conditioning_factor == 2
    with pytest.raises(SpecError, match=r"has no diffusers equivalent: dropout="):
        controlnet_to_diffusers_config(ControlNetSpec(unet=variant("sd_linear_proj", dropout=0.1)))
    with pytest.raises(SpecError, match=r"^conditioning_embedding_out_channels: must be positive$"):
        load_controlnet_spec({"unet": "tiny", "conditioning_embedding_out_channels": [8, 0]})
    with pytest.raises(SpecError, match=r"^global_pool_conditions: Input should be a valid boolean"):
        load_controlnet_spec({"unet": "tiny", "global_pool_conditions": "yes"})


def test_loads_from_a_cached_pipeline_repo(
    folder: tuple[Path, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A repo id in the local Hugging Face cache, its ControlNet in ``controlnet/`` (as pipelines save it)."""
    root, net = folder
    cache_repo(tmp_path / "hub", "org/sd-controlnet", root, subfolder="controlnet")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    model = ControlNet.from_diffusers("org/sd-controlnet", subfolder="controlnet")
    assert model.spec.name == "sd-controlnet"
    inputs = _inputs(model.spec)
    with torch.no_grad():
        assert _worst(_ours(model, inputs), _theirs(net, inputs)) <= 1e-5


def test_wrong_sources_and_inputs_are_one_line(folder: tuple[Path, Any]) -> None:
    root, _ = folder
    with pytest.raises(ValueError, match=r"is a diffusers ControlNetModel: load it with ControlNet\.from_diffusers"):
        UNet.from_diffusers(root)
    model = ControlNet.from_diffusers(root)
    inputs = _inputs(model.spec)
    inputs["cond"] = inputs["cond"][:, :, :8, :8]
    with pytest.raises(ValueError, match=r"controlnet_cond: expected NCHW shape \(2, 3, 16, 16\)"):
        _ours(model, inputs)
