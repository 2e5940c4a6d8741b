"""What each framework saves for backward under a checkpoint policy, block by block.

    python -m benchmarks.saved --config tiny --policy save_convs
    python -m benchmarks.saved --config tiny --policy full --framework jax --json

torch: what autograd saves outside recomputed blocks (``saved_tensors_hooks``), each recomputed block's
inputs and what a selective policy keeps (``MUST_SAVE``); JAX: the residuals of the loss's ``vjp``, by
the Flax module path in each equation's name stack. Parameters and model inputs left out; a tensor
counts for the block that *produced* it. Not a memory measurement: both run in this process.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from shared_configs import SpecError, UNetSpec, block_names, load_spec, resolve_plan
from shared_configs.cli import OneLineParser, cli_errors, config_help, positive_int
from shared_configs.defaults import AUTO, CHUNK_HELP, chunk_arg, defaults, device_of, resolve_chunk
from shared_configs.memory import OUTSIDE, block_of

DEFAULTS = defaults("cpu")  # the device-independent fields; the attention chunk is resolved on JAX's device


@dataclass(frozen=True)
class Saved:
    """One tensor kept for backward."""

    block: str
    op: str  # op class tag ("conv", "matmul", ...) when saved by a selective policy, else the op
    kind: str  # "saved" (autograd), "policy" (kept by the op-level policy), "input" (recompute input)
    shape: tuple[int, ...]
    dtype: str
    bytes: int


def summarize(rows: list[Saved], blocks: list[str]) -> dict[str, Any]:
    """Per-block counts and bytes (blocks in forward order, then outside) and totals."""
    per = {
        b: {"count": sum(r.block == b for r in rows), "bytes": sum(r.bytes for r in rows if r.block == b)}
        for b in dict.fromkeys([*blocks, OUTSIDE, *(r.block for r in rows)])
    }
    return {
        "rows": [asdict(r) for r in rows],
        "blocks": per,
        "total_count": len(rows),
        "total_bytes": sum(r.bytes for r in rows),
    }


def torch_saved(spec: UNetSpec, policy: str, batch_size: int, context_length: int, chunk: int | None) -> list[Saved]:
    """What the torch U-Net keeps for backward under ``policy`` (``chunk``: JAX's only)."""
    from benchmarks.backends.saved_torch import collect

    return [Saved(*row) for row in collect(spec, policy, batch_size, context_length)]


def jax_saved(spec: UNetSpec, policy: str, batch_size: int, context_length: int, chunk: int | None) -> list[Saved]:
    """The residuals of the Flax U-Net's loss under ``policy`` (arguments left out)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.extend.core import Literal

    from jax_impl import UNet
    from jax_impl.compat import checkpoint_name_primitive
    from jax_impl.unet import abstract_inputs

    model = UNet(spec=spec, policy=policy, attention_chunk=chunk)
    recomputed = {name if name == "mid" else ".".join(name.split(".")[:2]) for name in model.plan.recompute}
    inputs = abstract_inputs(spec, batch_size, spec.sample_size, context_length)
    x, t, ctx = inputs["x"], inputs["t"], inputs["context"]
    params = jax.eval_shape(model.init, jax.random.key(0), x, t, ctx)

    def loss(p: Any, x: Any, t: Any, ctx: Any) -> Any:
        return jnp.mean(model.apply(p, x, t, ctx) ** 2)

    closed, shapes = jax.make_jaxpr(lambda *a: jax.vjp(loss, *a), return_shape=True)(params, x, t, ctx)
    jaxpr, n_res = closed.jaxpr, jax.tree.structure(shapes[1]).num_leaves
    residuals = {v for v in jaxpr.outvars[len(jaxpr.outvars) - n_res :] if not isinstance(v, Literal)}
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    rows, name_p = [], checkpoint_name_primitive()
    for eqn, v in ((e, v) for e in jaxpr.eqns for v in e.outvars if v in residuals):
        src = _source(eqn, v, producer)
        named = src.primitive is name_p
        block = block_of(str(eqn.source_info.name_stack))
        rows.append(
            Saved(
                block,
                src.params["name"] if named else src.params.get("name", src.primitive.name),
                # A tag outside a recomputed block is only a label: the value is saved as any other.
                "policy" if named and block in recomputed else "saved",
                tuple(v.aval.shape),
                str(v.aval.dtype),
                int(np.prod(v.aval.shape, dtype=np.int64)) * v.aval.dtype.itemsize,
            )
        )
    return rows


def _source(eqn: Any, var: Any, producer: dict) -> Any:
    """The equation that made residual ``var``, through ``reduce_precision`` and forwarding ``jax.checkpoint``s."""
    while True:
        if eqn.primitive.name == "reduce_precision" and eqn.invars[0] in producer:
            var = eqn.invars[0]
        elif "jaxpr" in eqn.params and eqn.primitive.name.startswith("remat"):
            inner = eqn.params["jaxpr"]
            out = inner.outvars[eqn.outvars.index(var)]
            if out not in inner.invars or eqn.invars[inner.invars.index(out)] not in producer:
                return eqn
            var = eqn.invars[inner.invars.index(out)]
        else:
            return eqn
        eqn = producer[var]


COLLECTORS: dict[str, Callable[..., list[Saved]]] = {"torch": torch_saved, "jax": jax_saved}


def inspect_policy(
    config: str,
    policy: str,
    frameworks: list[str],
    batch_size: int,
    block: str | None,
    context_length: int = DEFAULTS.context_length,
    chunk: int | str | None = AUTO,
) -> dict:
    """The JSON document: per framework the rows, per-block summary and totals; blocks that differ."""
    spec = load_spec(config)
    plan = resolve_plan(spec, policy)
    blocks = block_names(spec)
    if block is not None and block not in [*blocks, OUTSIDE]:
        raise SpecError(f"block: unknown block {block!r} (valid: {', '.join([*blocks, OUTSIDE])})")
    device = "cpu"
    if "jax" in frameworks:
        import jax

        device = device_of(jax.devices()[0].platform)
    used = replace(defaults(device), context_length=context_length, attention_chunk=resolve_chunk(chunk, device))
    doc: dict[str, Any] = {
        "config": spec.name,
        "policy": plan.policy,
        "batch_size": batch_size,
        "settings": used.describe(
            ("attention_chunk", "context_length") if "jax" in frameworks else ("context_length",)
        ),
        "frameworks": {},
    }
    for fw in frameworks:
        rows = COLLECTORS[fw](spec, policy, batch_size, context_length, used.attention_chunk)
        doc["frameworks"][fw] = summarize([r for r in rows if block is None or r.block == block], blocks)
    a, b = (doc["frameworks"][fw]["blocks"] for fw in ("torch", "jax")) if len(frameworks) == 2 else ({}, {})
    doc["differ"] = [k for k in a if a[k] != b.get(k)]
    return doc


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def render(doc: dict) -> str:
    """Plain-text report: per block, each framework's tensors; a '!' where counts/bytes differ."""
    fws = list(doc["frameworks"])
    lines = [
        f"{doc['config']} policy={doc['policy']} batch={doc['batch_size']} (params and inputs excluded); "
        f"{doc['settings']}"
    ]
    for blk in doc["frameworks"][fws[0]]["blocks"]:
        stats = [doc["frameworks"][fw]["blocks"][blk] for fw in fws]
        cells = [f"{fw}: {s['count']:3d} tensors {_kib(s['bytes']):>12}" for fw, s in zip(fws, stats, strict=True)]
        lines.append(f"{blk:8} | " + " | ".join(cells) + (" !" if blk in doc["differ"] else ""))
        lines += [
            f"    {fw:5} {r['kind']:6} {r['op']:38.38} {'x'.join(map(str, r['shape'])):>14} "
            f"{r['dtype']:8} {r['bytes']:>10}"
            for fw in fws
            for r in doc["frameworks"][fw]["rows"]
            if r["block"] == blk
        ]
    lines.append(
        f"{'total':8} | "
        + " | ".join(
            f"{fw}: {f['total_count']} tensors, {_kib(f['total_bytes'])}" for fw, f in doc["frameworks"].items()
        )
    )
    if doc["differ"]:
        lines.append(f"differ (count or bytes): {', '.join(doc['differ'])}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m benchmarks.saved", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny", help=config_help("tiny"))
    p.add_argument("--policy", default="save_convs", help="a checkpoint policy, e.g. full/save=conv,matmul")
    p.add_argument("--framework", choices=["both", "torch", "jax"], default="both", help="(%(default)s)")
    p.add_argument("--block", default=None, help="only this block (down.0, mid, ...)")
    p.add_argument("--batch-size", type=positive_int, default=2, help="(%(default)s)")
    p.add_argument(
        "--context-length",
        type=positive_int,
        default=DEFAULTS.context_length,
        help="cross-attention tokens (%(default)s)",
    )
    p.add_argument("--attention-chunk", type=chunk_arg, default=AUTO, metavar="N", help=CHUNK_HELP)
    p.add_argument("--json", action="store_true", help="print the JSON document instead of text")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with cli_errors("benchmarks.saved"):  # an interrupt: one line, exit 128 + the signal's number; nothing is written
        doc = inspect_policy(
            args.config,
            args.policy,
            ["torch", "jax"] if args.framework == "both" else [args.framework],
            args.batch_size,
            args.block,
            args.context_length,
            args.attention_chunk,
        )
    print(json.dumps(doc, indent=1) if args.json else render(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
