"""Drop-ins for diffusers' Flax ``FlaxUNet2DConditionModel`` and ``FlaxControlNetModel`` (diffusers <= 0.39; removed
in 0.40), computed by this project's U-Net and ControlNet, with one more keyword: ``policy``, the remat plan.

The same constructor keywords (a diffusers config), ``from_pretrained -> (model, params)`` from a Flax or a PyTorch
folder, ``init_weights``, NCHW ``apply(...).sample``, ``save_pretrained(path, params=...)`` and diffusers' Flax
parameter names (`jax_impl.convert.diffusers_flax_paths`, mapped by ``nn.map_variables``). Importing this module
before JAX starts keeps remat's recompute in the user's own ``jit``/``pmap`` on XLA:CPU. Docs: docs/flax_users.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import warnings
from collections.abc import Callable
from contextvars import ContextVar
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import serialization

from jax_impl.compat import backends_started
from jax_impl.controlnet import ControlNet, abstract_controlnet_inputs
from jax_impl.convert import from_diffusers_flax, to_diffusers_flax, torch_to_flax
from jax_impl.diffusers_io import read_weights, to_diffusers_state_dict
from jax_impl.regime import cast_floating
from jax_impl.step import nhwc
from jax_impl.unet import PolicyArg, UNet, abstract_inputs
from shared_configs.diffusers.controlnet_config import controlnet_to_diffusers_config, spec_from_config
from shared_configs.diffusers.export import to_diffusers_config
from shared_configs.diffusers.folders import WEIGHT_NAMES, diffusers_to_ours, find_folder
from shared_configs.files import atomic_write
from shared_configs.planning.workers import XLA_CPU_FLAG

FLAX_WEIGHTS = "diffusion_flax_model.msgpack"
# While `jax_impl.fit_budget` traces the script's step: what each U-Net is given, (sample, context) shapes.
SEEN: ContextVar[list[tuple[tuple[int, ...], tuple[int, ...]]] | None] = ContextVar("SEEN", default=None)
_NOT_CONFIG = ("parent", "name", "dtype", "policy")  # fields that are not diffusers config keys


def _keep_remat_barriers() -> None:
    """XLA:CPU's ``cse_barrier_expander`` (which lets CSE undo remat) off in every compile of this process, the
    user's own ``jit``/``pmap`` included: ``XLA_FLAGS`` is read once, when JAX's backend starts. Not where JAX
    will run on a GPU or TPU (a plugin installed, ``JAX_PLATFORMS`` not naming cpu first): XLA keeps the barriers
    there until after fusion."""
    flags = os.environ.get("XLA_FLAGS", "")
    platforms = os.environ.get("JAX_PLATFORMS", "")
    accelerated = platforms.split(",")[0] not in ("", "cpu") or bool(metadata.entry_points(group="jax_plugins"))
    if "cse_barrier_expander" in flags or accelerated or (platforms == "" and find_spec("libtpu") is not None):
        return
    if backends_started():
        if jax.default_backend() == "cpu":
            warnings.warn(
                f"jax_impl.diffusers_flax was imported after JAX started: your own jit/pmap on XLA:CPU will undo "
                f"remat's recompute (no plan saves memory there); import it before JAX runs anything, or set "
                f"XLA_FLAGS={XLA_CPU_FLAG} (jax_impl.fit_budget's compile keeps the recompute either way)",
                stacklevel=3,
            )
        return
    merged = re.subn(r"--xla_disable_hlo_passes=(\S+)", r"--xla_disable_hlo_passes=\1,cse_barrier_expander", flags)
    os.environ["XLA_FLAGS"] = merged[0] if merged[1] else f"{flags} {XLA_CPU_FLAG}".strip()


_keep_remat_barriers()


def _diffusers_bases() -> tuple[type, ...]:
    """diffusers' ``FlaxModelMixin`` where diffusers <= 0.39 is installed: its pipelines save, load and accept only
    its subclasses. Nothing elsewhere (0.40 removed it)."""
    try:
        if tuple(int(p) for p in metadata.version("diffusers").split(".")[:2]) >= (0, 40):
            return ()
        from diffusers import FlaxModelMixin
    except (metadata.PackageNotFoundError, ImportError, ValueError):
        return ()
    return (FlaxModelMixin,)


class Config(dict):
    """A diffusers model config: a dict whose keys read as attributes too (``unet.config.in_channels``)."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


