"""diffusers 0.39's Flax training scripts on a tiny Stable Diffusion built here, in the old Flax stack (.venv-flax).

Run by that environment's Python (tests/test_flax_scripts.py starts it): ``build ROOT`` writes a Flax pipeline
(U-Net, VAE, CLIP text encoder, a tokenizer of a tiny vocabulary), the three scripts' data sets and stand-ins for
the hub ids the scripts name; ``run SCRIPT ARGS...`` runs a script as ``python SCRIPT ARGS`` would, after the two
changes current JAX needs and the scripts are not ours to make (docs/flax_users.md): ``jnp.clip`` taking
``a_min``/``a_max`` again (diffusers' Flax safety checker) and DreamBooth's ``compilation_cache.initialize_cache``
(gone from JAX) doing nothing. With ``PEAKS=1`` a patched script run without a budget prints, before its first
step, the compiled peaks of that step under ``none`` and ``full``, built as `jax_impl.fit_budget` builds it.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = [*"abcdefghijklmnopqrstuvwxyz", *(f"{c}</w>" for c in "abcdefghijklmnopqrstuvwxyz")]
SPECIAL = ["<|startoftext|>", "<|endoftext|>"]
MAX_LENGTH = 16  # the tokenizer's model_max_length: the text encoder's context
SIZE, BATCH = 128, 8  # images 128 px (latents 16 x 16), 8 per step
COMMIT = "0123456789abcdef0123456789abcdef01234567"  # the hub stand-ins' one snapshot


def build(root: Path) -> None:
    """The pipeline folder, the data sets and the hub cache under ``root``."""
    import jax
    from diffusers import (
        FlaxAutoencoderKL,
        FlaxDDPMScheduler,
        FlaxPNDMScheduler,
        FlaxStableDiffusionPipeline,
        FlaxUNet2DConditionModel,
    )
    from diffusers.pipelines.stable_diffusion import StableDiffusionSafetyChecker
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPTextConfig, CLIPTokenizer, FlaxCLIPTextModel

    words = root / "words"
    words.mkdir(parents=True)
    (words / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate([*VOCAB, *SPECIAL])}))
    (words / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(words / "vocab.json"), str(words / "merges.txt"), model_max_length=MAX_LENGTH)
    text = CLIPTextConfig(
        vocab_size=len(VOCAB) + 2,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=MAX_LENGTH,
        bos_token_id=len(VOCAB),
        eos_token_id=len(VOCAB) + 1,
        pad_token_id=len(VOCAB) + 1,
    )
    text_encoder = FlaxCLIPTextModel(text, seed=0)
    vae = FlaxAutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(32,) * 4,
        layers_per_block=1,
        latent_channels=4,
        sample_size=SIZE,
    )
    unet = FlaxUNet2DConditionModel(  # 4 levels: the ControlNet script copies down_blocks_0..3
        sample_size=SIZE // 8,
        block_out_channels=(32,) * 4,
        layers_per_block=1,
        attention_head_dim=4,
        cross_attention_dim=32,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    )
    schedule = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}
    pipeline = FlaxStableDiffusionPipeline(
        text_encoder=text_encoder,
        vae=vae,
        unet=unet,
        tokenizer=tokenizer,
        safety_checker=None,
        scheduler=FlaxDDPMScheduler(**schedule, num_train_timesteps=1000),
        feature_extractor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}),
    )
    params = {
        "text_encoder": text_encoder.params,
        "vae": vae.init_weights(jax.random.key(1)),
        "unet": unet.init_weights(jax.random.key(2)),
    }
    pipeline.save_pretrained(root / "sd", params=params)
    hub = root / "hub"
    checker = StableDiffusionSafetyChecker(
        CLIPConfig(
            text_config=text.to_dict(),
            vision_config={
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "image_size": 224,  # the Flax checker initialises at 224 px, whatever the config says
                "patch_size": 56,
            },
            projection_dim=32,
        )
    )
    checker.save_pretrained(_snapshot(hub, "CompVis/stable-diffusion-safety-checker"), safe_serialization=False)
    pipeline.feature_extractor.save_pretrained(_snapshot(hub, "openai/clip-vit-base-patch32"))
    FlaxPNDMScheduler(**schedule, skip_prk_steps=True).save_pretrained(
        _snapshot(hub, "CompVis/stable-diffusion-v1-4") / "scheduler"
    )
    _data(root)


def _snapshot(hub: Path, repo_id: str) -> Path:
    """A hub repo as huggingface_hub's cache lays it out (refs/main naming one snapshot), with the network off."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return repo / "snapshots" / COMMIT


def _data(root: Path) -> None:
    """One step's worth of each script's data: an image folder with captions, DreamBooth's instance and class
    images, and a ControlNet data set with conditioning images (saved with ``save_to_disk``)."""
    from datasets import Dataset, DatasetDict
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)) for _ in range(BATCH)]
    captions = [" ".join(rng.choice(list("abcdefgh"), 3)) for _ in range(BATCH)]
    folder = root / "images"
    folder.mkdir()
    for i, image in enumerate(images):
        image.save(folder / f"{i}.png")
    lines = [json.dumps({"file_name": f"{i}.png", "text": c}) for i, c in enumerate(captions)]
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    for kind, chosen in (("instance", images[: BATCH // 2]), ("class", images[BATCH // 2 :])):
        (root / kind).mkdir()
        for i, image in enumerate(chosen):
            image.save(root / kind / f"{i}.png")
    edges = [Image.fromarray((np.asarray(im)[..., :1].repeat(3, -1) > 127).astype(np.uint8) * 255) for im in images]
    data = {"image": images, "text": captions, "conditioning_image": edges}
    DatasetDict({"train": Dataset.from_dict(data)}).save_to_disk(str(root / "controlnet_data"))


def run(script: str, args: list[str]) -> None:
    """``script`` as ``python script args`` runs it, with the harness's changes (the module docstring)."""
    import jax.numpy as jnp
    from jax.experimental.compilation_cache import compilation_cache

    clip = jnp.clip
    jnp.clip = lambda a, min=None, max=None, a_min=None, a_max=None: clip(
        a, a_min if min is None else min, a_max if max is None else max
    )
    compilation_cache.initialize_cache = lambda path: None
    if os.environ.get("PEAKS") == "1":
        import jax_impl

        jax_impl.fit_budget = _peaks
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


def _peaks(transform: Any, fun: Any, *args: Any, models: Any, budget_mib: Any, **kw: Any) -> Any:
    """The script's step as without a budget; on its first call, first the compiled peaks of the step under
    ``none`` and ``full``, built as `jax_impl.fit_budget` builds it, printed as ``PEAKS {json}``."""
    from jax_impl.guard import xla_compile
    from jax_impl.memory import compiled_peak
    from jax_impl.remat_budget import BudgetedStep, fit_budget

    budgeted = fit_budget(transform, fun, *args, models=models, budget_mib=0, **kw)
    assert isinstance(budgeted, BudgetedStep)
    plain, printed = transform(fun, *args, **kw), []

    def step(*call: Any) -> Any:
        if not printed:
            peaks = {p: compiled_peak(xla_compile(budgeted._build(p).lower(*call))) for p in ("none", "full")}
            for model in budgeted.models:
                object.__setattr__(model, "policy", None)  # as the script built them
            print("PEAKS " + json.dumps(peaks), flush=True)
            printed.append(peaks)
        return plain(*call)

    return step


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(Path(sys.argv[2]))
    else:
        run(sys.argv[2], sys.argv[3:])
