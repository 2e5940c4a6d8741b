"""Where the planner's measurements are cached, and the versions their keys carry.

Profiles and the encoders' figures are JSON files under ``$UNET_REMAT_PLAN_CACHE`` (default
``~/.cache/unet-remat/plan``), each keyed by its request and the framework's versions, so a new
torch or jax never reads an old measurement. Docs: docs/planning.md "Caching".
"""

from __future__ import annotations

import os
from importlib import metadata
from pathlib import Path

CACHE_ENV = "UNET_REMAT_PLAN_CACHE"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "unet-remat" / "plan")


def versions(framework: str) -> dict[str, str]:
    """The versions of the packages that decide ``framework``'s measurements."""
    names = {"torch": ["torch"], "jax": ["jax", "jaxlib", "flax", "optax"]}[framework]
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "?"
    return out
