"""A tiny Stable-Diffusion-shaped pipeline and a 64-image dataset, built locally (nothing downloaded), to run
diffusers' own training scripts on this CPU: docs/guard.md ("diffusers' train_text_to_image.py, run by hand").

    python docs/examples/tiny_sd_pipeline.py OUT   # OUT/pipeline (save_pretrained), OUT/data (imagefolder)

The U-Net is the guard tests' (`tests.helpers.guard_script.SPEC`: 8x8 latents, cross-attention width 12), the
VAE and text encoder the tests' tiny configs; the tokenizer is CLIP's over single characters (no merges), 8 tokens.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import diffusers
import numpy as np
import torch
from PIL import Image
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from shared_configs import to_diffusers_config
from tests.helpers.guard_script import SPEC, TINY_VAE, TOKENS, tiny_text_config


def byte_characters() -> list[str]:
    """CLIP's (GPT-2's) characters standing for the 256 bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    return [chr(c) for c in printable + [256 + n for n in range(256) if n not in printable]]


def main(out: Path) -> None:
    torch.manual_seed(0)
    chars = byte_characters()
    vocab = {c: i for i, c in enumerate([*chars, *(c + "</w>" for c in chars), "<|startoftext|>", "<|endoftext|>"])}
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    (out / "tokenizer/vocab.json").write_text(json.dumps(vocab))
    (out / "tokenizer/merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(out / "tokenizer/vocab.json"), str(out / "tokenizer/merges.txt"))
    tokenizer.model_max_length = TOKENS
    end = vocab["<|endoftext|>"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = CLIPTextModel(CLIPTextConfig(**tiny_text_config(len(vocab), vocab["<|startoftext|>"], end)))
        pipe = diffusers.StableDiffusionPipeline(
            vae=diffusers.AutoencoderKL(**TINY_VAE),
            text_encoder=text,
            tokenizer=tokenizer,
            unet=diffusers.UNet2DConditionModel.from_config(to_diffusers_config(SPEC)),
            scheduler=diffusers.DDPMScheduler(num_train_timesteps=1000),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
    pipe.save_pretrained(out / "pipeline")
    data = out / "data"
    data.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(64):  # 16x16 images: latents 8x8
        Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(data / f"{i}.png")
        rows.append(json.dumps({"file_name": f"{i}.png", "text": f"a photo {i}"}))
    (data / "metadata.jsonl").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