@flax.struct.dataclass
class FlaxUNet2DConditionOutput:
    sample: jax.Array  # NCHW


@flax.struct.dataclass
class FlaxControlNetOutput:
    down_block_res_samples: list[jax.Array]  # NHWC, as diffusers' Flax ControlNet returns them
    mid_block_res_sample: jax.Array


class _DiffusersFlaxModel(nn.Module, *_diffusers_bases()):
    """What both drop-ins share: the config fields both diffusers classes take, loading, saving, the renamed tree."""

    NET: ClassVar[type[nn.Module]]
    INPUTS: ClassVar[Callable[[Any], dict[str, Any]]]  # the network's inputs as shape structs, by name
    TORCH_CLASS: ClassVar[str]  # the diffusers PyTorch class of the same network
    FLAX_ONLY: ClassVar[tuple[str, ...]]  # config keys the PyTorch class does not take (a nonzero dropout is kept)

    sample_size: int = 32
    in_channels: int = 4
    down_block_types: tuple[str, ...] = ("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",)
    only_cross_attention: bool | tuple[bool, ...] = False
    block_out_channels: tuple[int, ...] = (320, 640, 1280, 1280)
    layers_per_block: int = 2
    attention_head_dim: int | tuple[int, ...] = 8
    num_attention_heads: int | tuple[int, ...] | None = None
    cross_attention_dim: int = 1280
    dropout: float = 0.0
    use_linear_projection: bool = False
    dtype: Any = jnp.float32  # the computation's; the parameters stay as given
    flip_sin_to_cos: bool = True
    freq_shift: int = 0
    policy: PolicyArg = None  # the remat plan (`jax_impl.UNet`'s ``policy``); `jax_impl.fit_budget` sets it

    @property
    def config(self) -> Config:
        """The diffusers config: the constructor's keywords, and ``_class_name``."""
        keys = [f.name for f in dataclasses.fields(self) if f.name not in _NOT_CONFIG]
        return Config({k: getattr(self, k) for k in keys}, _class_name=type(self).__name__)

    @property
    def spec(self) -> Any:
        """This project's spec of the network (a `UNetSpec` or `ControlNetSpec`)."""
        return self._spec_of(self.config)

    @classmethod
    def _spec_of(cls, config: dict[str, Any]) -> Any:
        """The spec of ``config`` read as the diffusers PyTorch class's config (Flax-only keys dropped, a zero
        dropout a ControlNet lacks)."""
        kept = {k: v for k, v in config.items() if k not in cls.FLAX_ONLY or (k == "dropout" and v)}
        return _spec(cls.TORCH_CLASS, json.dumps(kept | {"_class_name": cls.TORCH_CLASS}, sort_keys=True))

    def setup(self) -> None:
        # The project's module computes; its parameters are stored under diffusers' Flax names, in this scope.
        net = nn.map_variables(self.NET, "params", self._to_ours, self._to_diffusers, init=self.is_initializing())
        self.net = net(spec=self.spec, policy=self.policy)
        nn.share_scope(self, self.net)

    def _to_ours(self, variables: dict[str, Any]) -> dict[str, Any]:
        spec, dtype = self.spec, jnp.dtype(self.dtype)
        ours = {k: from_diffusers_flax(v, spec) if v else v for k, v in variables.items()}
        return ours if dtype == jnp.float32 else cast_floating(ours, dtype)

    def _to_diffusers(self, variables: dict[str, Any]) -> dict[str, Any]:
        return {k: to_diffusers_flax(v, self.spec) if v else v for k, v in variables.items()}

    def _inputs(self, *arrays: jax.Array | None) -> tuple[Any, ...]:
        """NCHW images -> NHWC, every floating input in the computation's dtype."""
        return cast_floating(nhwc(*arrays), self.dtype)

    def init_weights(self, rng: jax.Array) -> dict[str, Any]:
        """Fresh parameters under diffusers' Flax names (the network's own init on the smallest inputs it takes)."""
        params_rng, dropout_rng = jax.random.split(rng)
        rngs = {"params": params_rng, "dropout": dropout_rng}
        inputs = jax.tree.map(jnp.zeros_like, self.INPUTS(self.spec))
        net = self.NET(spec=self.spec, policy=self.policy, parent=None)
        return to_diffusers_flax(jax.jit(net.init)(rngs, **inputs)["params"], self.spec)  # compiled: sooner than eager

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: str | os.PathLike[str],
        dtype: Any = jnp.float32,
        *,
        subfolder: str | None = None,
        from_pt: bool = False,
        revision: str | None = None,
        policy: PolicyArg = None,
        **config: Any,
    ) -> tuple[Any, dict[str, Any]]:
        """``(model, params)`` from a folder diffusers wrote, Flax (``diffusion_flax_model.msgpack``) or PyTorch
        (safetensors or ``.bin``; the Flax file is preferred unless ``from_pt``), or a repo id in the local Hugging
        Face cache. ``config``: keys overriding the folder's config.json."""
        names = (*WEIGHT_NAMES, FLAX_WEIGHTS) if from_pt else (FLAX_WEIGHTS, *WEIGHT_NAMES)
        folder = find_folder(pretrained_model_name_or_path, None, subfolder, revision, weights=names)
        given = {**folder.config, **config}
        fields = {f.name for f in dataclasses.fields(cls)} - set(_NOT_CONFIG)
        config_kw = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items() if k in fields}
        model = cls(**config_kw, dtype=dtype, policy=policy)
        if (wanted := cls._spec_of(given)) != model.spec:
            raise ValueError(
                f"{folder.root}/config.json: options the Flax class does not take change the network "
                f"({wanted.name}); load it with jax_impl.from_diffusers"
            )
        files = folder.weight_files
        if files[0].name == FLAX_WEIGHTS:
            params = serialization.msgpack_restore(files[0].read_bytes())
            from_diffusers_flax(params, model.spec)  # names and shapes checked, one line
            return model, params
        state = diffusers_to_ours({k: v for file in files for k, v in read_weights(file).items()})
        return model, to_diffusers_flax(torch_to_flax(state, model.spec), model.spec)

    def save_pretrained(
        self, save_directory: str | os.PathLike[str], params: Any, is_main_process: bool = True, **kwargs: Any
    ) -> None:
        """A folder both diffusers' Flax class (<= 0.39) and its current PyTorch class load: config.json, the
        parameters as ``diffusion_flax_model.msgpack`` and ``diffusion_pytorch_model.safetensors``."""
        if kwargs.get("push_to_hub"):
            raise ValueError("push_to_hub: not supported (local files only); upload the folder yourself")
        import safetensors.torch  # the PyTorch file holds torch tensors (`to_diffusers_state_dict`)

        folder, spec = Path(save_directory), self.spec
        export = controlnet_to_diffusers_config if self.TORCH_CLASS == "ControlNetModel" else to_diffusers_config
        if is_main_process:
            config = {**export(spec), **self.config, "_class_name": type(self).__name__}
            atomic_write(folder / "config.json", json.dumps(config, indent=2, sort_keys=True).encode())
        atomic_write(folder / FLAX_WEIGHTS, serialization.to_bytes(jax.device_get(params)))
        state = to_diffusers_state_dict(from_diffusers_flax(jax.device_get(params), spec), spec)
        atomic_write(folder / WEIGHT_NAMES[0], safetensors.torch.save(state))


