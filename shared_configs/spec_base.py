"""The spec's building blocks: strict scalar types, the frozen base model, and its one-line error.

Shared by `shared_configs.spec` and `shared_configs.embedding_specs` (which `spec` re-exports).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Strict

# Strict scalars: `in_channels: true` or `norm_eps: "1e-5"` is an error, never coerced. A float
# field takes an int (YAML `1` for `1.0`), not a bool; non-finite floats are refused model-wide.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class SpecError(ValueError):
    """A spec or policy problem, reported as one line naming the field."""


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise SpecError(f"{field}: {message}")
