"""Reaching a library's private API by name, loudly: `torch_impl.compat` and `jax_impl.compat` hold every reach.

A name is ``"module:attribute.path"``; where the library has moved it, `MovedError` names the reach and the
version it was checked against, so that the day a library moves one shows at once, not in a wrong figure.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any


class MovedError(RuntimeError):
    """A private API the project reaches is not where it was checked."""


def reach(name: str, checked: str) -> Any:
    """``name`` (``"module:attribute.path"``) resolved, or a `MovedError` naming it and ``checked`` (the versions)."""
    module, _, path = name.partition(":")
    try:
        return functools.reduce(getattr, path.split(".") if path else [], importlib.import_module(module))
    except (ImportError, AttributeError) as err:
        raise MovedError(f"{name}: not found ({err}); the project reaches it as of {checked}") from None
