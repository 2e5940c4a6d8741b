"""Training regimes (`shared_configs.regime`): precision, LoRA, optimizers, EMA.

Each is held against an independent reference: LoRA against the plain model it starts as (and its
frozen weights against themselves), the EMA against its recurrence in float64, a checkpointed run
against the plain one in the same regime, half precision against float32, 8-bit AdamW's state
against AdamW's bytes, a resumed run against the uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import pytest
import torch

from shared_configs.regime import Regime
from shared_configs.spec import SpecError
from shared_configs.training.config import TrainConfig
from shared_configs.training.data import load_dataset, step_seed
from shared_configs.training.run_folder import RunFolderError
from tests.helpers.policies import LossAndGrads, assert_plans_keep_loss_and_grads, torch_loss_and_grads
from tests.helpers.specs import variant
from tests.helpers.tensors import rel_err
from tests.helpers.training import CFG, SCHEDULE
from torch_impl import train as ttrain
from torch_impl.regime import EMA, StepTools, add_lora, apply_regime, make_optimizer, step_tools

SPEC = variant("tiny", dropout=0.0)


def test_bad_regimes_are_one_line_naming_the_field_and_the_choices(capsys: pytest.CaptureFixture) -> None:
    for kwargs, words in [
        ({"precision": "fp8"}, "precision: expected one of fp32, bf16-mixed, fp16-mixed, bf16"),
        ({"trainable": "lora:0"}, "trainable: expected all or lora:R"),
        ({"optimizer": "sgd"}, "optimizer: expected one of adamw, adafactor, adamw8bit"),
    ]:
        with pytest.raises(SpecError, match=words):
            Regime(**kwargs)
    with pytest.raises(SystemExit) as exit_info:
        ttrain.parse_args(["--trainable", "lora:x"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "--trainable: expected all or lora:R" in err
    from jax_impl import train as jtrain

    cfg = jtrain.parse_args(["--precision", "bf16-mixed", "--trainable", "lora:8", "--optimizer", "adafactor", "--ema"])
    assert cfg.regime == Regime("bf16-mixed", "lora:8", "adafactor", True) and cfg.regime.lora_rank == 8


def _inputs(batch: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (
        torch.randn(batch, 4, 8, 8, generator=gen),
        torch.tensor([3.0, 700.0][:batch]),
        torch.randn(batch, 5, 12, generator=gen),
    )


def _model(policy: str = "none", lora: int | None = None) -> torch.nn.Module:
    from torch_impl import UNet

    torch.manual_seed(0)
    model = UNet(SPEC, policy)
    return add_lora(model, lora) if lora else model


def test_lora_starts_as_the_plain_model_and_trains_only_its_adapters() -> None:
    x, t, ctx = _inputs()
    plain, adapted = _model(), _model(lora=4)
    with torch.no_grad():
        assert torch.equal(plain(x, t, ctx), adapted(x, t, ctx))  # B = 0: the adapters add nothing yet
    frozen = {k: v.clone() for k, v in adapted.state_dict().items() if "lora_" not in k}
    optimizer = make_optimizer(adapted, 1e-2, 0.0, Regime(trainable="lora:4"))
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert trained == {id(p) for n, p in adapted.named_parameters() if "lora_" in n} and trained
    data = load_dataset("digits", SPEC)
    for step in range(2):
        ttrain.train_step(adapted, optimizer, data.batch(step, 2, SCHEDULE, 0))
    after = adapted.state_dict()
    assert all(torch.equal(after[k], v) for k, v in frozen.items())
    assert any(not torch.equal(after[k], v) for k, v in _model(lora=4).state_dict().items() if "lora_B" in k)


def _lora_step(policy: str) -> LossAndGrads:
    """Loss and gradients of the adapters (the only trained parameters) under ``policy``."""
    model = _model(policy, lora=4)
    for name, param in model.named_parameters():  # B non-zero, so the adapters shape the gradients
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1, generator=torch.Generator().manual_seed(hash(name) % 2**31))
    return torch_loss_and_grads(model, _inputs(), loss=lambda out: out.square().mean())


@pytest.mark.parametrize("policy", ["full", "layers/save=conv,matmul"])
def test_lora_gradients_under_a_plan_equal_the_plain_models(policy: str) -> None:
    _, grads = assert_plans_keep_loss_and_grads(_lora_step, [policy])  # bit for bit, the loss too
    assert grads and all("lora_" in name for name in grads)


def test_ema_follows_its_recurrence_in_float64() -> None:
    model = _model()
    optimizer, ema = make_optimizer(model, 1e-2, 0.0), EMA(model.parameters(), decay=0.9)
    reference = [p.detach().double().clone() for p in model.parameters()]
    data = load_dataset("digits", SPEC)
    for step in range(3):
        ttrain.train_step(model, optimizer, data.batch(step, 2, SCHEDULE, 0), tools=StepTools(ema=ema))
        reference = [0.9 * r + 0.1 * p.detach().double() for r, p in zip(reference, model.parameters(), strict=True)]
    assert all(rel_err(s.double(), r) <= 1e-6 for s, r in zip(ema.shadow, reference, strict=True))


def _curve(regime: Regime, policy: str, steps: int = 3) -> list[float]:
    cfg = dataclasses.replace(CFG, config="tiny", regime=regime)
    model = apply_regime(_model(policy), regime)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, regime)
    tools = step_tools(model, regime)
    data = load_dataset("digits", SPEC)
    return [ttrain.train_step(model, optimizer, data.batch(s, 4, SCHEDULE, 0), tools=tools) for s in range(steps)]


@pytest.mark.parametrize(
    ("regime", "tol"),
    [
        (Regime(optimizer="adafactor"), 1e-6),
        (Regime(trainable="lora:4", ema=True), 1e-6),
        (Regime(precision="bf16"), 0),  # the recompute runs the same bfloat16 ops: the same bits
    ],
    ids=["adafactor", "lora+ema", "bf16"],
)
def test_a_plan_keeps_the_loss_curve_in_each_regime(regime: Regime, tol: float) -> None:
    plain, planned = np.array(_curve(regime, "none")), np.array(_curve(regime, "full"))
    assert np.all(np.abs(planned - plain) <= tol * np.abs(plain)), (plain, planned)


@pytest.mark.slow
def test_fp16_mixed_trains_within_a_percent_of_fp32() -> None:
    fp32, fp16 = np.array(_curve(Regime(), "none")), np.array(_curve(Regime(precision="fp16-mixed"), "none"))
    assert np.all(np.abs(fp16 - fp32) <= 0.01 * fp32), (fp32, fp16)


@pytest.mark.slow
def test_adamw8bit_keeps_a_quarter_of_adamws_state() -> None:
    """torchao's AdamW8bit on this CPU: its two moments take 1 byte per value (+ block scales), AdamW's 4."""
    layer = torch.nn.Linear(256, 256)
    sizes = {}
    for name in ("adamw", "adamw8bit"):
        optimizer = make_optimizer(layer, 1e-3, 0.0, Regime(optimizer=name))
        layer(torch.randn(4, 256)).square().mean().backward()
        optimizer.step()
        state = optimizer.state[layer.weight]
        sizes[name] = sum(_nbytes(state[k]) for k in ("exp_avg", "exp_avg_sq"))
    assert sizes["adamw"] == 2 * 4 * 256 * 256
    assert 0.25 <= sizes["adamw8bit"] / sizes["adamw"] <= 0.27, sizes


def _nbytes(value: torch.Tensor) -> int:
    """Bytes of a tensor or of a torchao subclass (its codes and scales)."""
    inner = getattr(value, "__tensor_flatten__", None)
    if inner is None:
        return value.numel() * value.element_size()
    return sum(_nbytes(getattr(value, name)) for name in inner()[0])


@pytest.mark.slow
def test_a_resumed_run_in_a_regime_continues_the_curve(tmp_path: Path) -> None:
    """The EMA copy and the optimizer state of a regime are checkpointed: resume = uninterrupted."""
    base = TrainConfig(
        config="tiny",
        steps=4,
        checkpoint_every=2,
        sample_steps=0,
        batch_size=4,
        regime=Regime(trainable="lora:4", optimizer="adafactor", ema=True),
    )
    whole = ttrain.train(dataclasses.replace(base, out=str(tmp_path / "whole")))
    ttrain.train(dataclasses.replace(base, steps=2, out=str(tmp_path / "half")))
    resumed = ttrain.train(dataclasses.replace(base, out=str(tmp_path / "half"), resume=True))
    assert resumed == whole
    with pytest.raises(RunFolderError, match="--optimizer adamw"):  # a regime field is part of the curve
        adamw = dataclasses.replace(base.regime, optimizer="adamw")
        ttrain.train(dataclasses.replace(base, steps=6, regime=adamw, out=str(tmp_path / "half"), resume=True))


def test_jax_refuses_what_it_does_not_have_in_one_line() -> None:
    from jax_impl import regime as jregime

    with pytest.raises(SpecError, match="optimizer: adamw8bit has no JAX implementation"):
        jregime.make_optimizer(1e-3, 0.0, Regime(optimizer="adamw8bit"))


def _jax_run(regime: Regime, policy: str) -> tuple[object, object, object]:
    from jax_impl import regime as jregime
    from jax_impl import step as jstep
    from jax_impl.unet import UNet as FlaxUNet

    tx = jregime.make_optimizer(CFG.lr, CFG.weight_decay, regime)
    model = FlaxUNet(spec=SPEC, policy=policy)
    scale = jregime.LOSS_SCALE if regime.loss_scaling else None
    step = functools.partial(
        jstep.train_step, model=model, tx=tx, compute_dtype=jregime.DTYPES[regime.compute_dtype], loss_scale=scale
    )
    return model, tx, step


@pytest.mark.slow_for("fp16-mixed+adafactor")  # each traces a whole step (~5-15 s)
@pytest.mark.parametrize(
    "regime",
    [Regime(precision="bf16", ema=True), Regime("fp16-mixed", optimizer="adafactor")],
    ids=["bf16+ema", "fp16-mixed+adafactor"],
)
def test_jax_state_keeps_the_regimes_dtypes(regime: Regime) -> None:
    """Traced, not compiled: after a step the params (and their optimizer state) are in the regime's
    weight dtype, the EMA copy in float32."""
    import jax
    import jax.numpy as jnp

    from jax_impl import step as jstep

    model, tx, step = _jax_run(regime, "full")
    state = jax.eval_shape(lambda: jstep.init_state(model, tx, 0, regime))
    batch = jax.eval_shape(lambda: jstep.arrays(load_dataset("digits", SPEC).batch(0, 2, SCHEDULE, 0)))
    after, loss = jax.eval_shape(step, state, batch, jax.random.key(0))
    leaves = jax.tree.leaves((after.params, after.opt_state))
    floats = {str(x.dtype) for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)}
    assert floats == {regime.param_dtype} and str(loss.dtype) == "float32"
    assert (after.ema is not None) == regime.ema
    assert all(str(x.dtype) == "float32" for x in jax.tree.leaves(after.ema))


@pytest.mark.heavy
def test_jax_plan_keeps_the_curve_with_adafactor_and_ema() -> None:
    import jax

    from jax_impl import step as jstep

    regime, data, curves = Regime(optimizer="adafactor", ema=True), load_dataset("digits", SPEC), {}
    for policy in ("none", "full"):
        model, tx, step = _jax_run(regime, policy)
        state, losses = jstep.init_state(model, tx, 0, regime), []
        for s in range(3):
            state, loss = step(state, jstep.arrays(data.batch(s, 4, SCHEDULE, 0)), jax.random.key(step_seed(0, s)))
            losses.append(float(loss))
        curves[policy] = np.array(losses)
    assert np.all(np.abs(curves["full"] - curves["none"]) <= 1e-5 * curves["none"]), curves
