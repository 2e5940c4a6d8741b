"""Multi-head attention for the Flax U-Net, query-chunked with its own backward pass on request.

Torch's CPU attention (`F.scaled_dot_product_attention`) is one fused kernel that never holds a
(queries x keys) score matrix; XLA:CPU runs `jax.nn.dot_product_attention` unfused, so the plain
call materialises the scores of every head and keeps the probabilities for the backward. With a
chunk size the queries go ``chunk`` at a time (Rabe & Staats 2021, "Self-attention does not need
O(n^2) memory"): the forward keeps only q, k and v; the backward recomputes one chunk's
probabilities at a time and takes that chunk's `jax.vjp`, so each chunk's gradient is what
autodiff computes for it.

Why a `jax.custom_vjp` rather than ``lax.map(jax.checkpoint(...))`` (what this replaced): autodiff
of a loop starts every loop buffer from a constant (zeros for the stacked outputs; for the key and
value gradients the transposed loop accumulates). XLA:CPU shares one such constant between loops
and schedules each loop's copy of it at the start of the step, where it stays until its loop runs.
Here every loop buffer starts from data (the first chunk's result, padded or accumulated), and the
backward's inputs pass one `lax.optimization_barrier` with the cotangent, so that no part of the
backward is computed, and then held, during the forward. Figures: docs/remat_vs_checkpoint.md.
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
    (a context mask, `jax_impl.layers.mask_bias`).

    ``query_chunk``: `jax_impl.attention.chunked_attention`, ``query_chunk`` queries at a time (all
    T at once when T <= query_chunk): the backward recomputes the probabilities chunk by chunk, so
    neither pass holds more than a (chunk x keys) slice of the scores. XLA:CPU runs
    `jax.nn.dot_product_attention` unfused, materialising all (T x keys) scores per head and keeping
    the probabilities; torch's CPU SDPA kernel is fused and never does. Same result up to float
    rounding; used only when the chunk divides T and there is no ``bias`` (else the plain call).
    """
    q, k, v = (a.reshape(*a.shape[:2], heads, -1) for a in (q, k, v))  # (B, T, N, D)
    batch, tokens = q.shape[:2]
    chunk = None if query_chunk is None else min(query_chunk, tokens)
    if chunk is None or tokens % chunk or bias is not None:
        out = jax.nn.dot_product_attention(q, k, v, bias=bias, scale=scale)
    else:
        out = chunked_attention(q, k, v, scale, chunk)
    return checkpoint_name(out, "attention").reshape(batch, tokens, -1)  # (B, T, N*D)


def _chunk(qc: Array, k: Array, v: Array, scale: float) -> Array:
    """One chunk of queries (B, c, N, D) against all keys (B, S, N, D) -> (B, c, N, D).

    The queries are scaled, not the scores: XLA:CPU fuses the score matmul with the scaling and
    hands that fusion the scalar broadcast to the scores' full shape, a constant it then keeps for
    the whole step, one per score shape.
    """
    return jax.nn.dot_product_attention(qc * jnp.asarray(scale, qc.dtype), k, v, scale=1.0)


def _slice(x: Array, i: Array | int, chunk: int) -> Array:
    return jax.lax.dynamic_slice_in_dim(x, i * chunk, chunk, axis=1)


def _padded(first: Array, tokens: int) -> Array:
    """The first chunk's rows in a (B, tokens, ...) buffer, the rest zeros: a loop buffer that
    starts from data (see the module docstring)."""
    return jnp.pad(first, ((0, 0), (0, tokens - first.shape[1])) + ((0, 0),) * (first.ndim - 2))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def chunked_attention(q: Array, k: Array, v: Array, scale: float, chunk: int) -> Array:
    """Attention of q (B, T, N, D) over k, v (B, S, N, D), ``chunk`` queries at a time; ``chunk``
    divides T. Same result as `jax.nn.dot_product_attention` up to float rounding."""
    tokens = q.shape[1]

    def body(i: Array, out: Array) -> Array:
        return jax.lax.dynamic_update_slice_in_dim(out, _chunk(_slice(q, i, chunk), k, v, scale), i * chunk, 1)

    first = _padded(_chunk(_slice(q, 0, chunk), k, v, scale), tokens)
    return jax.lax.fori_loop(1, tokens // chunk, body, first)


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
