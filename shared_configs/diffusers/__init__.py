"""diffusers interop, framework-free: a diffusers ``config.json`` <-> `UNetSpec` (`unet_config`, `export`;
a ControlNet's: `controlnet_config`), and finding a model's files in a folder or the local Hugging Face cache,
mapping weight names (`folders`). The weights themselves are read by `torch_impl.diffusers_io` /
`jax_impl.diffusers_io`."""

from shared_configs.diffusers.export import to_diffusers_config
from shared_configs.diffusers.unet_config import from_diffusers_config

__all__ = ["from_diffusers_config", "to_diffusers_config"]
