"""The whole training step beside the U-Net, as diffusers' fine-tuning scripts keep it: the VAE (not with cached
latents) and the text encoder(s), frozen in the weight dtype or trained. `family` names them by cross-attention
width; `whole_step` adds them to a U-Net profile. No torch or jax import; docs/regimes.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared_configs.inputs import LATENT_SCALE
from shared_configs.pair import ControlNetPairSpec
from shared_configs.planning.budget import Profile, raised, with_static_bytes
from shared_configs.planning.optimizer_step import Trained, implementation, temporaries
from shared_configs.regime import Regime, modelled_state_delta
from shared_configs.spec import SpecError, UNetSpec

if TYPE_CHECKING:
    from shared_configs.planning.pipeline import Workload

VAE = {  # AutoencoderKL of SD 1.x, 2.x and SDXL (stable-diffusion-v1-5/vae/config.json)
    "in_channels": 3,
    "out_channels": 3,
    "latent_channels": 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
}
_CLIP = {"vocab_size": 49408, "max_position_embeddings": 77}
CLIP_L = {
    **_CLIP,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
}
OPENCLIP_H = {
    **_CLIP,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 23,
    "num_attention_heads": 16,
    "hidden_act": "gelu",
    "projection_dim": 512,
}
OPENCLIP_BIGG = {
    **_CLIP,
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "hidden_act": "gelu",
    "projection_dim": 1280,
}
# By the U-Net's cross_attention_dim: (family, its text encoders as (name, kind, config)).
FAMILIES: dict[int, tuple[str, tuple[tuple[str, str, dict[str, Any]], ...]]] = {
    768: ("SD 1.x", (("text_encoder", "clip", CLIP_L),)),
    1024: ("SD 2.x", (("text_encoder", "clip", OPENCLIP_H),)),
    2048: ("SDXL", (("text_encoder", "clip", CLIP_L), ("text_encoder_2", "clip-projection", OPENCLIP_BIGG))),
}


@dataclass(frozen=True)
class Encoder:
    """One model beside the U-Net (``kind``: vae | clip | clip-projection), its config as JSON text."""

    name: str
    kind: str
    config: str
    dtype: str
    trained: bool = False
    image_size: int = 512
    tokens: int = 77
    hidden_states: bool = False  # SDXL's scripts take the penultimate hidden state: every layer's is returned
    optimizer: str = "adamw"  # trained: the optimizer whose state is measured (the regime's, as profiled)

    @property
    def config_dict(self) -> dict[str, Any]:
        return json.loads(self.config)


def pipeline_configs(source: str) -> str | None:
    """The VAE and text encoder configs of a local pipeline folder, as JSON text; None for a U-Net folder or repo id."""
    root = Path(source)
    pipeline = root if (root / "unet").is_dir() else root.parent if root.name == "unet" else None
    if pipeline is None:
        return None
    paths = {name: pipeline / name / "config.json" for name in ("vae", "text_encoder", "text_encoder_2")}
    found = {name: json.loads(path.read_text()) for name, path in paths.items() if path.is_file()}
    return json.dumps(found, sort_keys=True) if found else None


def family(spec: UNetSpec) -> tuple[str, tuple[tuple[str, str, dict[str, Any]], ...]]:
    """The family of ``spec`` by its cross-attention width; a one-line error for any other."""
    width = spec.cross_attention_dim
    if width not in FAMILIES:
        known = ", ".join(f"{w} ({FAMILIES[w][0]})" for w in FAMILIES)
        raise SpecError(
            f"--with-encoders: no known text encoders for cross_attention_dim {width} (known: {known}); "
            "plan from a diffusers pipeline folder, which names its own"
        )
    return FAMILIES[width]


def encoders_of(workload: Workload) -> list[Encoder]:
    """The models ``workload``'s step runs beside its U-Net (`family`'s, or its pipeline folder's), frozen in
    diffusers' ``weight_dtype``, trained in float32; a one-line error for a U-Net of no known family."""
    if not (workload.with_encoders or workload.train_text_encoder):
        return []
    spec = workload.spec.unet if isinstance(workload.spec, ControlNetPairSpec) else workload.spec
    configs = json.loads(workload.encoder_configs) if workload.encoder_configs else {}
    name, texts = family(spec) if not configs else ("folder", _folder_texts(configs))
    dtype = workload.regime.compute_dtype or "float32"  # diffusers' weight_dtype
    sdxl = name == "SDXL" or len(texts) > 1
    out = []
    if not workload.cached_latents:
        vae = configs.get("vae", VAE)
        fields = json.dumps({k: vae[k] for k in VAE if k in vae})  # those the VAE's forward reads
        out.append(
            Encoder("vae", "vae", fields, "float32" if sdxl else dtype, image_size=LATENT_SCALE * spec.sample_size)
        )
    for text_name, kind, config in texts:
        trained = workload.train_text_encoder and text_name == "text_encoder"
        out.append(
            Encoder(
                text_name,
                kind,
                json.dumps(config),
                "float32" if trained else dtype,
                trained,
                hidden_states=sdxl,
                optimizer=workload.regime.profiled.optimizer if trained else Encoder.optimizer,
            )
        )
    return out


