"""The ControlNet training step, framework-free: its two networks, their units, one plan over both.

`ControlNetPairSpec` is diffusers' ``train_controlnet.py`` step: a ControlNet trained against a frozen U-Net.
One plan covers both: the U-Net's names, and the same behind ``controlnet.``; a named policy means both,
``controlnet:P`` / ``unet:P`` one (`split_pair_plan`, `pair_policy`). docs/planning.md "The ControlNet step".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from shared_configs.controlnet import ControlNetSpec, controlnet_names, resolve_controlnet_plan
from shared_configs.loader import load_spec, spec_from_dict
from shared_configs.regime import Regime
from shared_configs.spec import SpecError, UNetSpec, _Frozen
from shared_configs.training.data import Batch, Dataset, example_batch, load_dataset
from shared_configs.vocabulary import CheckpointPlan, all_names, resolve_plan

CONTROLNET = "controlnet."  # the prefix of the ControlNet's unit names in a pair plan
NETWORKS = ("controlnet", "unet")  # `controlnet:P`, `unet:P`: the named policy P on that network only
COND_SEED = 7  # the example conditioning image's own seed: the batch's numbers stay as they are


class ControlNetPairSpec(_Frozen):
    """The ControlNet training step's model: ``controlnet`` (trained) on its ``unet`` (frozen)."""

    controlnet: ControlNetSpec

    @property
    def unet(self) -> UNetSpec:
        return self.controlnet.unet

    @property
    def name(self) -> str:
        return f"{self.unet.name}+controlnet"

    @property
    def sample_size(self) -> int:
        return self.unet.sample_size

    def with_sample_size(self, size: int) -> ControlNetPairSpec:
        unet = spec_from_dict({**self.unet.model_dump(), "sample_size": size})
        return ControlNetPairSpec(controlnet=self.controlnet.model_copy(update={"unet": unet}))


def controlnet_pair(unet: UNetSpec | str, **options: Any) -> ControlNetPairSpec:
    """The pair of ``unet`` and the ControlNet made from it (``options``: other `ControlNetSpec` fields)."""
    spec = load_spec(unet) if isinstance(unet, str) else unet
    return ControlNetPairSpec(controlnet=ControlNetSpec(name=f"{spec.name}_controlnet", unet=spec, **options))


def check_pair_workload(spec: ControlNetPairSpec, regime: Regime) -> None:
    """Refuse, in one line, what the ControlNet step is not planned for."""
    if spec.unet.norm_kind != "group":
        raise SpecError(
            f"norm_kind: the ControlNet step is planned for GroupNorm U-Nets (diffusers' ControlNet "
            f"has no {spec.unet.norm_kind} norm); spec {spec.unet.name!r}"
        )
    if regime.lora_rank is not None:
        raise SpecError(
            f"--trainable: the ControlNet step trains the whole ControlNet (diffusers' "
            f"train_controlnet), not {regime.trainable}; use --trainable all"
        )


def workload_spec(data: Mapping[str, Any]) -> UNetSpec | ControlNetPairSpec:
    """A U-Net spec or a pair spec from its ``model_dump`` (a planner worker's request)."""
    return ControlNetPairSpec.model_validate(data) if "controlnet" in data else spec_from_dict(dict(data))


@dataclass(frozen=True)
class PairPlan:
    """A pair policy resolved: the policy string, the U-Net's plan and the ControlNet's."""

    policy: str
    unet: CheckpointPlan
    controlnet: CheckpointPlan

    @property
    def recompute(self) -> tuple[str, ...]:
        """Every recomputed unit under its pair name, ControlNet first (forward order)."""
        return (*(CONTROLNET + n for n in self.controlnet.recompute), *self.unet.recompute)

    def save_for(self, name: str) -> tuple[str, ...]:
        """The op classes the recomputed unit ``name`` (a pair name) keeps."""
        mine = name.startswith(CONTROLNET)
        return self.controlnet.save_for(name.removeprefix(CONTROLNET)) if mine else self.unet.save_for(name)


def pair_names(spec: ControlNetPairSpec) -> list[str]:
    """Every unit a pair plan can name, in forward order: the ControlNet's blocks and layers, then the U-Net's."""
    cn = controlnet_names(spec.unet) + controlnet_names(spec.unet, layers=True)
    return [CONTROLNET + n for n in cn] + all_names(spec.unet)


