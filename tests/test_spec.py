"""The framework-free spec and plans: presets, clear one-line errors, policy resolution."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from shared_configs import SpecError, block_names, layer_names, load_spec, preset_names, resolve_plan, spec_from_dict

TINY = yaml.safe_load((Path(__file__).parents[1] / "shared_configs" / "tiny.yaml").read_text())


def test_presets_load() -> None:
    assert {"tiny", "small", "ddpm_cifar10", "sd15"} <= set(preset_names())
    for name in preset_names():
        assert load_spec(name).name == name


def test_shared_configs_imports_no_framework() -> None:
    """Every module of the core, sub-packages included, imports neither framework (nor diffusers)."""
    code = (
        "import importlib, pkgutil, sys, shared_configs\n"
        "names = [m.name for m in pkgutil.walk_packages(shared_configs.__path__, 'shared_configs.')]\n"
        "for name in names: importlib.import_module(name)\n"
        "shared_configs.load_spec('sd15')\n"
        "print(len(names), *(f in sys.modules for f in ('torch', 'jax', 'flax', 'diffusers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) >= 25, out  # the walk found the sub-packages' modules too
    assert out[1:] == ["False"] * 4, out


# (override of the tiny spec, text that must appear in the one-line error)
BAD_SPECS = [
    ({"colour": "red"}, "colour: unknown field 'colour' (allowed:"),
    ({"block_out_channels": "wide"}, "block_out_channels"),
    ({"layers_per_block": 0}, "layers_per_block: Input should be greater than 0"),
    ({"dropout": 1.5}, "dropout: Input should be less than 1"),
    (
        {"down_attention": ["self", "cross"]},
        "down_attention.1: Input should be 'none', 'self', 'transformer' or 'simple_cross'",
    ),
    ({"down_attention": ["self"]}, "down_attention: needs 2 entries"),
    ({"norm_num_groups": 5}, "norm_num_groups: block_out_channels[0]=16 is not divisible by 5 groups"),
    ({"attention_head_dim": 7}, "attention_head_dim: block_out_channels[0]=16 does not split into heads"),
    ({"num_attention_heads": 3, "attention_head_dim": None}, "num_attention_heads: block_out_channels[0]=16 does"),
    ({"num_attention_heads": 0}, "num_attention_heads: must be positive"),
    ({"sample_size": 9}, "sample_size: 9 is not divisible by the downsampling factor 2"),
    ({"time_embedding": {"flip": True}}, "time_embedding.flip: unknown field 'flip' (allowed: cond_dim, dim, flip_"),
    ({"resnet_time_scale_shift": "film"}, "resnet_time_scale_shift: Input should be 'default' or 'scale_shift'"),
    ({"in_channels": "four"}, "in_channels: Input should be a valid integer"),
    ({"up_attention": ["none"]}, "up_attention: needs 2 entries"),
    ({"downsample_padding": 2}, "downsample_padding: Input should be less than or equal to 1"),
    ({"transformer_layers_per_block": [1, 2, 3]}, "transformer_layers_per_block: needs 2 entries"),
    ({"transformer_layers_per_block": 0}, "transformer_layers_per_block: must be positive"),
    # strict types: never coerced
    ({"in_channels": True}, "in_channels: Input should be a valid integer"),
    ({"in_channels": 4.0}, "in_channels: Input should be a valid integer"),
    ({"norm_eps": "1e-5"}, "norm_eps: Input should be a valid number"),
    ({"use_linear_projection": "yes"}, "use_linear_projection: Input should be a valid boolean"),
    ({"transformer_layers_per_block": [1, True]}, "transformer_layers_per_block"),
    # finite, positive eps and periods
    ({"norm_eps": float("inf")}, "norm_eps: Input should be a finite number"),
    ({"layer_norm_eps": float("nan")}, "layer_norm_eps: Input should be a finite number"),
    ({"transformer_norm_eps": 0.0}, "transformer_norm_eps: Input should be greater than 0"),
    ({"time_embedding": {"max_period": 0}}, "time_embedding.max_period: Input should be greater than 0"),
    ({"time_embedding": {"max_period": float("inf")}}, "time_embedding.max_period: Input should be a finite number"),
    ({"time_embedding": {"freq_shift": 8}}, "time_embedding.freq_shift: sinusoids of width 16 with freq_shift=8"),
    # the default checkpoint policy is validated at load
    ({"checkpoint": "fast"}, "checkpoint: unknown policy 'fast' (allowed: none, full"),
    ({"checkpoint": ["down.9"]}, "checkpoint: unknown block name 'down.9'"),
    ({"checkpoint": "every:0"}, "checkpoint: 'every:0' needs a positive integer"),
    # conditioning
    ({"class_embedding": {"kind": "embedding"}}, "class_embedding.num_classes: required by kind 'embedding'"),
    ({"class_embedding": {"kind": "identity", "num_classes": 3}}, "class_embedding.num_classes: not used by kind"),
    ({"class_embedding": {"kind": "onehot"}}, "class_embedding.kind: Input should be 'embedding', 'timestep'"),
    ({"class_embedding": {"kind": "timestep", "size": 3}}, "class_embedding.size: unknown field 'size' (allowed"),
    ({"addition_embedding": {"time_id_dim": 4, "input_dim": 24}}, "addition_embedding.num_time_ids: 6 time ids x 4"),
    ({"addition_embedding": {"kind": "text", "time_id_dim": 4, "input_dim": 40}}, "addition_embedding.kind"),
    ({"mid_attention_norm_groups": 3}, "mid_attention_norm_groups: only for mid_attention: self"),
    ({"mid_attention": "self", "mid_attention_norm_groups": 3}, "mid_attention_norm_groups: block_out_channels[-1]"),
]


@pytest.mark.parametrize(("override", "message"), BAD_SPECS)
def test_bad_spec_gives_one_clear_line(override: dict, message: str) -> None:
    with pytest.raises(SpecError) as info:
        spec_from_dict({**TINY, **override})
    text = str(info.value)
    assert message in text
    assert "\n" not in text


def test_a_misspelt_required_key_is_named_beside_the_missing_one(tmp_path: Path) -> None:
    """The unknown key, its nearest field and the required field it left missing, in one line."""
    spec = {k: v for k, v in TINY.items() if k != "block_out_channels"} | {"block_out_chanels": [32, 64]}
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    text = str(info.value)
    assert text.startswith("block_out_chanels: unknown field 'block_out_chanels' (did you mean 'block_out_channels'?")
    assert text.endswith("; missing: block_out_channels") and "\n" not in text


@pytest.mark.parametrize(
    ("content", "message"),
    [("in_channels: [4\n", "malformed YAML at line"), ("- 1\n- 2\n", "expected a mapping"), ("", "expected a mapping")],
)
def test_bad_yaml_file(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(SpecError, match=message):
        load_spec(path)


def test_unknown_preset_lists_the_allowed_ones() -> None:
    with pytest.raises(SpecError, match=r"unknown preset 'tinyy' \(allowed: .*tiny"):
        load_spec("tinyy")


BAD_POLICIES = [
    ("fast", "policy: unknown policy 'fast' (allowed: none, full, balanced, layers, every:N"),
    (["down.7"], "policy: unknown block name 'down.7' (valid: down.0, down.1, mid"),
    ("down.0,middle", "unknown block name 'middle'"),
    ("every:0", "policy: 'every:0' needs a positive integer"),
    (["down.1", "down.1.resnets.0"], "'down.1.resnets.0' lies inside 'down.1'"),
    (["mid", "mid.attentions.0"], "'mid.attentions.0' lies inside 'mid'"),
]


@pytest.mark.parametrize(("policy", "message"), BAD_POLICIES)
def test_bad_policy_gives_one_clear_line(policy: object, message: str) -> None:
    with pytest.raises(SpecError) as info:
        resolve_plan(spec_from_dict(TINY), policy)
    assert message in str(info.value)


def test_named_policies() -> None:
    spec = load_spec("ddpm_cifar10")
    blocks = block_names(spec)
    assert blocks == ["down.0", "down.1", "down.2", "down.3", "mid", "up.0", "up.1", "up.2", "up.3"]
    assert resolve_plan(spec, "none").recompute == ()
    assert resolve_plan(spec, "full").recompute == tuple(blocks)
    assert resolve_plan(spec, "balanced").recompute == tuple(b for b in blocks if b not in ("down.0", "up.3"))
    assert resolve_plan(spec, "every:3").recompute == ("down.0", "down.3", "up.1")
    layers = resolve_plan(spec, "layers").recompute
    # 4 levels x 2 resnets down, 1 attention level (x2) down, mid 2 resnets + 1 attention, 4 x 3 resnets up,
    # 1 attention level (x3) up.
    assert len(layers) == 8 + 2 + 3 + 12 + 3 == len(layer_names(spec))
    assert "down.1.attentions.1" in layers and "down.0.attentions.0" not in layers
    assert resolve_plan(spec, ["mid", "down.1"]).recompute == ("down.1", "mid")  # forward order
    assert resolve_plan(spec, "down.1, up.0.resnets.2").recompute == ("down.1", "up.0.resnets.2")


def test_policy_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "with_policy.yaml"
    path.write_text(yaml.safe_dump({**TINY, "checkpoint": ["mid", "up.1.resnets.0"]}))
    spec = load_spec(path)
    assert resolve_plan(spec).recompute == ("mid", "up.1.resnets.0")
    assert resolve_plan(load_spec("tiny")).recompute == ()


def test_yaml_exponent_floats_are_floats(tmp_path: Path) -> None:
    """YAML 1.1 reads `1e-6` (no dot) as a string, which the strict spec refuses: the loader reads it as YAML 1.2."""
    path = tmp_path / "eps.yaml"
    path.write_text(yaml.safe_dump({**TINY}) + "norm_eps: 1e-6\nlayer_norm_eps: 2E-5\n")
    spec = load_spec(path)
    assert (spec.norm_eps, spec.layer_norm_eps) == (1e-6, 2e-5)
    assert yaml.safe_load("a: 1e-6")["a"] == "1e-6"  # what plain PyYAML would have given


def test_new_presets_and_their_conditioning() -> None:
    sdxl = load_spec("sdxl")
    assert sdxl.addition_embedding is not None and sdxl.addition_embedding.text_embeds_dim == 1280
    assert [sdxl.heads(level) * 64 for level in range(3)] == list(sdxl.block_out_channels)  # 64-wide heads
    assert load_spec("sd21").cross_attention_dim == 1024
