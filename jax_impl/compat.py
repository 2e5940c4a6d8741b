"""Every reach of jax_impl (and the benchmark's JAX side) into JAX's private API, in one place.

`REACHES` names each one and says why it is reached; `CHECKED`, the version they were checked against.
`reach` resolves a name or fails naming it (`shared_configs.compat`); tests/test_compat.py reaches every
one. Mirror: `torch_impl/compat.py`.
"""

from __future__ import annotations

from typing import Any

from shared_configs import compat as shared

CHECKED = "jax 0.10.2"
REACHES = {  # "module:attribute" -> why
    "jax._src.clusters:ClusterEnv._cluster_types": "the cluster jax.distributed.initialize() would detect",
    "jax._src.xla_bridge:backends_are_initialized": "whether JAX's backends exist (too late to join processes)",
    "jax._src.distributed:global_state": "the coordination service's key-value store: waiting for the others",
    "jax._src.ad_checkpoint:saved_residuals": "what autodiff keeps, as data (public only as print_saved_residuals)",
    "jax._src.ad_checkpoint:name_p": "the primitive checkpoint_name binds: the benchmark's named residuals",
}


def reach(name: str) -> Any:
    """``"module:attribute.path"`` resolved, or `shared_configs.compat.MovedError` naming it."""
    return shared.reach(name, CHECKED)


def cluster_types() -> list[Any]:
    """The clusters `jax.distributed.initialize()` tries, in its order."""
    return reach("jax._src.clusters:ClusterEnv._cluster_types")


def backends_started() -> bool:
    return bool(reach("jax._src.xla_bridge:backends_are_initialized")())


def coordination_client() -> Any:
    """The client of `jax.distributed`'s coordination service (its key-value store)."""
    return reach("jax._src.distributed:global_state").client


def saved_residuals(fn: Any, *args: Any) -> list[tuple[Any, str]]:
    """What autodiff keeps of ``fn(*args)``: (abstract value, where it comes from) per residual."""
    return reach("jax._src.ad_checkpoint:saved_residuals")(fn, *args)


def checkpoint_name_primitive() -> Any:
    """The primitive `jax.ad_checkpoint.checkpoint_name` binds."""
    return reach("jax._src.ad_checkpoint:name_p")
