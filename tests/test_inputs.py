"""The U-Nets' inputs: shapes per spec, example arrays, and one-line errors at the edge of both forwards.

Every bad input is checked in both frameworks, shapes only: torch on the meta device, Flax under
``jax.eval_shape``, so no weights are ever allocated.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_impl import UNet as FlaxUNet
from shared_configs import UNetSpec, load_spec, spec_from_dict
from shared_configs.inputs import INPUT_NAMES, example_inputs, input_specs
from tests.helpers.specs import TINY, VARIANTS, variant
from tests.helpers.tensors import as_flax, as_torch
from torch_impl import UNet as TorchUNet

# tiny, with every conditioning input: context (B, L, 12), class ids, text_embeds (B, 18) + time_ids (B, 3)
CONDITIONED = spec_from_dict(
    {
        **TINY,
        **VARIANTS["sdxl_style"],
        "name": "conditioned",
        "class_embedding": {"kind": "embedding", "num_classes": 10},
    }
)


def test_input_specs_per_family() -> None:
    sdxl = input_specs(load_spec("sdxl"), batch=2)
    assert {k: v.shape for k, v in sdxl.items() if v is not None} == {
        "x": (2, 4, 128, 128),
        "t": (2,),
        "context": (2, 77, 2048),
        "text_embeds": (2, 1280),
        "time_ids": (2, 6),
    }
    assert sdxl["class_labels"] is None and list(sdxl) == list(INPUT_NAMES)
    ddpm = input_specs(load_spec("ddpm_cifar10"), batch=3, sample_size=16, layout="NHWC")
    assert [k for k, v in ddpm.items() if v is not None] == ["x", "t"] and ddpm["x"].shape == (3, 16, 16, 3)
    classes = {
        "embedding": ((1,), "int32"),
        "timestep": ((1,), "int32"),
        "identity": ((1, 64), "float32"),  # the time embedding's width, 4 x 16
        "projection": ((1, 7), "float32"),
        "simple_projection": ((1, 7), "float32"),
    }
    for kind, (shape, dtype) in classes.items():
        fields = {"kind": kind, "num_classes": 5 if kind == "embedding" else None}
        fields["input_dim"] = 7 if "projection" in kind else None
        labels = input_specs(variant("tiny", class_embedding=fields))["class_labels"]
        assert (labels.shape, labels.dtype) == (shape, dtype), kind


def test_example_inputs_are_in_range_and_seeded() -> None:
    a = example_inputs(CONDITIONED, np.random.default_rng(0), batch=4, context_len=5)
    b = example_inputs(CONDITIONED, np.random.default_rng(0), batch=4, context_len=5)
    assert all(np.array_equal(a[k], b[k]) for k in INPUT_NAMES)
    assert a["class_labels"].dtype == np.int32 and a["class_labels"].min() >= 0 and a["class_labels"].max() < 10
    assert a["t"].min() >= 0 and a["t"].max() < 1000 and a["context"].shape == (4, 5, 12)
    assert np.array_equal(a["time_ids"], np.round(a["time_ids"]))  # sizes and crops: whole numbers
    nhwc = example_inputs(CONDITIONED, np.random.default_rng(0), batch=4, context_len=5, layout="NHWC")
    np.testing.assert_array_equal(nhwc["x"], a["x"].transpose(0, 2, 3, 1))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch": 0}, "batch: expected a positive integer, got 0"),
        ({"sample_size": 7}, "sample_size: 7 is not divisible by the downsampling factor 2"),
        ({"context_len": True}, "context_len: expected a positive integer, got True"),
        ({"layout": "CHW"}, "layout: expected one of NCHW, NHWC, got 'CHW'"),
    ],
)
def test_bad_example_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        input_specs(CONDITIONED, **kwargs)
    assert str(info.value) == message


def test_both_forwards_take_every_input_by_name() -> None:
    """The same inputs, by name, in both frameworks: all accepted (a positive control for the cases below)."""
    inputs = example_inputs(CONDITIONED, np.random.default_rng(0), batch=2, context_len=3)
    assert _torch_error(CONDITIONED, inputs) is None
    assert _flax_error(CONDITIONED, _nhwc(inputs)) is None


def _torch_error(spec: UNetSpec, inputs: dict[str, Any]) -> str | None:
    with torch.device("meta"):
        model = TorchUNet(spec)
        try:
            model(**{k: None if v is None else v.to("meta") for k, v in as_torch(inputs).items()})
        except ValueError as err:
            return str(err)
    return None


def _flax_error(spec: UNetSpec, inputs: dict[str, Any], **module_kwargs: Any) -> str | None:
    """The Flax U-Net's error on ``inputs`` (x given to it exactly as in ``inputs``), or None."""
    arrays = {k: None if v is None else jnp.asarray(v) for k, v in inputs.items()}
    try:
        jax.eval_shape(FlaxUNet(spec=spec, **module_kwargs).init, jax.random.key(0), **arrays)
    except ValueError as err:
        return str(err)
    return None


def _nhwc(inputs: dict[str, Any]) -> dict[str, Any]:
    x = inputs["x"]
    return {**inputs, "x": x.transpose(0, 2, 3, 1) if x.ndim == 4 else x}


def _case(**changes: Any) -> dict[str, Any]:
    inputs = example_inputs(CONDITIONED, np.random.default_rng(0), batch=2, context_len=3)
    return {**inputs, **changes}