@functools.lru_cache(maxsize=32)
def _spec(cls: str, config: str) -> Any:
    return spec_from_config({"_name_or_path": cls, **json.loads(config)})


class FlaxUNet2DConditionModel(_DiffusersFlaxModel):
    """diffusers 0.39's ``FlaxUNet2DConditionModel``, computed by `jax_impl.UNet` (outputs equal diffusers' PyTorch
    U-Net's on the same weights): ``apply({"params": p}, sample, timesteps, encoder_hidden_states, ...)``, NCHW."""

    NET = UNet
    INPUTS = staticmethod(abstract_inputs)
    TORCH_CLASS = "UNet2DConditionModel"
    FLAX_ONLY = ("use_memory_efficient_attention", "split_head_dim")

    out_channels: int = 4
    up_block_types: tuple[str, ...] = ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3
    mid_block_type: str | None = "UNetMidBlock2DCrossAttn"
    use_memory_efficient_attention: bool = False  # accepted; the memory is the plan's to decide (no effect)
    split_head_dim: bool = False  # accepted; no effect
    transformer_layers_per_block: int | tuple[int, ...] = 1
    addition_embed_type: str | None = None
    addition_time_embed_dim: int | None = None
    addition_embed_type_num_heads: int = 64
    projection_class_embeddings_input_dim: int | None = None

    def __call__(
        self,
        sample: jax.Array,
        timesteps: jax.Array | float | int,
        encoder_hidden_states: jax.Array,
        added_cond_kwargs: dict[str, jax.Array] | None = None,
        down_block_additional_residuals: tuple[jax.Array, ...] | None = None,
        mid_block_additional_residual: jax.Array | None = None,
        return_dict: bool = True,
        train: bool = False,
    ) -> FlaxUNet2DConditionOutput | tuple[jax.Array]:
        """The prediction for NCHW ``sample`` (the residuals NHWC, as diffusers' Flax ControlNet gives them)."""
        if (seen := SEEN.get()) is not None:
            seen.append((sample.shape, encoder_hidden_states.shape))
        added = added_cond_kwargs or {}
        x, context, text_embeds, time_ids = self._inputs(
            sample, encoder_hidden_states, added.get("text_embeds"), added.get("time_ids")
        )
        # the residuals are NHWC already
        down, mid = cast_floating((down_block_additional_residuals, mid_block_additional_residual), self.dtype)
        out = self.net(
            x,
            timesteps,
            context,
            text_embeds=text_embeds,
            time_ids=time_ids,
            down_block_additional_residuals=down,
            mid_block_additional_residual=mid,
            train=train,
        )
        out = jnp.transpose(out, (0, 3, 1, 2))
        return FlaxUNet2DConditionOutput(out) if return_dict else (out,)


