"""Framework-free checkpoint plans: which named blocks are recomputed, and what they still save.

Block and layer names (``down.1``, ``mid``, ``up.2.attentions.1``) are the plan's vocabulary in PyTorch, Flax
and YAML; `resolve_plan` turns a policy into a `CheckpointPlan`. The grammar: docs/spec_and_plans.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from shared_configs.spec import SpecError, UNetSpec, block_names

# Operation classes a selective plan can save, one vocabulary for torch and JAX. Everything not
# named is recomputed (activations, softmax, elementwise ops, and norms unless "norm" is saved).
OP_CLASSES: tuple[str, ...] = ("conv", "matmul", "attention", "norm")
# Named op-level presets: (base policy, saved ops, offload).
PRESETS = {"save_convs": ("full", ("conv", "matmul"), False), "offload_convs": ("full", ("conv", "matmul"), True)}
NAMED_POLICIES: tuple[str, ...] = ("none", "full", "balanced", "layers", "every:N", *PRESETS)
Policy = str | Sequence[str] | None


@dataclass(frozen=True)
class CheckpointPlan:
    """The recomputed blocks/layers in forward order, the op classes they still ``save`` (``offload``: in host
    memory). Frozen and hashable: Flax modules carry it as an attribute."""

    policy: str
    recompute: tuple[str, ...]
    save: tuple[str, ...] = ()
    offload: bool = False
    # Per-name save sets of a ``;``-grouped plan, for the names whose set differs from ``save``.
    unit_save: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def save_for(self, name: str) -> tuple[str, ...]:
        """The op classes recomputed unit ``name`` keeps (``()`` for a name the plan does not recompute)."""
        return () if name not in self.recompute else dict(self.unit_save).get(name, self.save)

    @property
    def saves(self) -> bool:
        """Whether any recomputed unit keeps op outputs."""
        return bool(self.save) or any(ops for _, ops in self.unit_save)

    def __contains__(self, name: object) -> bool:
        return name in self.recompute

    def __bool__(self) -> bool:
        return bool(self.recompute)


def layer_names(spec: UNetSpec) -> list[str]:
    """Every ResNet and attention/transformer layer in forward order (diffusers' granularity)."""
    down = [n for i, a in enumerate(spec.down_attention) for n in _level_layers(f"down.{i}", spec.layers_per_block, a)]
    mid = [*_level_layers("mid", 1, spec.mid_attention), "mid.resnets.1"]  # ResNet, attention, ResNet
    up = [
        n
        for i, a in enumerate(spec.up_attention_resolved)
        for n in _level_layers(f"up.{i}", spec.layers_per_block + 1, a)
    ]
    return down + mid + up


def all_names(spec: UNetSpec) -> list[str]:
    return block_names(spec) + layer_names(spec)


def _level_layers(prefix: str, count: int, attention: str) -> list[str]:
    """A block's ``count`` ResNets, each with its attention where the block has one."""
    kinds = ("resnets",) if attention == "none" else ("resnets", "attentions")
    return [f"{prefix}.{kind}.{j}" for j in range(count) for kind in kinds]


_NAMED: dict[str, Callable[[UNetSpec], list[str]]] = {
    "none": lambda spec: [],
    "full": block_names,
    # The usual advice: the outermost blocks run at full resolution, where recomputing the
    # convolutions costs the most time per byte saved, and down.0's outputs are kept as
    # skips anyway. Keep those two plain (down.0, the last up block) and recompute everything deeper.
    "balanced": lambda spec: [n for n in block_names(spec) if n not in ("down.0", f"up.{spec.num_levels - 1}")],
    "layers": layer_names,
}


def resolve_plan(
    spec: UNetSpec,
    policy: Policy | CheckpointPlan = None,
    save: Iterable[str] | None = None,
    offload: bool | None = None,
) -> CheckpointPlan:
    """Resolve a policy for ``spec`` (None: the spec's own ``checkpoint``); ``save``/``offload`` override its own."""
    if isinstance(policy, CheckpointPlan):  # its names checked and put in forward order
        plan = replace(policy, recompute=_explicit(spec, list(policy.recompute)).recompute)
    else:
        plan = _resolve_base(spec, policy)
    if save is None and offload is None:
        return _check_ops(plan)
    if plan.unit_save and save is None:
        raise SpecError(f"offload: give {plan.policy!r} its /offload inside each ';' group")
    new_save = plan.save if save is None else _ops(save)
    new_offload = plan.offload if offload is None else bool(offload)
    base = ",".join(plan.recompute) if ";" in plan.policy else plan.policy.split("/")[0]
    name = base + _suffix(new_save, new_offload)
    return _check_ops(replace(plan, policy=name, save=new_save, offload=new_offload, unit_save=()))


def _resolve_base(spec: UNetSpec, policy: Policy) -> CheckpointPlan:
    if policy is None:
        policy = spec.checkpoint if spec.checkpoint is not None else "none"
    if not isinstance(policy, str):
        return _explicit(spec, list(policy))
    key = policy.strip()
    if ";" in key:
        return _groups(spec, key)
    if key in PRESETS:
        base, ops, offload = PRESETS[key]
        return CheckpointPlan(key, tuple(_NAMED[base](spec)), ops, offload)
    if "/" in key:
        return _with_modifiers(spec, key)
    if key in _NAMED:
        return CheckpointPlan(key, tuple(_NAMED[key](spec)))
    if key.startswith("every:"):
        return CheckpointPlan(key, tuple(block_names(spec)[:: _every_n(key)]))
    if "," in key or "." in key or key == "mid":
        return _explicit(spec, [n.strip() for n in key.split(",") if n.strip()])
    raise SpecError(
        f"policy: unknown policy {policy!r} (allowed: {', '.join(NAMED_POLICIES)}, or a list of block names)"
    )


def _with_modifiers(spec: UNetSpec, key: str) -> CheckpointPlan:
    """``BASE/save=op,op/offload``: a base policy and its op-level modifiers."""
    base, *mods = (part.strip() for part in key.split("/"))
    save: tuple[str, ...] = ()
    offload = False
    for mod in mods:
        if mod.startswith("save="):
            save = _ops(mod.removeprefix("save="))
        elif mod == "offload":
            offload = True
        else:
            raise SpecError(f"policy: unknown modifier {mod!r} in {key!r} (allowed: save=OP,OP..., offload)")
    return resolve_plan(spec, base, save, offload)


def _groups(spec: UNetSpec, key: str) -> CheckpointPlan:
    """``GROUP;GROUP...``: each group a policy of its own, over disjoint names, with its own save set."""
    plans = [_check_ops(_resolve_base(spec, part)) for part in key.split(";") if part.strip()]
    names = [name for plan in plans for name in plan.recompute]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise SpecError(f"policy: {twice[0]!r} is named in two ';' groups of {key!r}")
    offloads = {plan.offload for plan in plans if plan.save}
    if len(offloads) > 1:
        raise SpecError(f"offload: every ';' group of {key!r} that saves ops must say /offload, or none")
    merged = _explicit(spec, names)
    save_of = {name: plan.save for plan in plans for name in plan.recompute}
    unit_save = tuple((name, save_of[name]) for name in merged.recompute if save_of[name])
    policy = ";".join(plan.policy for plan in plans if plan.recompute) or "none"
    return CheckpointPlan(policy, merged.recompute, (), offloads == {True}, unit_save)


def _ops(names: Iterable[str]) -> tuple[str, ...]:
    """Validated op classes in `OP_CLASSES` order, duplicates dropped."""
    if isinstance(names, str):
        names = names.replace("+", ",").split(",")
    chosen = {n.strip() for n in names if n.strip()}
    if unknown := [name for name in chosen if name not in OP_CLASSES]:
        raise SpecError(f"save: unknown op {unknown[0]!r} (allowed: {', '.join(OP_CLASSES)})")
    return tuple(op for op in OP_CLASSES if op in chosen)


def _suffix(save: tuple[str, ...], offload: bool) -> str:
    return (f"/save={','.join(save)}" if save else "") + ("/offload" if offload else "")


def _check_ops(plan: CheckpointPlan) -> CheckpointPlan:
    _ops(plan.save)
    if plan.save and not plan.recompute:
        raise SpecError(f"save: policy {plan.policy!r} recomputes no block, so there is nothing to save inside")
    if plan.offload and not plan.saves:
        raise SpecError(
            f"offload: policy {plan.policy!r} saves no op to offload; add save=OP, e.g. full/save=conv/offload"
        )
    return plan


def _every_n(key: str) -> int:
    value = key.removeprefix("every:")
    if not value.isdigit() or int(value) < 1:
        raise SpecError(f"policy: {key!r} needs a positive integer, e.g. every:2")
    return int(value)


def _explicit(spec: UNetSpec, names: list[str]) -> CheckpointPlan:
    valid = all_names(spec)
    if unknown := [name for name in names if not isinstance(name, str) or name not in valid]:
        raise SpecError(f"policy: unknown block name {unknown[0]!r} (valid: {', '.join(valid)})")
    chosen = set(names)
    if inside := [name for name in chosen if _parent_block(name) in chosen]:
        name = inside[0]
        raise SpecError(f"policy: {name!r} lies inside {_parent_block(name)!r}, which is already recomputed")
    ordered = tuple(n for n in valid if n in chosen)
    return CheckpointPlan(",".join(ordered) or "none", ordered)


def _parent_block(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] == "mid":
        return "mid" if len(parts) > 1 else None
    return ".".join(parts[:2]) if len(parts) > 2 else None
