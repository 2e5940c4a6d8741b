"""Where diffusers' Flax U-Net and its PyTorch U-Net part, on the same weights (docs/flax_users.md#numerics).

Run in the old Flax stack (.ci/flax-env): ``.venv-flax/bin/python docs/examples/flax/numerics.py UNET_FOLDER``,
a folder diffusers' Flax class saved (``diffusion_flax_model.msgpack``). It prints the relative error against
diffusers' PyTorch ``UNet2DConditionModel`` of this project's drop-in, of diffusers 0.39's
``FlaxUNet2DConditionModel``, and of that Flax U-Net with PyTorch's choices put in, one after the other.
"""

from __future__ import annotations

import sys
import tempfile
import types

import flax.linen as nn
import flax.linen.normalization
import jax
import jax.numpy as jnp
import numpy as np
import torch
from diffusers import FlaxUNet2DConditionModel, UNet2DConditionModel
from diffusers.models import attention_flax

import jax_impl


def main(folder: str) -> None:
    theirs, params = FlaxUNet2DConditionModel.from_pretrained(folder)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, theirs.in_channels, theirs.sample_size, theirs.sample_size)).astype(np.float32)
    t = rng.integers(0, 1000, 8).astype(np.int32)
    context = rng.normal(size=(8, 16, theirs.cross_attention_dim)).astype(np.float32)
    drop_in, _ = jax_impl.FlaxUNet2DConditionModel.from_pretrained(folder)
    with tempfile.TemporaryDirectory() as pt:  # the same weights in diffusers' PyTorch U-Net
        drop_in.save_pretrained(pt, params=params)
        with torch.no_grad():
            reference = UNet2DConditionModel.from_pretrained(pt).eval()(*map(torch.from_numpy, (x, t, context)))
    expected = reference.sample.numpy()
    rel = lambda out: float(np.linalg.norm(np.asarray(out) - expected) / np.linalg.norm(expected))  # noqa: E731
    print(f"this project's drop-in: {rel(drop_in.apply({'params': params}, x, t, context).sample):.2e}")
    x, t, context = map(jnp.asarray, (x, t, context))  # diffusers' Flax U-Net wants jax arrays, not numpy's
    flax_error = lambda: f"{rel(theirs.apply({'params': params}, x, t, context).sample):.2e}"  # noqa: E731
    print(f"diffusers 0.39 FlaxUNet2DConditionModel: {flax_error()}")
    # Its attention module's `nn`, with PyTorch's choices: the Transformer2D GroupNorm's eps, then the GEGLU's GELU.
    torch_like = types.SimpleNamespace(**{k: getattr(nn, k) for k in dir(nn) if not k.startswith("__")})
    attention_flax.nn = torch_like
    torch_like.GroupNorm = lambda **kw: nn.GroupNorm(**{**kw, "epsilon": 1e-6})
    print(f"  with the Transformer2D GroupNorm's eps 1e-6: {flax_error()}")
    torch_like.gelu = lambda v: jax.nn.gelu(v, approximate=False)
    print(f"  and the exact GELU in the GEGLU: {flax_error()}")
    stats = flax.linen.normalization._compute_stats  # every norm: E[(x - mean)^2], not E[x^2] - E[x]^2
    flax.linen.normalization._compute_stats = lambda *a, **kw: stats(*a, **{**kw, "use_fast_variance": False})
    print(f"  and two-pass variances in its norms: {flax_error()}")


if __name__ == "__main__":
    main(sys.argv[1])