F32 = np.float32
SPEC = "spec 'conditioned'"
# (id, the inputs changed, the message; {layout}, {want}, {shape} are x's in each framework)
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("t_batch", {"t": np.zeros(3, F32)}, "t: expected a scalar or shape (2,) (one timestep per sample), got (3,)"),
    (
        "context_width",
        {"context": np.zeros((2, 3, 10), F32)},
        "context: expected shape (B, L, 12) with B=2, got (2, 3, 10)",
    ),
    (
        "context_batch",
        {"context": np.zeros((3, 3, 12), F32)},
        "context: expected shape (B, L, 12) with B=2, got (3, 3, 12)",
    ),
    ("context_missing", {"context": None}, f"context: {SPEC} has cross-attention; pass context of shape (B, L, 12)"),
    (
        "labels_missing",
        {"class_labels": None},
        f"class_labels: {SPEC} has a class embedding; pass class_labels of shape (B,)",
    ),
    (
        "labels_float",
        {"class_labels": np.zeros(2, F32)},
        "class_labels: expected integer class ids of shape (B,), got dtype float32",
    ),
    (
        "labels_shape",
        {"class_labels": np.zeros((2, 1), np.int32)},
        "class_labels: expected shape (B,) with B=2, got (2, 1)",
    ),
    (
        "text_missing",
        {"text_embeds": None},
        f"text_embeds: {SPEC} has text_time conditioning; pass text_embeds of shape (B, D)",
    ),
    ("time_ids_batch", {"time_ids": np.zeros((1, 3), F32)}, "time_ids: expected shape (B, N) with B=2, got (1, 3)"),
    (
        "text_time_widths",
        {"text_embeds": np.zeros((2, 17), F32)},
        "text_embeds, time_ids: widths 17 + 3 x 4 = 29 must equal addition_embedding.input_dim=30 "
        "(e.g. text_embeds (B, 18) and time_ids (B, 3))",
    ),
    ("x_3d", {"x": np.zeros((2, 4, 8), F32)}, "x: expected a 4-D {layout} array {want}, got shape (2, 4, 8)"),
    (
        "x_7x7",
        {"x": np.zeros((2, 4, 7, 7), F32)},
        "x: spatial size 7x7 is not divisible by the downsampling factor 2 (2 levels)",
    ),
    (
        "x_channels",
        {"x": np.zeros((2, 3, 8, 8), F32)},
        "x: expected {layout} {want} with in_channels=4, got shape {shape}",
    ),
]


@pytest.mark.parametrize(("changes", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_in_both_frameworks(changes: dict[str, Any], message: str) -> None:
    inputs = _case(**changes)
    nhwc = _nhwc(inputs)
    torch_message = message.format(layout="NCHW", want="(B, 4, H, W)", shape=inputs["x"].shape)
    assert _torch_error(CONDITIONED, inputs) == torch_message
    flax_message = message.format(layout="NHWC", want="(B, H, W, 4)", shape=nhwc["x"].shape)
    assert _flax_error(CONDITIONED, nhwc) == flax_message


def test_swapped_layouts_get_a_hint() -> None:
    hint = "it looks like {}: torch_impl.UNet takes NCHW, jax_impl.UNet NHWC"
    nhwc = _case(x=np.zeros((2, 8, 8, 4), F32))
    assert _torch_error(CONDITIONED, nhwc).endswith(f"got shape (2, 8, 8, 4); {hint.format('NHWC')}")
    nchw = _case(x=np.zeros((2, 4, 8, 8), F32))  # given to Flax as it is
    assert _flax_error(CONDITIONED, nchw).endswith(f"got shape (2, 4, 8, 8); {hint.format('NCHW')}")


@pytest.mark.parametrize("name", ["context", "class_labels", "text_embeds", "time_ids"])
def test_conditioning_a_spec_does_not_take_is_an_error(name: str) -> None:
    """Silently ignoring it would train a model that never sees the condition."""
    spec = variant("ddpm_style", dropout=0.0)  # no cross-attention, no class or text_time embedding
    inputs = example_inputs(spec, np.random.default_rng(0), batch=2)
    inputs[name] = np.zeros((2, 3, 5) if name == "context" else (2,), np.int32 if name == "class_labels" else F32)
    field = {"context": "cross_attention_dim", "class_labels": "class_embedding"}.get(name, "addition_embedding")
    message = f"{name}: spec 'ddpm_style' takes none ({field} is not set); pass {name}=None"
    assert _torch_error(spec, inputs) == message
    assert _flax_error(spec, _nhwc(inputs)) == message


def test_flax_attention_chunk_and_positional_train() -> None:
    inputs = example_inputs(CONDITIONED, np.random.default_rng(0), batch=2, context_len=3)
    assert _flax_error(CONDITIONED, _nhwc(inputs), attention_chunk=0) == (
        "attention_chunk: expected a positive number of queries or None, got 0"
    )
    spec = variant("tiny", dropout=0.0)
    inputs = as_flax(example_inputs(spec, np.random.default_rng(0), batch=2, context_len=3))
    with pytest.raises(ValueError, match=r"^class_labels: got a bool; pass train by keyword: apply\(variables, x, t"):
        jax.eval_shape(FlaxUNet(spec=spec).init, jax.random.key(0), inputs["x"], inputs["t"], inputs["context"], True)
