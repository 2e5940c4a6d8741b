"""The U-Net's inputs, framework-free: `input_specs` (shapes and dtypes, `INPUT_NAMES` then the extras a spec
takes), `example_inputs` (random arrays) and `check_inputs` (each forward's one-line `ValueError`). ``x`` is NCHW
in torch and NHWC in Flax. The table of inputs: docs/spec_and_plans.md "Inputs".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shared_configs.spec import AdditionEmbeddingSpec, UNetSpec

INPUT_NAMES: tuple[str, ...] = ("x", "t", "context", "class_labels", "text_embeds", "time_ids")
EXTRA_INPUT_NAMES: tuple[str, ...] = ("timestep_cond", "image_embeds")  # present only where the spec takes them
LAYOUTS: tuple[str, ...] = ("NCHW", "NHWC")
LATENT_SCALE = 8  # SDXL's time_ids are in pixels: a latent of size s is an image of size 8 s
NUM_TIMESTEPS = 1000  # example timesteps (and `timestep` class ids) are drawn from [0, NUM_TIMESTEPS)


@dataclass(frozen=True)
class InputSpec:
    """The shape and numpy dtype name (``"float32"``, ``"int32"``) of one input."""

    shape: tuple[int, ...]
    dtype: str


def input_specs(
    spec: UNetSpec, batch: int = 1, sample_size: int | None = None, context_len: int = 77, layout: str = "NCHW"
) -> dict[str, InputSpec | None]:
    """Every forward input of ``spec`` in `INPUT_NAMES` order (None where it takes none), then its extra inputs."""
    size = spec.sample_size if sample_size is None else sample_size
    _check_args(spec, batch, size, context_len, layout)
    f32 = "float32"
    x = (batch, spec.in_channels, size, size) if layout == "NCHW" else (batch, size, size, spec.in_channels)
    specs: dict[str, InputSpec | None] = dict.fromkeys(INPUT_NAMES)
    specs["x"], specs["t"] = InputSpec(x, f32), InputSpec((batch,), f32)
    if (width := spec.context_input_dim) is not None:
        specs["context"] = InputSpec((batch, context_len, width), f32)
    if spec.class_embedding is not None:
        width = class_label_width(spec)
        specs["class_labels"] = InputSpec((batch,), "int32") if width is None else InputSpec((batch, width), f32)
    if (add := spec.addition_embedding) is not None:
        specs |= {
            "text_embeds": InputSpec((batch, add.text_embeds_dim), f32),
            "time_ids": InputSpec((batch, add.num_time_ids), f32),
        }
    if (cond := spec.time_embedding.cond_dim) is not None:
        specs["timestep_cond"] = InputSpec((batch, cond), f32)
    if (img := spec.image_embedding) is not None:
        specs["image_embeds"] = InputSpec((batch, img.input_dim), f32)
    return specs


def example_inputs(
    spec: UNetSpec,
    rng: np.random.Generator,
    batch: int = 2,
    sample_size: int | None = None,
    context_len: int = 77,
    layout: str = "NCHW",
) -> dict[str, np.ndarray | None]:
    """Random numpy inputs for ``spec`` in `INPUT_NAMES` order; a seed gives the same sample in either layout."""
    wanted = input_specs(spec, batch, sample_size, context_len, "NCHW")
    arrays = {name: None if want is None else _draw(name, want, spec, rng) for name, want in wanted.items()}
    if layout == "NHWC":  # the same draws in either layout: one seed, one sample
        arrays["x"] = np.ascontiguousarray(arrays["x"].transpose(0, 2, 3, 1))
    return arrays


def _draw(name: str, want: InputSpec, spec: UNetSpec, rng: np.random.Generator) -> np.ndarray:
    if name == "t":
        return rng.uniform(0, NUM_TIMESTEPS, want.shape).astype(np.float32)
    if name == "time_ids":
        return rng.integers(0, 1024, want.shape).astype(np.float32)
    if want.dtype == "int32":  # class ids
        assert spec.class_embedding is not None
        return rng.integers(0, spec.class_embedding.num_classes or NUM_TIMESTEPS, want.shape).astype(np.int32)
    return rng.standard_normal(want.shape, dtype=np.float32)


def class_label_width(spec: UNetSpec) -> int | None:
    """``class_labels``' trailing width: None for class ids (B,), else the vectors' width (B, D)."""
    ce = spec.class_embedding
    if ce is None or ce.kind in ("embedding", "timestep"):
        return None
    return spec.time_embed_dim if ce.kind == "identity" else ce.input_dim


def _check_args(spec: UNetSpec, batch: int, size: int, context_len: int, layout: str) -> None:
    factor = 2 ** (spec.num_levels - 1)
    for name, value in (("batch", batch), ("sample_size", size), ("context_len", context_len)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: expected a positive integer, got {value!r}")
    if size % factor:
        raise ValueError(f"sample_size: {size} is not divisible by the downsampling factor {factor}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {', '.join(LAYOUTS)}, got {layout!r}")


def check_inputs(spec: UNetSpec, layout: str, x: Any, t: Any, **conditioning: Any) -> None:
    """Raise one `ValueError` naming the input, what ``spec`` expects and what came: shapes only (static under
    ``jit``), of either framework's arrays; ``conditioning``: the other inputs by name, None when absent."""
    for name, value in {"x": x, **conditioning}.items():
        is_bool = isinstance(value, bool) or str(getattr(value, "dtype", "")) == "bool"
        if is_bool and name != "encoder_attention_mask":  # `train` given positionally?
            raise ValueError(f"{name}: got a bool; pass train by keyword: apply(variables, x, t, ..., train=True)")
        if value is not None and not hasattr(value, "shape"):
            raise ValueError(f"{name}: expected an array, got {type(value).__name__} {value!r}")
    batch = _check_x(spec, layout, tuple(x.shape))
    t_shape = tuple(getattr(t, "shape", ()))
    if t_shape not in ((), (batch,), (1,)):
        raise ValueError(f"t: expected a scalar or shape ({batch},) (one timestep per sample), got {t_shape}")
    wanted = input_specs(spec, batch, context_len=1)  # context length is free: checked below without it
    for name in INPUT_NAMES[2:] + EXTRA_INPUT_NAMES:
        _check_optional(spec, name, wanted.get(name), conditioning.get(name))
    if (add := spec.addition_embedding) is not None:
        _check_text_time(add, conditioning["text_embeds"].shape, conditioning["time_ids"].shape)
    _check_mask(spec, batch, conditioning.get("context"), conditioning.get("encoder_attention_mask"))


