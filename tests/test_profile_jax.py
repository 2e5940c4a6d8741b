"""The JAX profile's shortcuts against the long way: the timed step's state drawn at the init's
shapes (`jax_impl.profile.setup(drawn=True)`), its compiles two at a time, and a check that
reuses the profile's set-up (`jax_impl.profile.peaks` in a kept worker)."""

from __future__ import annotations

import pytest

from tests.helpers.specs import variant

SPEC = variant("tiny", sample_size=16, dropout=0.0)
BATCH, CONTEXT = 2, 5


@pytest.mark.slow
def test_a_drawn_state_has_the_inits_shapes() -> None:
    import jax

    from jax_impl import profile as profile_jax

    def shapes(s: dict) -> list:
        return [(a.shape, str(a.dtype)) for a in jax.tree.leaves(s["args"])]

    drawn = profile_jax.setup(SPEC, BATCH, CONTEXT, None, run=True, drawn=True)
    abstract = profile_jax.setup(SPEC, BATCH, CONTEXT, None, run=False)
    assert jax.tree.structure(drawn["args"]) == jax.tree.structure(abstract["args"])
    assert shapes(drawn) == shapes(abstract)
    assert all(isinstance(a, jax.Array) for a in jax.tree.leaves(drawn["args"]))


@pytest.mark.heavy  # minutes of XLA compiles
def test_compiles_two_at_a_time_and_the_kept_check_give_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The profile's compiles, two at a time, peak where the check's compiles of the same plans do,
    one at a time, on the profile's own set-up (no other made)."""
    from jax_impl import profile as profile_jax

    runs = profile_jax.profile(SPEC, BATCH, CONTEXT, shapes=True, repeats=0)["meta"]["runs"]
    policies = list(runs)[:2]  # none, full on every block
    monkeypatch.setattr(profile_jax, "setup", lambda *a, **k: pytest.fail("set up again"))
    kept = profile_jax.peaks(SPEC, BATCH, policies, CONTEXT)["peaks"]
    assert kept == {p: runs[p]["peak_bytes"] for p in policies}