def split_pair_plan(spec: ControlNetPairSpec, policy: str | PairPlan | None = None) -> PairPlan:
    """A pair policy (see the module doc) as the U-Net's plan and the ControlNet's."""
    if isinstance(policy, PairPlan):
        return policy
    text = (policy or "none").strip()
    allowed = pair_names(spec)
    unet_groups, cn_groups = [], []
    for group in (g.strip() for g in text.split(";") if g.strip()):
        network, colon, rest = group.partition(":")
        if colon and network.strip() in NETWORKS:  # `controlnet:layers`: a policy on one network only
            (cn_groups if network.strip() == "controlnet" else unet_groups).append(rest.strip())
        elif _named(group):  # a named policy: on both networks
            unet_groups.append(group)
            cn_groups.append(group)
        else:
            base, sep, mods = group.partition("/")
            names = [n.strip() for n in base.split(",") if n.strip()]
            if bad := [n for n in names if n not in allowed]:
                raise SpecError(
                    f"policy: unknown unit {bad[0]!r} in {text!r} (allowed: a named policy for both networks, "
                    f"or {', '.join(allowed)})"
                )
            mine = [n for n in names if not n.startswith(CONTROLNET)]
            theirs = [n.removeprefix(CONTROLNET) for n in names if n.startswith(CONTROLNET)]
            unet_groups += [",".join(mine) + sep + mods] if mine else []
            cn_groups += [",".join(theirs) + sep + mods] if theirs else []
    unet = resolve_plan(spec.unet, ";".join(unet_groups) or "none")
    try:
        controlnet = resolve_controlnet_plan(spec.controlnet, ";".join(cn_groups) or "none")
    except SpecError as err:  # its names are written without the prefix there
        raise SpecError(f"{err} (in the ControlNet's units, {CONTROLNET}* here)") from None
    return PairPlan(pair_policy(unet, controlnet), unet, controlnet)


def _named(group: str) -> bool:
    """Whether a ``;`` group is a named policy (``full``, ``layers/save=conv``), not unit names."""
    base = group.partition("/")[0].strip()
    return "," not in base and "." not in base and base != "mid"


def pair_policy(unet: CheckpointPlan, controlnet: CheckpointPlan) -> str:
    """The pair policy of two plans: a named policy on both or one, else the units by pair name, grouped by save set."""
    if unet.policy == controlnet.policy and all(_named(g) for g in unet.policy.split(";")):
        return unet.policy
    for plan, other, network in ((controlnet, unet, "controlnet"), (unet, controlnet, "unet")):
        if not other.recompute and all(_named(g) for g in plan.policy.split(";")):
            return f"{network}:{plan.policy}"
    groups: dict[tuple[tuple[str, ...], bool], list[str]] = {}
    for plan, prefix in ((controlnet, CONTROLNET), (unet, "")):
        for name in plan.recompute:
            save = plan.save_for(name)
            groups.setdefault((save, plan.offload and bool(save)), []).append(prefix + name)
    parts = [
        ",".join(names) + (f"/save={','.join(save)}" if save else "") + ("/offload" if offload else "")
        for (save, offload), names in groups.items()
    ]
    return ";".join(parts) or "none"


def example_pair_batch(spec: ControlNetPairSpec, batch_size: int, context_length: int = 77) -> Batch:
    """The U-Net's `example_batch` and a seeded conditioning image: the planner's and the benchmark's inputs."""
    batch = example_batch(spec.unet, batch_size, context_length)
    side = spec.sample_size * spec.controlnet.conditioning_factor
    shape = (batch_size, spec.controlnet.conditioning_channels, side, side)
    cond = np.random.default_rng(COND_SEED).uniform(-1.0, 1.0, shape).astype(np.float32)
    return replace(batch, controlnet_cond=cond)


def step_spec(spec: UNetSpec, controlnet: bool, regime: Regime) -> UNetSpec | ControlNetPairSpec:
    """What a training loop's step trains: ``spec``'s U-Net, or (``controlnet``) the pair made from it."""
    if not controlnet:
        return spec
    check_pair_workload(pair := controlnet_pair(spec), regime)
    return pair


def load_step_dataset(kind: str, spec: UNetSpec | ControlNetPairSpec, seed: int = 0) -> Dataset:
    """The data of ``spec``'s training step: `load_dataset`'s, a pair's with each sample's conditioning image."""
    if not isinstance(spec, ControlNetPairSpec):
        return load_dataset(kind, spec, seed)
    return replace(load_dataset(kind, spec.unet, seed), controlnet=spec.controlnet)
