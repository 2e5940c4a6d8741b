"""Framework-free checkpoint plans: which named blocks are recomputed in the backward pass.

Block names are the plan's vocabulary and are identical in PyTorch, Flax and YAML:

* blocks: ``down.0 … down.{n-1}``, ``mid``, ``up.0 … up.{n-1}`` (``up.0`` is the deepest);
* layers, one level finer: ``down.1.resnets.0``, ``down.1.attentions.0``, ``mid.resnets.1``,
  ``up.2.attentions.1``, ...

A policy is a name (``none``, ``full``, ``balanced``, ``layers``, ``every:N``), a list of block
or layer names, or a comma-separated string of names. `resolve_plan` turns it into a
`CheckpointPlan`, which each framework applies with its own mechanism.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shared_configs.spec import SpecError, UNetSpec

NAMED_POLICIES: tuple[str, ...] = ("none", "full", "balanced", "layers", "every:N")
Policy = str | Sequence[str] | None


@dataclass(frozen=True)
class CheckpointPlan:
    """The resolved plan: the names of the recomputed blocks/layers, in forward order."""

    policy: str
    recompute: tuple[str, ...]

    def __contains__(self, name: object) -> bool:
        return name in self.recompute

    def __bool__(self) -> bool:
        return bool(self.recompute)


def block_names(spec: UNetSpec) -> list[str]:
    """Coarse blocks in forward order: down.*, mid, up.*."""
    n = spec.num_levels
    return [f"down.{i}" for i in range(n)] + ["mid"] + [f"up.{i}" for i in range(n)]


def layer_names(spec: UNetSpec) -> list[str]:
    """Every ResNet and attention/transformer layer in forward order (diffusers' granularity)."""
    names: list[str] = []
    for i, attn in enumerate(spec.down_attention):
        names += _level_layers(f"down.{i}", spec.layers_per_block, attn)
    names.append("mid.resnets.0")
    if spec.mid_attention != "none":
        names.append("mid.attentions.0")
    names.append("mid.resnets.1")
    for i, attn in enumerate(spec.up_attention_resolved):
        names += _level_layers(f"up.{i}", spec.layers_per_block + 1, attn)
    return names


def all_names(spec: UNetSpec) -> list[str]:
    return block_names(spec) + layer_names(spec)


def _level_layers(prefix: str, count: int, attention: str) -> list[str]:
    names = []
    for j in range(count):
        names.append(f"{prefix}.resnets.{j}")
        if attention != "none":
            names.append(f"{prefix}.attentions.{j}")
    return names


def _balanced(spec: UNetSpec) -> list[str]:
    # The usual advice: the outermost blocks run at full resolution, where recomputing the
    # convolutions costs the most time per byte saved, and down.0's outputs are kept as
    # skips anyway. Keep those two plain and recompute everything deeper.
    n = spec.num_levels
    return [f"down.{i}" for i in range(1, n)] + ["mid"] + [f"up.{i}" for i in range(n - 1)]


_NAMED: dict[str, Callable[[UNetSpec], list[str]]] = {
    "none": lambda spec: [],
    "full": block_names,
    "balanced": _balanced,
    "layers": layer_names,
}


def resolve_plan(spec: UNetSpec, policy: Policy | CheckpointPlan = None) -> CheckpointPlan:
    """Resolve a policy for ``spec``; ``None`` takes the spec's own ``checkpoint`` field."""
    if isinstance(policy, CheckpointPlan):
        return resolve_plan(spec, list(policy.recompute)) if policy.recompute else policy
    if policy is None:
        policy = spec.checkpoint if spec.checkpoint is not None else "none"
    if isinstance(policy, str):
        key = policy.strip()
        if key in _NAMED:
            return CheckpointPlan(key, tuple(_NAMED[key](spec)))
        if key.startswith("every:"):
            return CheckpointPlan(key, tuple(block_names(spec)[:: _every_n(key)]))
        if "," in key or "." in key or key == "mid":
            return _explicit(spec, [n.strip() for n in key.split(",") if n.strip()])
        raise SpecError(
            f"policy: unknown policy {policy!r} (allowed: {', '.join(NAMED_POLICIES)}, or a list of block names)"
        )
    return _explicit(spec, list(policy))


def _every_n(key: str) -> int:
    value = key.removeprefix("every:")
    if not value.isdigit() or int(value) < 1:
        raise SpecError(f"policy: {key!r} needs a positive integer, e.g. every:2")
    return int(value)


def _explicit(spec: UNetSpec, names: list[str]) -> CheckpointPlan:
    valid = all_names(spec)
    for name in names:
        if not isinstance(name, str) or name not in valid:
            raise SpecError(f"policy: unknown block name {name!r} (valid: {', '.join(valid)})")
    chosen = set(names)
    for name in chosen:
        parent = _parent_block(name)
        if parent is not None and parent in chosen:
            raise SpecError(f"policy: {name!r} lies inside {parent!r}, which is already recomputed")
    ordered = tuple(n for n in valid if n in chosen)
    return CheckpointPlan(",".join(ordered) or "none", ordered)


def _parent_block(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == "mid":
        return "mid" if len(parts) > 1 else None
    return ".".join(parts[:2]) if len(parts) > 2 else None
