"""The models beside the U-Net in a diffusers training step (VAE, text encoders), measured from shapes.

Each is built from its config on fake tensors (nothing allocated, nothing downloaded) and run as the
training scripts run it; the bytes come from `torch_impl.memory.StepTracker`. No JAX mirror (the JAX
loop trains on latents); docs/regimes.md.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from shared_configs.planning.encoders import Encoder
from shared_configs.planning.timeline import BWD
from shared_configs.regime import Regime
from torch_impl.compat import tensor_tables
from torch_impl.memory import StepTracker, state_tensors
from torch_impl.profile import ShapesOnly
from torch_impl.regime import DTYPE, make_optimizer


def build(encoder: Encoder, mode: ShapesOnly) -> torch.nn.Module:
    """``encoder``'s model on fake tensors, its weights in ``encoder.dtype``."""
    with mode:
        if encoder.kind == "vae":
            from diffusers import AutoencoderKL

            model: torch.nn.Module = AutoencoderKL(**encoder.config_dict)
        else:
            from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

            cls = CLIPTextModelWithProjection if encoder.kind == "clip-projection" else CLIPTextModel
            model = cls(CLIPTextConfig(**encoder.config_dict))
        dtype = DTYPE[encoder.dtype]
        for module in model.modules():  # tensor by tensor: Module.to cannot swap fake parameters
            params, _ = tensor_tables(module)
            for name, t in params.items():
                if t is not None:
                    params[name] = torch.nn.Parameter(t.to(dtype), requires_grad=encoder.trained)
    return model


def measure(encoder: Encoder, batch_size: int, autocast: str | None = None) -> dict[str, int]:
    """``encoder``'s bytes at ``batch_size``: its weights, the peak its use adds above them and its
    input (``peak``); trained: what its forward leaves for the backward beyond its output (``keep``),
    the peak of its backward above the weights and input, the weights' gradients included, and the
    state of ``encoder.optimizer`` after a step (``state``)."""
    mode = ShapesOnly()
    torch.manual_seed(0)
    model = build(encoder, mode)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    with mode:  # an image batch for the VAE, token ids for a text encoder
        x = (
            torch.randn(batch_size, 3, encoder.image_size, encoder.image_size, dtype=DTYPE[encoder.dtype])
            if encoder.kind == "vae"
            else torch.zeros(batch_size, encoder.tokens, dtype=torch.long)
        )
    cast = torch.autocast("cpu", dtype=DTYPE[autocast]) if autocast and encoder.trained else contextlib.nullcontext()
    grad = torch.enable_grad() if encoder.trained else torch.no_grad()
    tracker = StepTracker(model, [], inputs=[x], detail=False)
    flops = FlopCounterMode(display=False)
    with mode, tracker, flops:
        with grad, cast:
            out = (
                model.encode(x).latent_dist.sample()
                if encoder.kind == "vae"
                else model(x, output_hidden_states=encoder.hidden_states).last_hidden_state
            )
        tracker.mark("backward", BWD)
        if encoder.trained:
            out.float().sum().backward()
    timeline = tracker.unit_timeline()
    forward_end = timeline.split()
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    levels = timeline.levels() - (weights + buffers + x.numel() * x.element_size())
    result = {
        "weights": weights,
        "params": sum(p.numel() for p in model.parameters()),
        "peak": int(levels[:forward_end].max()),
        "flops": int(flops.get_total_flops()),
    }
    if encoder.trained:
        result |= {
            "keep": int(levels[forward_end - 1]) - out.numel() * out.element_size(),
            "backward_peak": int(levels[forward_end:].max()),
            "largest": max(p.numel() for p in model.parameters()),
            "state": state_bytes(model, encoder.optimizer, mode),
        }
    return result


def state_bytes(model: torch.nn.Module, optimizer: str, mode: ShapesOnly) -> int:
    """The bytes of ``optimizer``'s state after a step over ``model``'s gradients, the optimizer made and
    stepped as the U-Net's profile does: its state's shapes are the optimizer's own (Adafactor's factors)."""
    opt = make_optimizer(model, lr=1e-4, weight_decay=0.0, regime=Regime(optimizer=optimizer))
    with mode:
        opt.step()
    return sum(t.numel() * t.element_size() for t in state_tensors(opt))


def encoders(request: dict[str, Any]) -> dict[str, Any]:
    """The worker's answer: `measure` of each encoder in ``request["encoders"]``."""
    encoders = [Encoder(**data) for data in request["encoders"]]
    return {"encoders": {e.name: measure(e, request["batch_size"], request.get("autocast")) for e in encoders}}
