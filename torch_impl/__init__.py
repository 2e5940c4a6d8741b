"""PyTorch U-Net built from a shared spec, with per-block gradient checkpointing."""

from torch_impl.unet import UNet

__all__ = ["UNet"]