def _folder_texts(configs: dict[str, dict[str, Any]]) -> tuple[tuple[str, str, dict[str, Any]], ...]:
    """A pipeline folder's text encoders as `FAMILIES` lists them: the fields of `CLIP_L` their forward reads."""
    texts = {name: configs[name] for name in ("text_encoder", "text_encoder_2") if name in configs}
    return tuple(
        (
            name,
            "clip-projection" if "WithProjection" in str(c.get("architectures")) else "clip",
            {k: c[k] for k in CLIP_L if k in c},
        )
        for name, c in texts.items()
    )


def input_bytes(encoder: Encoder, batch_size: int) -> int:
    """What an encoder reads: the batch's images in its dtype, or the token ids (int64)."""
    if encoder.kind == "vae":
        return batch_size * 3 * encoder.image_size**2 * (4 if encoder.dtype == "float32" else 2)
    return batch_size * encoder.tokens * 8


def whole_step(
    profile: Profile,
    regime: Regime,
    encoders: list[Encoder],
    measured: dict[str, dict[str, int]],
    device: str = "cpu",
    optimizer_impl: str | None = None,
) -> Profile:
    """``profile`` (the U-Net's step) with ``encoders`` beside it (``measured``: `torch_impl.encoders`): their weights
    (a trained one's state and activations) throughout, and each one's forward and backward as phases."""
    if not encoders:
        return profile
    trained = [e for e in encoders if e.trained]
    # as the U-Net's: the state measured under the profiled optimizer, 8-bit AdamW's layout modelled beside it
    state = sum(
        measured[e.name]["state"] + modelled_state_delta(regime, [measured[e.name]["params"]], 4) for e in trained
    )
    grads = sum(measured[e.name]["weights"] for e in trained)  # float32, as their weights
    static = sum(measured[e.name]["weights"] for e in encoders) + state + (grads if regime.keep_grads else 0)
    out = with_static_bytes(profile, static)
    units = raised(out.units, sum(measured[e.name]["keep"] for e in trained))  # a trained encoder's activations
    base = out.static_bytes + (profile.grad_bytes if regime.keep_grads else 0)
    # the trained encoders' share of the optimizer step's temporaries: foreach's copy of their weights (a
    # per-tensor implementation's, one tensor at a time, is left to the U-Net's: ``largest`` 0)
    name = implementation(regime.optimizer, device, optimizer_impl)
    extra = sum(temporaries(regime.optimizer, name, Trained(measured[e.name]["params"], 0)) for e in trained)
    phases = {"optimizer": out.opt_peak + (0 if regime.keep_grads else grads) + extra}
    for e in encoders:
        m = measured[e.name]
        phases[f"{e.name} forward"] = base + input_bytes(e, profile.batch_size) + m["peak"]
        if e.trained:  # after the U-Net's backward: its gradients alive, whatever zero_grad does
            unet_grads = 0 if regime.keep_grads else profile.grad_bytes
            phases[f"{e.name} backward"] = base + unet_grads + input_bytes(e, profile.batch_size) + m["backward_peak"]
    seconds = profile.step_time_s + (
        sum(measured[e.name].get("flops", 0) for e in encoders) / profile.flops_per_s if profile.flops_per_s else 0.0
    )
    return replace(out, units=units, opt_peak=max(phases.values()), phases=phases, step_time_s=seconds)
