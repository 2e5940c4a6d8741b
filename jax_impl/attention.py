"""Multi-head attention for the Flax U-Net, query-chunked with its own backward pass on request.

XLA:CPU runs attention unfused and keeps every head's scores; chunked, a `jax.custom_vjp` recomputes one
chunk's probabilities at a time in the backward (docs/remat_vs_checkpoint.md "Remat inside attention").
Torch needs no twin: its CPU kernel never holds the score matrix.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

Array = jax.Array


def attention(
    q: Array, k: Array, v: Array, heads: int, scale: float, query_chunk: int | None = None, bias: Array | None = None
) -> Array:
    """Multi-head attention on (B, T, heads*D) tensors; ``bias`` (B, 1, 1, S) is added to the scores
    (`jax_impl.layers.mask_bias`). ``query_chunk``: `chunked_attention`, when the chunk divides T and
    there is no ``bias``; neither pass then holds more than a (chunk x keys) slice of the scores."""
    q, k, v = (a.reshape(*a.shape[:2], heads, -1) for a in (q, k, v))  # (B, T, N, D)
    batch, tokens = q.shape[:2]
    chunk = None if query_chunk is None else min(query_chunk, tokens)
    out = (
        jax.nn.dot_product_attention(q, k, v, bias=bias, scale=scale)
        if chunk is None or tokens % chunk or bias is not None
        else chunked_attention(q, k, v, scale, chunk)
    )
    return checkpoint_name(out, "attention").reshape(batch, tokens, -1)  # (B, T, N*D)


def _chunk(qc: Array, k: Array, v: Array, scale: float) -> Array:
    """One chunk of queries (B, c, N, D) against all keys (B, S, N, D) -> (B, c, N, D). The queries are
    scaled, not the scores: XLA:CPU would keep the scale broadcast to the scores' shape for the whole step."""
    return jax.nn.dot_product_attention(qc * jnp.asarray(scale, qc.dtype), k, v, scale=1.0)


def _slice(x: Array, i: Array | int, chunk: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=1)


def _padded(first: Array, tokens: int) -> Array:
    """The first chunk's rows in a (B, tokens, ...) buffer, the rest zeros: a loop buffer that starts from data."""
    return jnp.pad(first, ((0, 0), (0, tokens - first.shape[1])) + ((0, 0),) * (first.ndim - 2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def chunked_attention(q: Array, k: Array, v: Array, scale: float, chunk: int) -> Array:
    """Attention of q (B, T, N, D) over k, v (B, S, N, D), ``chunk`` (a divisor of T) queries at a time."""
    tokens = q.shape[1]

    def body(i: Array, out: Array) -> Array:
        return jax.lax.dynamic_update_slice_in_dim(out, _chunk(_slice(q, i, chunk), k, v, scale), i * chunk, 1)

    return jax.lax.fori_loop(1, tokens // chunk, body, _padded(_chunk(_slice(q, 0, chunk), k, v, scale), tokens))


def _forward(q: Array, k: Array, v: Array, scale: float, chunk: int) -> tuple[Array, tuple[Array, ...]]:
    return chunked_attention(q, k, v, scale, chunk), (q, k, v)


def _backward(scale: float, chunk: int, saved: tuple[Array, ...], g: Array) -> tuple[Array, Array, Array]:
    # Tied to the cotangent: no recomputation can be scheduled before the backward reaches here.
    q, k, v, g = jax.lax.optimization_barrier((*saved, g))
    tokens = q.shape[1]

    def one(i: Array | int) -> tuple[Array, Array, Array]:
        """(dq of chunk i, its share of dk, of dv): `jax.vjp` of the chunk, its probabilities recomputed."""
        _, vjp = jax.vjp(functools.partial(_chunk, scale=scale), _slice(q, i, chunk), k, v)
        return vjp(_slice(g, i, chunk))

    def body(i: Array, acc: tuple[Array, Array, Array]) -> tuple[Array, Array, Array]:
        dq, dk, dv = acc
        dqc, dkc, dvc = one(i)
        return jax.lax.dynamic_update_slice_in_dim(dq, dqc, i * chunk, 1), dk + dkc, dv + dvc

    dq, dk, dv = one(0)
    return jax.lax.fori_loop(1, tokens // chunk, body, (_padded(dq, tokens), dk, dv))


chunked_attention.defvjp(_forward, _backward)
