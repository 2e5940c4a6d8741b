"""Forward FLOPs of every plan unit, counted from the spec (no framework).

The counting convention is `torch.utils.flop_counter`'s (2 per multiply-add; conv, matmul and
attention only; biases, norms and elementwise ops uncounted), so the figures equal what
`FlopCounterMode` counts on the torch model (`tests/test_plan_model.py` checks it). The JAX profile
and the shapes-only estimates take their FLOPs from here.
"""

from __future__ import annotations

from collections import defaultdict

from shared_configs.arch import down_blocks, up_blocks
from shared_configs.spec import UNetSpec

Flops = dict[str, float]  # op class (conv, matmul, attention) -> FLOPs


def _conv(b: int, cin: int, cout: int, k: int, hw: int) -> Flops:
    return {"conv": 2.0 * b * cin * cout * k * k * hw * hw}


def _mm(rows: int, cin: int, cout: int) -> Flops:
    return {"matmul": 2.0 * rows * cin * cout}


def _add(*parts: Flops) -> Flops:
    out: dict[str, float] = defaultdict(float)
    for part in parts:
        for k, v in part.items():
            out[k] += v
    return dict(out)


def _resnet(spec: UNetSpec, b: int, cin: int, cout: int, hw: int) -> Flops:
    temb_out = cout * (2 if spec.resnet_time_scale_shift == "scale_shift" else 1)
    parts = [_conv(b, cin, cout, 3, hw), _mm(b, spec.time_embed_dim, temb_out), _conv(b, cout, cout, 3, hw)]
    if cin != cout:
        parts.append(_conv(b, cin, cout, 1, hw))
    return _add(*parts)


def _attention(b: int, tokens: int, keys: int, ch: int) -> Flops:
    return {"attention": 4.0 * b * tokens * keys * ch}


def _self_attention(b: int, ch: int, hw: int) -> Flops:
    t = hw * hw
    return _add(_mm(b * t, ch, ch), _mm(b * t, ch, ch), _mm(b * t, ch, ch), _attention(b, t, t, ch), _mm(b * t, ch, ch))


def _transformer(spec: UNetSpec, b: int, ch: int, hw: int, level: int, context_length: int) -> Flops:
    t = hw * hw
    proj = _mm(b * t, ch, ch) if spec.use_linear_projection else _conv(b, ch, ch, 1, hw)
    parts = [proj, proj]
    for _ in range(spec.transformer_depth(level)):
        parts += [_mm(b * t, ch, ch)] * 4 + [_attention(b, t, t, ch)]  # attn1: q, k, v, out
        if spec.cross_attention_dim is not None:
            ctx, keys = spec.cross_attention_dim, context_length
            parts += [_mm(b * t, ch, ch), _mm(b * keys, ctx, ch), _mm(b * keys, ctx, ch), _mm(b * t, ch, ch)]
            parts.append(_attention(b, t, keys, ch))
        parts += [_mm(b * t, ch, 8 * ch), _mm(b * t, 4 * ch, ch)]  # GEGLU feed-forward
    return _add(*parts)


def _attn(spec: UNetSpec, kind: str, b: int, ch: int, hw: int, level: int, context_length: int) -> Flops:
    if kind == "self":
        return _self_attention(b, ch, hw)
    return _transformer(spec, b, ch, hw, level, context_length)


def unit_flops(spec: UNetSpec, batch_size: int, context_length: int = 77) -> dict[str, Flops]:
    """Forward FLOPs by op class of every unit: layers, samplers, blocks (their sum), stem, head."""
    b, size, chans, ctx = batch_size, spec.sample_size, spec.block_out_channels, context_length
    temb = spec.time_embed_dim
    stem = _add(_mm(b, chans[0], temb), _mm(b, temb, temb), _conv(b, spec.in_channels, chans[0], 3, size))
    out: dict[str, Flops] = {"stem": stem, "head": _conv(b, chans[0], spec.out_channels, 3, size)}
    for blk in down_blocks(spec):
        hw = size >> blk.level
        for j in range(spec.layers_per_block):
            out[f"{blk.name}.resnets.{j}"] = _resnet(spec, b, blk.in_ch if j == 0 else blk.out_ch, blk.out_ch, hw)
            if blk.attention != "none":
                out[f"{blk.name}.attentions.{j}"] = _attn(spec, blk.attention, b, blk.out_ch, hw, blk.level, ctx)
        if blk.downsample_padding is not None:
            out[f"{blk.name}.downsample"] = _conv(b, blk.out_ch, blk.out_ch, 3, hw // 2)
    deep, hw = chans[-1], size >> (spec.num_levels - 1)
    out["mid.resnets.0"] = out["mid.resnets.1"] = _resnet(spec, b, deep, deep, hw)
    if spec.mid_attention != "none":
        out["mid.attentions.0"] = _attn(spec, spec.mid_attention, b, deep, hw, -1, ctx)
    for blk in up_blocks(spec):
        hw = size >> blk.level
        ins = [blk.in_ch] + [blk.out_ch] * (len(blk.skip_channels) - 1)
        for j, (cin, skip) in enumerate(zip(ins, blk.skip_channels, strict=True)):
            out[f"{blk.name}.resnets.{j}"] = _resnet(spec, b, cin + skip, blk.out_ch, hw)
            if blk.attention != "none":
                out[f"{blk.name}.attentions.{j}"] = _attn(spec, blk.attention, b, blk.out_ch, hw, blk.level, ctx)
        if blk.upsample:
            out[f"{blk.name}.upsample"] = _conv(b, blk.out_ch, blk.out_ch, 3, hw * 2)
    for block in [d.name for d in down_blocks(spec)] + ["mid"] + [u.name for u in up_blocks(spec)]:
        out[block] = _add(*(v for k, v in out.items() if k.startswith(block + ".")))
    return out


def recompute_flops(per_class: Flops, choice: str) -> float:
    """FLOPs a unit's recompute pays under ``choice``: its forward's, minus the op classes it keeps."""
    if choice == "plain":
        return 0.0
    kept = choice.removeprefix("save=").split(",") if choice.startswith("save=") else []
    return float(sum(n for cls, n in per_class.items() if cls not in kept))
