"""Query-chunked attention in the Flax U-Net (``UNet(attention_chunk=N)``).

References: torch's fused attention on the same converted weights (outputs), the unchunked Flax
model in float64 (gradients, dropout on), and the compiled step's memory (the scores leave it).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from jax_impl import UNet
from jax_impl import train as jtrain
from shared_configs import spec_from_dict
from tests.helpers.parity import flax_out, parity_inputs, parity_pair, torch_out
from tests.helpers.specs import FAST_COMPILE, TINY
from tests.helpers.tensors import rel_err
from torch_impl import train as ttrain


@pytest.mark.slow_for("tiny", "sd_linear_proj")
@pytest.mark.parametrize("name", ["tiny", "ddpm_style", "sd_linear_proj"])
def test_chunked_outputs_match_torch(name: str) -> None:
    tmodel, fmodel, params = parity_pair(name)
    inputs = parity_inputs(tmodel.spec)  # 8x8: 64 tokens at level 0, 16 at level 1
    chunked = dataclasses.replace(fmodel, attention_chunk=8)
    assert rel_err(flax_out(chunked, params, inputs), torch_out(tmodel, inputs).detach()) <= 1e-5


@pytest.mark.slow  # plain attention chunked: heavy; `full` (chunked and recomputed) keeps the ground
@pytest.mark.parametrize("policy", [pytest.param("none", marks=pytest.mark.heavy), "full"])
def test_chunked_gradients_equal_unchunked(policy: str) -> None:
    spec = spec_from_dict({**TINY, "dropout": 0.3})  # dropout on: the masks must not move
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 8, 8, 4)))
    t, ctx = jnp.asarray([11.0, 860.0]), jnp.asarray(rng.standard_normal((2, 3, 12)))
    with jax.enable_x64(True):  # float64: rounding below 1e-12, a real difference stays O(1)
        shapes = jax.eval_shape(UNet(spec=spec).init, jax.random.key(0), x, t, ctx)["params"]
        params = jax.tree.map(lambda s: jnp.asarray(0.2 * rng.standard_normal(s.shape)), shapes)

        def grads(chunk: int | None) -> dict:
            model = UNet(spec=spec, policy=policy, attention_chunk=chunk)

            def loss(p: dict) -> jax.Array:
                out = model.apply({"params": p}, x, t, ctx, train=True, rngs={"dropout": jax.random.key(3)})
                return jnp.mean(out**2)

            step = jax.jit(jax.value_and_grad(loss)).lower(params).compile(FAST_COMPILE)
            return traverse_util.flatten_dict(step(params)[1])

        plain, chunked = grads(None), grads(16)
    for key, want in plain.items():
        assert np.linalg.norm(chunked[key] - want) <= 1e-9 * max(np.linalg.norm(want), 1e-6), key


@pytest.mark.slow
def test_chunks_keep_the_scores_out_of_memory() -> None:
    # One transformer level at 32x32: 1,024 tokens, 2 heads, so each attention's scores are
    # 2 x 1024^2 x 4 B = 8 MiB per sample; chunks of 128 queries hold an eighth of that.
    spec = spec_from_dict(
        {**TINY, "sample_size": 32, "down_attention": ["transformer", "none"], "mid_attention": "none"}
    )
    x, t, ctx = jnp.zeros((2, 32, 32, 4)), jnp.zeros((2,)), jnp.zeros((2, 5, 12))
    params = jax.eval_shape(UNet(spec=spec).init, jax.random.key(0), x, t, ctx)["params"]

    def temp_bytes(chunk: int | None) -> int:
        model = UNet(spec=spec, attention_chunk=chunk)
        grad = jax.jit(jax.grad(lambda p: jnp.mean(model.apply({"params": p}, x, t, ctx) ** 2)))
        return grad.lower(params).compile(FAST_COMPILE).memory_analysis().temp_size_in_bytes

    plain, chunked = temp_bytes(None), temp_bytes(128)
    assert chunked < plain / 3, (plain, chunked)
    assert plain - chunked > 2 * 2 * 8 * 2**20  # at least the two saved score tensors of one attention


def test_attention_chunk_is_a_jax_train_flag_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert jtrain.parse_args(["--attention-chunk", "256"]).options.attention_chunk == 256
    assert jtrain.parse_args([]).options.attention_chunk == "auto"  # shared_configs.defaults decides per device
    with pytest.raises(SystemExit):
        ttrain.parse_args(["--attention-chunk", "256"])  # torch's CPU attention is fused already
    assert "unrecognized arguments: --attention-chunk" in capsys.readouterr().err