class FlaxControlNetModel(_DiffusersFlaxModel):
    """diffusers 0.39's ``FlaxControlNetModel``, computed by `jax_impl.controlnet.ControlNet`: ``apply({"params": p},
    sample, timesteps, encoder_hidden_states, controlnet_cond, conditioning_scale)``, NCHW in, NHWC residuals out."""

    NET = ControlNet
    INPUTS = staticmethod(abstract_controlnet_inputs)
    TORCH_CLASS = "ControlNetModel"
    FLAX_ONLY = ("sample_size", "dropout")

    controlnet_conditioning_channel_order: str = "rgb"
    conditioning_embedding_out_channels: tuple[int, ...] = (16, 32, 96, 256)

    def __call__(
        self,
        sample: jax.Array,
        timesteps: jax.Array | float | int,
        encoder_hidden_states: jax.Array,
        controlnet_cond: jax.Array,
        conditioning_scale: float = 1.0,
        return_dict: bool = True,
        train: bool = False,
    ) -> FlaxControlNetOutput | tuple[list[jax.Array], jax.Array]:
        """The residuals for the U-Net (NHWC) of NCHW ``sample`` under the NCHW image ``controlnet_cond``."""
        x, context, cond = self._inputs(sample, encoder_hidden_states, controlnet_cond)
        down, mid = self.net(x, timesteps, context, cond, conditioning_scale, train=train)
        return FlaxControlNetOutput(down, mid) if return_dict else (down, mid)
