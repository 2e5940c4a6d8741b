"""Framework-free core: the U-Net spec (`spec`, `loader`, presets ``*.yaml``), checkpoint plans (`vocabulary`), a
ControlNet (`controlnet`, `pair`), the architecture both frameworks assemble (`arch`), the inputs (`inputs`),
every tool's defaults (`defaults`) and what every CLI shares (`cli`, `files`, `sizes`). Below:
`planning`, `training` and `diffusers`. Nothing here imports torch or jax.
"""

from shared_configs.diffusers.export import to_diffusers_config
from shared_configs.diffusers.unet_config import from_diffusers_config
from shared_configs.inputs import INPUT_NAMES, check_inputs, example_inputs, input_specs
from shared_configs.loader import load_spec, preset_names, spec_from_dict
from shared_configs.spec import AdditionEmbeddingSpec, ClassEmbeddingSpec, SpecError, TimeEmbeddingSpec, UNetSpec
from shared_configs.vocabulary import (
    NAMED_POLICIES,
    OP_CLASSES,
    PRESETS,
    CheckpointPlan,
    all_names,
    block_names,
    layer_names,
    resolve_plan,
)

__all__ = [
    "INPUT_NAMES",
    "NAMED_POLICIES",
    "OP_CLASSES",
    "PRESETS",
    "AdditionEmbeddingSpec",
    "CheckpointPlan",
    "ClassEmbeddingSpec",
    "SpecError",
    "TimeEmbeddingSpec",
    "UNetSpec",
    "all_names",
    "block_names",
    "check_inputs",
    "example_inputs",
    "from_diffusers_config",
    "input_specs",
    "layer_names",
    "load_spec",
    "preset_names",
    "resolve_plan",
    "spec_from_dict",
    "to_diffusers_config",
]
