"""The README's JAX snippet runs as written: a jitted training step with dropout on (``train=True``,
its RNG given) and one optax update."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import numpy as np
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.S | re.M)


@pytest.mark.slow
def test_the_readme_jax_snippet_runs_as_written() -> None:
    (snippet,) = [b for b in python_blocks() if "jax_impl.UNet" in b]
    scope: dict = {}
    exec(compile(snippet, str(README), "exec"), scope)
    assert np.isfinite(float(scope["loss"]))
    before = scope["model"].init(jax.random.key(0), scope["x"], scope["t"], scope["ctx"])["params"]
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: bool((a != b).any()), before, scope["params"]))
    assert all(moved)  # one optax update reached every parameter
    step, args = scope["train_step"], (scope["x"], scope["t"], scope["ctx"], np.zeros(scope["x"].shape, "float32"))
    losses = {float(step(scope["params"], scope["opt_state"], *args, jax.random.key(k))[2]) for k in (1, 2)}
    assert len(losses) == 2  # train=True: the dropout RNG changes the step (tiny has dropout 0.1)