def _check_x(spec: UNetSpec, layout: str, shape: tuple[int, ...]) -> int:
    c = spec.in_channels
    want = f"(B, {c}, H, W)" if layout == "NCHW" else f"(B, H, W, {c})"
    if len(shape) != 4:
        raise ValueError(f"x: expected a 4-D {layout} array {want}, got shape {shape}")
    channels, spatial = (shape[1], shape[2:]) if layout == "NCHW" else (shape[3], shape[1:3])
    if channels != c:
        other = "NHWC" if layout == "NCHW" else "NCHW"
        swapped = shape[3] == c if layout == "NCHW" else shape[1] == c
        hint = f"; it looks like {other}: torch_impl.UNet takes NCHW, jax_impl.UNet NHWC" if swapped else ""
        raise ValueError(f"x: expected {layout} {want} with in_channels={c}, got shape {shape}{hint}")
    factor = 2 ** (spec.num_levels - 1)
    if any(s % factor for s in spatial):
        raise ValueError(
            f"x: spatial size {spatial[0]}x{spatial[1]} is not divisible by the downsampling factor "
            f"{factor} ({spec.num_levels} levels)"
        )
    return shape[0]


# Which spec field makes each conditioning input needed, and what it gives the model.
_NEEDS = {
    "context": ("cross_attention_dim", "cross-attention"),
    "class_labels": ("class_embedding", "a class embedding"),
    **dict.fromkeys(("text_embeds", "time_ids"), ("addition_embedding", "text_time conditioning")),
    "timestep_cond": ("time_embedding.cond_dim", "a timestep condition"),
    "image_embeds": ("image_embedding", "image conditioning"),
}
OPTIONAL = ("timestep_cond",)  # taken, but may be None (diffusers then adds nothing)
# Dimensions an input may size freely (named as in the messages): the context's token count, and
# text_embeds / time_ids widths, which are checked together (`_check_text_time`).
_FREE: dict[str, dict[int, str]] = {"context": {1: "L"}, "text_embeds": {1: "D"}, "time_ids": {1: "N"}}


def _check_optional(spec: UNetSpec, name: str, want: InputSpec | None, value: Any) -> None:
    field, what = _NEEDS[name]
    if want is None and value is not None:
        made = name == "context" and spec.cross_attention_dim is not None
        field = "image_embedding.context_tokens makes it from image_embeds" if made else f"{field} is not set"
        raise ValueError(f"{name}: spec {spec.name!r} takes none ({field}); pass {name}=None")
    if want is None or (value is None and name in OPTIONAL):
        return
    free = _FREE.get(name, {})
    shape = "(" + ", ".join(["B", *(free.get(i, str(s)) for i, s in enumerate(want.shape) if i)]) + ")"
    shape = shape.replace("B)", "B,)")
    if value is None:
        raise ValueError(f"{name}: spec {spec.name!r} has {what}; pass {name} of shape {shape}")
    got = tuple(value.shape)
    if len(got) != len(want.shape) or any(g != want.shape[i] and i not in free for i, g in enumerate(got)):
        raise ValueError(f"{name}: expected shape {shape} with B={want.shape[0]}, got {got}")
    dtype = str(value.dtype).removeprefix("torch.")  # torch.int64 / numpy and jax int64 alike
    if want.dtype == "int32" and "int" not in dtype:
        raise ValueError(f"{name}: expected integer class ids of shape {shape}, got dtype {dtype}")


def _check_mask(spec: UNetSpec, batch: int, context: Any, mask: Any) -> None:
    """``encoder_attention_mask``: (B, L) over the context's L tokens, where an attention reads one."""
    if mask is None:
        return
    if not spec.reads_context:
        raise ValueError(f"encoder_attention_mask: spec {spec.name!r} has no attention over a context; pass None")
    img = spec.image_embedding
    tokens = img.context_tokens if img is not None and img.context_tokens is not None else context.shape[1]
    if tuple(mask.shape) != (batch, tokens):
        raise ValueError(
            f"encoder_attention_mask: expected shape ({batch}, {tokens}) (one entry per context token), "
            f"got {tuple(mask.shape)}"
        )


def _check_text_time(add: AdditionEmbeddingSpec, text: tuple[int, ...], ids: tuple[int, ...]) -> None:
    total = text[1] + ids[1] * add.time_id_dim
    if total != add.input_dim:
        raise ValueError(
            f"text_embeds, time_ids: widths {text[1]} + {ids[1]} x {add.time_id_dim} = {total} must equal "
            f"addition_embedding.input_dim={add.input_dim} (e.g. text_embeds (B, {add.text_embeds_dim}) "
            f"and time_ids (B, {add.num_time_ids}))"
        )
