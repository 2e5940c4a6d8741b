"""Forward FLOPs of every plan unit, and a training step's as autograd runs it, counted from the spec in
`torch.utils.flop_counter`'s convention, so they equal `FlopCounterMode`'s on the torch model (tests hold them).
The rules: docs/regimes.md.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from shared_configs.arch import down_blocks, up_blocks
from shared_configs.controlnet import residual_shapes
from shared_configs.pair import CONTROLNET, ControlNetPairSpec
from shared_configs.spec import UNetSpec

Flops = dict[str, float]  # op class (conv, matmul, attention) -> FLOPs

# What an op reads: the hidden states, the text context, the time embedding, the step's own inputs
# (latents, sinusoids: never a gradient).
HIDDEN, CONTEXT, TEMB, INPUT = "hidden", "context", "temb", "input"
ATTENTION_BACKWARD = 2.5  # attention's backward FLOPs per forward FLOP (scores recomputed, 5 products for 2)


@dataclass(frozen=True)
class Op:
    """One conv, matmul or attention of the forward. ``rows``/``fan_in``/``fan_out``: a weighted op's product
    (conv: b*h*w rows, cin*k*k in); ``branch``: it feeds q/k/v or the time embedding; ``adapted``: a LoRA target."""

    cls: str
    flops: float
    source: str = HIDDEN
    rows: int = 0
    fan_in: int = 0
    fan_out: int = 0
    branch: bool = False
    adapted: bool = False

    @property
    def weights(self) -> int:
        return self.fan_in * self.fan_out


def _conv(b: int, cin: int, cout: int, k: int, hw: int, source: str = HIDDEN) -> Op:
    rows = b * hw * hw
    return Op("conv", 2.0 * rows * cin * k * k * cout, source, rows, cin * k * k, cout)


def _mm(rows: int, cin: int, cout: int, source: str = HIDDEN, branch: bool = False, adapted: bool = False) -> Op:
    return Op("matmul", 2.0 * rows * cin * cout, source, rows, cin, cout, branch, adapted)


def _resnet(spec: UNetSpec, b: int, cin: int, cout: int, hw: int) -> list[Op]:
    temb_out = cout * (2 if spec.resnet_time_scale_shift == "scale_shift" else 1)
    ops = [_conv(b, cin, cout, 3, hw), _mm(b, spec.time_embed_dim, temb_out, TEMB), _conv(b, cout, cout, 3, hw)]
    if cin != cout:
        ops.append(_conv(b, cin, cout, 1, hw))
    return ops


def _attention_layer(b: int, ch: int, t: int, keys: int, kv_dim: int, source: str) -> list[Op]:
    """``t`` queries on ``keys`` keys: q from the hidden states, k and v from ``source`` (themselves or the
    context), the attention, the output projection (the projections: LoRA targets)."""
    q, out = _mm(b * t, ch, ch, branch=True, adapted=True), _mm(b * t, ch, ch, adapted=True)
    kv = [_mm(b * keys, kv_dim, ch, source, branch=True, adapted=True) for _ in "kv"]
    return [q, *kv, Op("attention", 4.0 * b * t * keys * ch), out]


def _self_attention(b: int, ch: int, hw: int) -> list[Op]:
    return _attention_layer(b, ch, hw * hw, hw * hw, ch, HIDDEN)


def _transformer(spec: UNetSpec, b: int, ch: int, hw: int, level: int, context_length: int) -> list[Op]:
    t = hw * hw
    proj = _mm(b * t, ch, ch) if spec.use_linear_projection else _conv(b, ch, ch, 1, hw)
    ops = [proj]
    for _ in range(spec.transformer_depth(level)):
        ops += _self_attention(b, ch, hw)
        if spec.cross_attention_dim is not None:
            ops += _attention_layer(b, ch, t, context_length, spec.cross_attention_dim, CONTEXT)
        ops += [_mm(b * t, ch, 8 * ch), _mm(b * t, 4 * ch, ch)]  # GEGLU feed-forward
    return [*ops, proj]


def _attn(spec: UNetSpec, kind: str, b: int, ch: int, hw: int, level: int, context_length: int) -> list[Op]:
    return _self_attention(b, ch, hw) if kind == "self" else _transformer(spec, b, ch, hw, level, context_length)


def unit_ops(spec: UNetSpec, batch_size: int, context_length: int = 77) -> dict[str, list[Op]]:
    """Every leaf unit's ops, the units in forward order: stem, layers and samplers, head."""
    b, size, chans, ctx = batch_size, spec.sample_size, spec.block_out_channels, context_length
    temb = spec.time_embed_dim
    stem = [_mm(b, chans[0], temb, INPUT, branch=True), _mm(b, temb, temb, TEMB, branch=True)]
    out: dict[str, list[Op]] = {"stem": [*stem, _conv(b, spec.in_channels, chans[0], 3, size, INPUT)]}
    for blk in down_blocks(spec):
        hw = size >> blk.level
        for j in range(spec.layers_per_block):
            out[f"{blk.name}.resnets.{j}"] = _resnet(spec, b, blk.in_ch if j == 0 else blk.out_ch, blk.out_ch, hw)
            if blk.attention != "none":
                out[f"{blk.name}.attentions.{j}"] = _attn(spec, blk.attention, b, blk.out_ch, hw, blk.level, ctx)
        if blk.downsample_padding is not None:
            out[f"{blk.name}.downsample"] = [_conv(b, blk.out_ch, blk.out_ch, 3, hw // 2)]
    deep, hw = chans[-1], size >> (spec.num_levels - 1)
    out["mid.resnets.0"] = _resnet(spec, b, deep, deep, hw)
    if spec.mid_attention != "none":
        out["mid.attentions.0"] = _attn(spec, spec.mid_attention, b, deep, hw, -1, ctx)
    out["mid.resnets.1"] = _resnet(spec, b, deep, deep, hw)
    for blk in up_blocks(spec):
        hw = size >> blk.level
        ins = [blk.in_ch] + [blk.out_ch] * (len(blk.skip_channels) - 1)
        for j, (cin, skip) in enumerate(zip(ins, blk.skip_channels, strict=True)):
            out[f"{blk.name}.resnets.{j}"] = _resnet(spec, b, cin + skip, blk.out_ch, hw)
            if blk.attention != "none":
                out[f"{blk.name}.attentions.{j}"] = _attn(spec, blk.attention, b, blk.out_ch, hw, blk.level, ctx)
        if blk.upsample:
            out[f"{blk.name}.upsample"] = [_conv(b, blk.out_ch, blk.out_ch, 3, hw * 2)]
    out["head"] = [_conv(b, chans[0], spec.out_channels, 3, size)]
    return out


def _adapter(op: Op, rank: int) -> tuple[float, float]:
    """The FLOPs of a rank-``rank`` adapter on ``op``'s product: (rows x in -> R, rows x R -> out)."""
    return 2.0 * op.rows * op.fan_in * rank, 2.0 * op.rows * rank * op.fan_out


def _add(*parts: Flops) -> Flops:
    out: Counter[str] = Counter()
    for part in parts:
        out.update(part)
    return dict(out)


def _forward(ops: list[Op], lora_rank: int | None) -> Flops:
    adapters = [{"matmul": sum(_adapter(op, lora_rank))} for op in ops if lora_rank is not None and op.adapted]
    return _add(*({op.cls: op.flops} for op in ops), *adapters)


def _with_blocks(spec: UNetSpec, out: dict[str, Flops]) -> dict[str, Flops]:
    """``out`` (per leaf unit) with each block's entry: the sum of its layers' and samplers'."""
    for block in [d.name for d in down_blocks(spec)] + ["mid"] + [u.name for u in up_blocks(spec)]:
        out[block] = _add(*(v for k, v in out.items() if k.startswith(block + ".")))
    return out


def in_encoder(unit: str) -> bool:
    """Whether a U-Net unit is in the part a ControlNet copies (not the up path or the head)."""
    return not unit.startswith("up.") and unit != "head"


def unit_flops(
    spec: UNetSpec | ControlNetPairSpec, batch_size: int, context_length: int = 77, lora_rank: int | None = None
) -> dict[str, Flops]:
    """Forward FLOPs by op class of every unit (layers, samplers, blocks, stem, head), LoRA's adapters included."""
    if isinstance(spec, ControlNetPairSpec):  # the ControlNet's units (`_pair_units`), then the U-Net's
        unet = unit_flops(spec.unet, batch_size, context_length)
        return _pair_units(unet, controlnet_ops(spec, batch_size), lambda ops: _forward(ops, None))
    return _with_blocks(
        spec, {u: _forward(ops, lora_rank) for u, ops in unit_ops(spec, batch_size, context_length).items()}
    )


def unit_weights(spec: UNetSpec | ControlNetPairSpec) -> dict[str, Flops]:
    """The conv/matmul weights of every unit by op class: what a mixed-precision recompute casts again."""
    if isinstance(spec, ControlNetPairSpec):
        return _pair_units(unit_weights(spec.unet), controlnet_ops(spec, 1), lambda ops: {"conv": _weights(ops)})
    return _with_blocks(
        spec, {u: _add(*({op.cls: op.weights} for op in ops)) for u, ops in unit_ops(spec, 1, 1).items()}
    )


@dataclass(frozen=True)
class StepFlops:
    """A plain training step's FLOPs, by what computes them (`step_flops`)."""

    forward: float  # the base network's forward
    input_grads: float  # the backward's gradients of activations (attention's whole backward included)
    weight_grads: float  # the backward's gradients of trained base weights
    adapters: float  # LoRA's own matmuls, forward and backward
    trained_weights: int  # conv/matmul weights trained (biases and norms, a tiny share, left out: docs/regimes.md)
    weights: int  # every conv/matmul weight

    @property
    def total(self) -> float:
        return self.forward + self.input_grads + self.weight_grads + self.adapters


def walk(
    spec: UNetSpec, batch_size: int, context_length: int = 77, lora_rank: int | None = None
) -> Iterator[tuple[str, Op, bool]]:
    """Each op in forward order with whether its input needs a gradient: the hidden states from the first
    trained weight (or adapter) on, the time embedding when the base is trained, the context and inputs never."""
    trained = lora_rank is None
    live, pending = False, False  # the hidden states need a gradient; a branch since the last op on them does
    for unit, ops in unit_ops(spec, batch_size, context_length).items():
        for op in ops:
            sources = {HIDDEN: live, TEMB: trained, CONTEXT: False, INPUT: False}
            needs = (live or pending) if op.cls == "attention" else sources[op.source]
            yield unit, op, needs
            out_grad = needs or (trained if op.cls != "attention" else False) or (op.adapted and not trained)
            if op.branch:
                pending = pending or (out_grad and op.source != TEMB and op.source != INPUT)
            else:
                live, pending = live or out_grad or pending, False


def step_flops(spec: UNetSpec, batch_size: int, context_length: int = 77, lora_rank: int | None = None) -> StepFlops:
    """The plain step's FLOPs, every weight trained or (``lora_rank``) adapters on a frozen base: each
    gradient costs its op's forward FLOPs (attention's backward: `ATTENTION_BACKWARD` forwards)."""
    fwd = grads = wgrads = adapters = 0.0
    trained = weights = 0
    for _, op, needs in walk(spec, batch_size, context_length, lora_rank):
        fwd += op.flops
        if op.cls == "attention":
            grads += ATTENTION_BACKWARD * op.flops if needs else 0.0
            continue
        weights += op.weights
        grads += op.flops if needs else 0.0
        if lora_rank is None:
            wgrads += op.flops
            trained += op.weights
        elif op.adapted:
            down, up = _adapter(op, lora_rank)
            # forward; B's weight and input gradients; A's weight gradient, and its input's if needed
            adapters += down + up + 2 * up + down + (down if needs else 0.0)
            trained += lora_rank * (op.fan_in + op.fan_out)
    return StepFlops(fwd, grads, wgrads, adapters, trained, weights)


def recompute_flops(per_class: Flops, choice: str) -> float:
    """FLOPs a unit's recompute pays under ``choice``: its forward's, minus the op classes it keeps."""
    if choice == "plain":
        return 0.0
    kept = choice.removeprefix("save=").split(",") if choice.startswith("save=") else []
    return float(sum(n for cls, n in per_class.items() if cls not in kept))


def controlnet_ops(spec: ControlNetPairSpec, batch_size: int) -> dict[str, list[Op]]:
    """The ControlNet's own convolutions: ``stem``, the conditioning embedding; ``head``, its zero convolutions."""
    cn, b = spec.controlnet, batch_size
    widths, side = cn.conditioning_embedding_out_channels, spec.sample_size * cn.conditioning_factor
    stem = [_conv(b, cn.conditioning_channels, widths[0], 3, side, INPUT)]
    for a, c in itertools.pairwise(widths):
        stem += [_conv(b, a, a, 3, side), _conv(b, a, c, 3, side // 2)]
        side //= 2
    stem.append(_conv(b, widths[-1], spec.unet.block_out_channels[0], 3, side))
    down, mid = residual_shapes(spec.unet, b, spec.sample_size)
    return {"stem": stem, "head": [_conv(b, shape[1], shape[1], 1, shape[2]) for shape in (*down, mid)]}


def _pair_units(
    unet: dict[str, Flops], own_ops: dict[str, list[Op]], of: Callable[[list[Op]], Flops]
) -> dict[str, Flops]:
    """The pair's units: the ControlNet's encoder as the U-Net's, its stem and head from ``own_ops`` (by ``of``)."""
    own = {u: of(ops) for u, ops in own_ops.items()}
    mine = {u: f for u, f in unet.items() if in_encoder(u)}
    mine |= {"stem": _add(unet["stem"], own["stem"]), "head": own["head"]}
    return {CONTROLNET + u: f for u, f in mine.items()} | unet


def _weights(ops: list[Op]) -> float:
    return float(sum(op.weights for op in ops if op.cls != "attention"))


def pair_weights(spec: ControlNetPairSpec) -> tuple[int, int]:
    """(the ControlNet's conv/matmul weights, both networks'): what the step updates, and casts."""
    unet = {u: _weights(ops) for u, ops in unit_ops(spec.unet, 1, 1).items()}
    encoder = sum(w for u, w in unet.items() if in_encoder(u))
    trained = encoder + sum(_weights(ops) for ops in controlnet_ops(spec, 1).values())
    return round(trained), round(trained + sum(unet.values()))


def pair_step_flops(spec: ControlNetPairSpec, batch_size: int, context_length: int = 77) -> float:
    """The ControlNet step's FLOPs as autograd runs them: the ControlNet trained; the frozen U-Net's forward,
    and its up path's and head's backward for their inputs only (the loss reaches the residuals through them)."""
    total = 0.0

    def backward(op: Op, needs: bool, weights: bool) -> float:
        if op.cls == "attention":
            return ATTENTION_BACKWARD * op.flops if needs else 0.0
        return (op.flops if needs else 0.0) + (op.flops if weights else 0.0)

    for unit, op, needs in walk(spec.unet, batch_size, context_length):
        encoder = in_encoder(unit)
        total += op.flops * (1 + encoder)  # forward: in both networks, or in the U-Net only
        total += backward(op, needs, weights=True) if encoder else backward(op, op.source == HIDDEN, weights=False)
    for ops in controlnet_ops(spec, batch_size).values():
        total += sum(op.flops + backward(op, op.source == HIDDEN, weights=True) for op in ops)
    return total
