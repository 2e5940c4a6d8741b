"""`fit_budget`: a byte budget on a training script's own step, for the Flax drop-ins (`jax_impl.diffusers_flax`).

The script's ``jax.pmap(train_step, ...)`` becomes ``fit_budget(jax.pmap, train_step, ..., models=unet,
budget_mib=N)``. On its first call the step is traced once to see what the models are given, then
`jax_impl.plan_for_step` compiles the script's own step (its transform, donation, dtype and batch) per plan,
each from a fresh function (no trace of another plan reused), until XLA's ``memory_analysis()`` fits. The
executable of the plan found runs every step. Docs: docs/flax_users.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jax_impl.diffusers_flax import SEEN, FlaxControlNetModel
from jax_impl.guard import plan_for_step, xla_compile
from shared_configs.pair import ControlNetPairSpec, split_pair_plan
from shared_configs.planning.solver import Infeasible
from shared_configs.progress import say
from shared_configs.regime import Regime
from shared_configs.sizes import MIB

PRECISION = {"float32": "fp32", "bfloat16": "bf16-mixed", "float16": "fp16-mixed"}  # the drop-in's dtype: compute


def fit_budget(
    transform: Callable[..., Any], fun: Callable[..., Any], *args: Any, models: Any, budget_mib: float | None, **kw: Any
) -> Callable[..., Any]:
    """``transform(fun, *args, **kw)`` (``jax.pmap``, ``jax.jit``), its ``models`` (a drop-in, or the ControlNet
    and the U-Net it drives) under the plan whose compiled step fits ``budget_mib`` per device; without a
    budget, exactly ``transform(fun, *args, **kw)``."""
    if budget_mib is None:
        return transform(fun, *args, **kw)
    return BudgetedStep(
        lambda: transform(functools.wraps(fun)(lambda *a, **k: fun(*a, **k)), *args, **kw),
        models if isinstance(models, Sequence) else (models,),
        int(budget_mib * MIB),
    )


class BudgetedStep:
    """The script's step under the plan that fits: planned on the first call's arguments, then run as compiled."""

    def __init__(self, fresh: Callable[[], Any], models: Sequence[Any], budget: int) -> None:
        self._fresh, self.models, self.budget = fresh, tuple(models), budget
        self.plan: str | None = None
        self._compiled: Any = None

    def __call__(self, *args: Any) -> Any:
        if self._compiled is None:
            self._compiled = self._fit(args)
        return self._compiled(*args)

    def _build(self, policy: str) -> Any:
        """The step traced afresh with ``policy`` on the models (a pair policy over a ControlNet and its U-Net)."""
        if isinstance(self.models[0], FlaxControlNetModel):
            pair = split_pair_plan(self._spec(), policy)
            policies = (pair.controlnet.policy, pair.unet.policy)
        else:
            policies = (policy,) * len(self.models)
        for model, plan in zip(self.models, policies, strict=False):
            object.__setattr__(model, "policy", plan)  # read when the fresh function is traced
        return self._fresh()

    def _spec(self) -> Any:
        if not isinstance(self.models[0], FlaxControlNetModel):
            return self.models[0].spec
        return ControlNetPairSpec(controlnet=self.models[0].spec.model_copy(update={"unet": self.models[-1].spec}))

    def _fit(self, args: Sequence[Any]) -> Any:
        seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        token = SEEN.set(seen)
        try:
            self._build("none").lower(*args)  # what the models are given: batch, latent size, context length
        finally:
            SEEN.reset(token)
        (b, _, size, _), (_, context, _) = seen[-1]
        dtype = str(jax.numpy.dtype(self.models[-1].dtype))
        options = {
            "spec": self._spec(),
            "batch_size": b,
            "sample_size": size,
            "context_length": context,
            "regime": Regime(precision=PRECISION[dtype]),
            "attention_chunk": None,
        }
        try:
            sp = plan_for_step(self._build, args, self.budget, **options)
        except Infeasible as err:
            if getattr(err, "history", None):
                raise  # `full`, compiled, is over
            sp = plan_for_step(self._build, args, self.budget, policy="full", **options)  # none predicted to fit
        self.plan = sp.plan
        say(
            f"remat budget: plan {sp.plan}; the compiled step peaks at {sp.compiled / MIB:.1f} MiB of the "
            f"{self.budget / MIB:.1f} MiB budget per device (XLA memory_analysis; {len(sp.history)} compile(s))"
        )
        return xla_compile(self._build(sp.plan).lower(*args))  # the step plan_for_step judged, compiled again
