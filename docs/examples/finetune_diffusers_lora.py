"""Fine-tune diffusers' own U-Net with LoRA in bfloat16 mixed precision, planned to a memory budget.

    python docs/examples/finetune_diffusers_lora.py path/to/unet --budget-mib 2048 --batch-size 4 --steps 5

Loads a ``UNet2DConditionModel`` from a folder (a model folder or a pipeline's, or a repo id in the
local Hugging Face cache), adds LoRA adapters through peft as diffusers' training scripts do
(``unet.add_adapter``), asks the planner for the cheapest checkpoint plan whose step fits the
budget in this regime, applies it to the model itself, and trains a few steps under bf16 autocast
on random latents and text embeddings (a stand-in for a real dataset).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from diffusers import UNet2DConditionModel
from peft import LoraConfig

import torch_impl
from shared_configs.diffusers.folders import find_folder
from shared_configs.regime import Regime

MIB = 1 << 20


def main(argv: list[str] | None = None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a diffusers U-Net folder, a pipeline folder, or a cached repo id")
    p.add_argument("--budget-mib", type=float, required=True)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rank", type=int, default=8)
    args = p.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    unet = UNet2DConditionModel.from_pretrained(find_folder(args.source).root)
    unet.requires_grad_(False)
    unet.add_adapter(
        LoraConfig(
            r=args.rank,
            lora_alpha=args.rank,
            init_lora_weights="gaussian",
            target_modules=["to_q", "to_k", "to_v", "to_out.0"],
        )
    )

    # The two lines: plan for this model, batch, budget and regime; put the plan on the model.
    regime = Regime("bf16-mixed", f"lora:{args.rank}")
    policy = torch_impl.plan_for_budget(unet, args.batch_size, int(args.budget_mib * MIB), regime=regime)
    torch_impl.apply_plan(unet, policy)
    unet.to(device)
    print(f"plan for {args.budget_mib:g} MiB: {policy}")

    params = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    size, channels = unet.config.sample_size, unet.config.in_channels
    gen = torch.Generator().manual_seed(0)
    losses = []
    unet.train()
    for _ in range(args.steps):
        latents = torch.randn(args.batch_size, channels, size, size, generator=gen).to(device)
        noise = torch.randn(latents.shape, generator=gen).to(device)
        t = torch.randint(0, 1000, (args.batch_size,), generator=gen).to(device)
        text = torch.randn(args.batch_size, 77, unet.config.cross_attention_dim, generator=gen).to(device)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            pred = unet(latents + noise, t, encoder_hidden_states=text).sample
        loss = F.mse_loss(pred.float(), noise)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        print(f"loss {loss.item():.4f}")
    return losses


if __name__ == "__main__":
    main()
