"""A training step shaped as diffusers' example scripts hold theirs, built from the libraries themselves (nothing
downloaded), for the guard's tests (tests/test_guard_scripts.py, tests/test_guard_processes.py): accelerate's
``prepare`` / ``accumulate`` / ``backward``, peft LoRA through ``unet.add_adapter``, a frozen ``AutoencoderKL``
and ``CLIPTextModel`` from tiny configs, ``cast_training_params``; diffusers' ``ControlNetModel`` beside its
frozen U-Net; a full fine-tune with diffusers' ``EMAModel``."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from shared_configs import to_diffusers_config
from shared_configs.planning.pipeline import Workload, predict_policy
from tests.helpers.specs import variant
from torch_impl import BudgetGuard, ControlNetPair
from torch_impl.guard_model import regime_seen, step_spec
from torch_impl.wrappers import unwrap

SPEC = variant("tiny", down_attention=["transformer", "none"], sample_size=8, dropout=0.0)  # SD-shaped, 8x8 latents
BATCH, TOKENS, RANK = 2, 8, 4
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
TINY_VAE = {  # 16x16 images, 8x8 latents
    "down_block_types": ("DownEncoderBlock2D",) * 2,
    "up_block_types": ("UpDecoderBlock2D",) * 2,
    "block_out_channels": (8, 16),
    "layers_per_block": 1,
    "norm_num_groups": 4,
    "sample_size": 16,
}


def tiny_text_config(vocab: int, begin: int, end: int) -> dict[str, Any]:
    """A one-layer CLIP text encoder of width 12 (the U-Net's cross-attention) over ``TOKENS`` tokens."""
    return {
        "vocab_size": vocab,
        "hidden_size": 12,
        "intermediate_size": 24,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": TOKENS,
        "bos_token_id": begin,
        "eos_token_id": end,
        "pad_token_id": end,
    }


class Script:
    """What a script holds after ``accelerator.prepare``: the trained model (the U-Net's LoRA
    adapters, or a ControlNet), the frozen VAE, text encoder (and U-Net), the optimizer, batches."""

    def __init__(
        self,
        controlnet: bool = False,
        accumulation: int = 1,
        weight_dtype: torch.dtype | None = None,
        ema: str | None = None,
        foreach: bool = True,
        batch: int = BATCH,
    ):
        """``ema``: train_text_to_image.py ``--use_ema``: the U-Net trained whole and diffusers' ``EMAModel`` of it
        (``foreach``) on the device ("device") or ``--offload_ema`` ("offload"). ``batch``: images per batch."""
        import diffusers
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState
        from diffusers.training_utils import cast_training_params
        from peft import LoraConfig
        from transformers import CLIPTextConfig, CLIPTextModel

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.unet = diffusers.UNet2DConditionModel.from_config(to_diffusers_config(SPEC))
            self.vae = diffusers.AutoencoderKL(**TINY_VAE)
            self.text = CLIPTextModel(CLIPTextConfig(**tiny_text_config(vocab=64, begin=0, end=1)))
        for module in (self.unet, self.vae, self.text):
            module.requires_grad_(False)
            module.to(dtype=weight_dtype)  # --mixed_precision bf16: the frozen weights in bfloat16
        self.controlnet, self.ema = None, None
        if controlnet:  # train_controlnet.py: a ControlNet from the U-Net, trained whole
            widths = {"conditioning_embedding_out_channels": (8, 16)}  # the image at 2x the latents: 16x16
            self.controlnet = diffusers.ControlNetModel.from_unet(self.unet, **widths)
            self.controlnet.train()
        elif ema is not None:  # train_text_to_image.py --use_ema
            from diffusers.training_utils import EMAModel

            self.unet.requires_grad_(True)
            self.unet.train()
            kind = offloaded_ema() if ema == "offload" else EMAModel
            config = {"model_cls": type(self.unet), "model_config": self.unet.config}
            self.ema = kind(self.unet.parameters(), foreach=foreach, **config)
        else:  # train_text_to_image_lora.py
            self.unet.add_adapter(
                LoraConfig(r=RANK, lora_alpha=RANK, init_lora_weights="gaussian", target_modules=LORA_TARGETS)
            )
            cast_training_params(self.unet, dtype=torch.float32)
        self.offload = ema == "offload"
        mixed = {torch.bfloat16: "bf16", None: "no"}[weight_dtype]
        self.accelerator = Accelerator(gradient_accumulation_steps=accumulation, cpu=True, mixed_precision=mixed)
        trained = self.controlnet if controlnet else self.unet
        optimizer = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=1e-3)
        self.trained, self.optimizer = self.accelerator.prepare(trained, optimizer)
        self.scheduler = diffusers.DDPMScheduler(num_train_timesteps=1000)
        g = torch.Generator().manual_seed(1)
        self.batches = [
            (torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 64, (batch, TOKENS), generator=g))
            for _ in range(8)
        ]
        self.fail: Callable[[], bool] = lambda: False  # an out-of-memory error after the backward, when true
        self.extra = 0  # bytes the step holds beyond the script's (a rank's own)

    def body(self, pixels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The body of the scripts' ``with accelerator.accumulate(model):``."""
        held = torch.zeros(self.extra // 4)  # noqa: F841 (held through the step)
        latents = self.vae.encode(pixels).latent_dist.sample() * self.vae.config.scaling_factor
        context = self.text(ids, return_dict=False)[0]
        noise = torch.randn_like(latents)
        t = torch.randint(0, 1000, (latents.shape[0],)).long()
        noisy = self.scheduler.add_noise(latents, noise, t)
        residuals = {}
        if self.controlnet is not None:
            down, mid = self.trained(noisy, t, context, controlnet_cond=pixels, return_dict=False)
            residuals = {"down_block_additional_residuals": down, "mid_block_additional_residual": mid}
        pred = self.unet(noisy, t, context, **residuals, return_dict=False)[0]
        loss = F.mse_loss(pred.float(), noise.float())
        self.accelerator.backward(loss)
        if self.fail():
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss.detach()

    def ema_step(self) -> None:
        """After an optimizer step, as train_text_to_image.py (``--offload_ema``: on the device for the update)."""
        if self.offload:
            self.ema.to(device="cpu")  # the script's "cuda"
        self.ema.step(self.unet.parameters())
        if self.offload:
            self.ema.to(device="cpu")

    def guarded_model(self) -> torch.nn.Module:
        return ControlNetPair.of(self.unet, self.trained) if self.controlnet is not None else self.trained

    def weights(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.trained.parameters() if p.requires_grad]


def run(script: Script, guard: BudgetGuard | None, steps: int) -> list[float]:
    """``steps`` micro-steps of the script's loop, guarded as docs/guard.md's recipe patches it."""
    torch.manual_seed(5)
    losses = []
    for pixels, ids in script.batches[:steps]:
        if guard is None:
            with script.accelerator.accumulate(script.trained):
                loss = script.body(pixels, ids)
        else:

            @guard.step(script.accelerator.accumulate, script.trained)
            def loss() -> torch.Tensor:
                return script.body(pixels, ids)  # noqa: B023 (run at once)

        if script.ema is not None and script.accelerator.sync_gradients:
            script.ema_step()
        losses.append(float(loss))
    return losses


def offloaded_ema() -> type:
    """diffusers' ``EMAModel`` under ``--offload_ema`` on this CPU, where the host and the device are one memory:
    each move makes a new copy, as a move between a GPU and the host does."""
    from diffusers.training_utils import EMAModel

    class Offloaded(EMAModel):
        def to(self, device: Any = None, dtype: Any = None, non_blocking: bool = False) -> None:
            self.shadow_params = [p.to(device=device, dtype=dtype, copy=True) for p in self.shadow_params]

    return Offloaded


def sizes(model: torch.nn.Module, tenths: int = 6, batch: int = BATCH, **ranks: Any) -> int:
    """The budget ``tenths`` of the way from `full`'s predicted peak to `none`'s, in the regime the model shows;
    ``ranks``: `predict_policy`'s ``world_size`` and ``distributed``."""
    model = unwrap(model)
    work = Workload.of(step_spec(model), batch_size=batch, regime=regime_seen(model)[0], context_length=TOKENS)
    none, full = (predict_policy(work, p, "torch", **ranks)[0].prediction.peak_bytes for p in ("none", "full"))
    return full + tenths * (none - full) // 10


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def script_peaks(ema: str, batch: int) -> dict[str, int]:
    """The script's own step under `full` and under `none`, unguarded: the peak of its second optimizer step (AdamW's
    state made by the first) by `step_peak`, the EMA's copy held beside the step where it sits on the device."""
    from torch_impl.diffusers_adapter import apply_plan
    from torch_impl.memory import step_peak

    peaks = {}
    for policy in ("full", "none"):
        script = Script(ema=ema, batch=batch)
        apply_plan(script.unet, policy)
        run(script, None, 1)
        held = script.ema.shadow_params if ema == "device" else []
        measured = step_peak(script.unet, script.optimizer.optimizer, held=held)
        with measured as found, script.accelerator.accumulate(script.trained):
            script.body(*script.batches[1])
        peaks[policy] = found["peak"]
    return peaks
