"""The step a planner solves for beyond the U-Net's profile: its encoders and the device it names.

`on_device` makes a U-Net profile the whole step's on the workload's device (`planning.gpu`'s flavour, then
`planning.encoders`, measured by the torch worker and cached). No torch or jax import; docs/regimes.md.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

from shared_configs.files import atomic_write, locked
from shared_configs.planning import gpu, optimizer_step
from shared_configs.planning.budget import Profile, predict
from shared_configs.planning.cache import cache_dir, versions
from shared_configs.planning.encoders import Encoder, encoders_of, whole_step
from shared_configs.planning.workers import run_worker
from shared_configs.progress import note
from shared_configs.spec import SpecError

if TYPE_CHECKING:
    from shared_configs.planning.pipeline import Workload

ENCODER_SCHEMA = 2  # 2: a trained encoder's optimizer state measured ("state")


def raw(workload: Workload) -> Workload:
    """``workload``'s U-Net step alone, as the CPU profile holds it."""
    return replace(
        workload,
        device="cpu",
        with_encoders=False,
        cached_latents=False,
        train_text_encoder=False,
        unfused_attention=False,
        optimizer_impl=None,
        encoder_configs=None,
    )


def check(workload: Workload, framework: str) -> None:
    """Refuse, in one line, what the whole step is not modelled for."""
    extra = workload.with_encoders or workload.train_text_encoder
    if framework == "jax" and (extra or workload.device != "cpu"):
        raise SpecError(
            f"--device {workload.device}, --with-encoders, --train-text-encoder: the GPU flavour and the "
            "encoders are torch's step; use --framework torch"
        )
    if workload.device not in ("cpu", *gpu.DEVICES):
        raise SpecError(f"device: expected one of cpu, {', '.join(gpu.DEVICES)}, got {workload.device!r}")
    if (workload.unfused_attention or workload.optimizer_impl) and workload.device == "cpu":
        raise SpecError("--unfused-attention, --optimizer-impl: how a GPU runs the step; give --device cuda too")
    optimizer_step.implementation(workload.regime.optimizer, workload.device, workload.optimizer_impl)
    encoders_of(workload)  # a width with no known encoders: refused before any profile
    if workload.cached_latents and not workload.with_encoders:
        raise SpecError("--cached-latents: leaves the VAE out of --with-encoders; give --with-encoders too")


def extender(workload: Workload) -> Callable[[Profile, str], Profile]:
    """A function adding ``workload``'s encoders to a profile, on "cpu" or "cuda"."""
    encoders = encoders_of(workload)
    measured = measured_encoders(encoders, workload) if encoders else {}  # none: `whole_step` returns the profile
    return lambda profile, device: whole_step(
        profile, workload.regime, encoders, measured, device, workload.optimizer_impl
    )


def on_device(workload: Workload, framework: str, profile: Profile) -> Profile:
    """``profile`` as the workload's whole step holds it on its device (see the module doc)."""
    if framework != "torch":
        return profile
    if workload.device != "cpu":
        profile = gpu.gpu_profile(profile, workload.spec, workload.regime, card(workload))
    return extender(workload)(profile, "cpu" if workload.device == "cpu" else "cuda")


def card(workload: Workload) -> gpu.Device:
    """The GPU flavour's `gpu.Device` of a workload on a GPU: its attention as the workload says."""
    return replace(
        gpu.DEVICES[workload.device],
        unfused_attention=workload.unfused_attention,
        optimizer_impl=workload.optimizer_impl,
    )


def device_budget(workload: Workload, budget: int) -> int:
    """The allocated peak a plan may reach: ``budget`` itself on the CPU, `gpu.device_budget` on a GPU."""
    return budget if workload.device == "cpu" else gpu.device_budget(budget, gpu.DEVICES[workload.device])


def measured_encoders(encoders: list[Encoder], workload: Workload) -> dict[str, dict[str, int]]:
    """`torch_impl.encoders.measure` of each of ``encoders`` at the workload's batch, cached."""
    autocast = workload.regime.compute_dtype if workload.regime.precision.endswith("-mixed") else None
    request = {
        "framework": "torch",
        "kind": "encoders",
        "batch_size": workload.batch_size,
        "autocast": autocast,
        "encoders": [asdict(e) for e in encoders],
    }
    key = hashlib.sha256(json.dumps([ENCODER_SCHEMA, request, versions("torch")], sort_keys=True).encode())
    path = cache_dir() / f"encoders-{key.hexdigest()[:16]}.json"
    with locked(path):
        if path.is_file():
            with suppress(OSError, ValueError, KeyError):  # a damaged entry is measured again
                return json.loads(path.read_text())["encoders"]
        names = ", ".join(e.name for e in encoders)
        note(f"plan: measuring {names} at batch {workload.batch_size} from shapes (fake tensors) ...")
        found = run_worker(request)
        atomic_write(path, json.dumps(found, indent=1).encode())
        return found["encoders"]


def checked_peak(
    workload: Workload,
    framework: str,
    checked: int,
    assignment: dict[str, str],
    profile: Profile,
    get_profile: Callable[[str, Workload], Profile],
) -> int:
    """A plan's peak checked on the U-Net's step alone, plus what the whole step's ``profile`` predicts beyond it."""
    if workload == raw(workload):
        return checked
    alone, spec = get_profile(framework, raw(workload)), workload.spec
    return checked + predict(profile, spec, assignment).peak_bytes - predict(alone, spec, assignment).peak_bytes
