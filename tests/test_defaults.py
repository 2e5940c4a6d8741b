"""One set of defaults (`shared_configs.defaults`): every CLI and library call, given no flags,
resolves to the same attention, dtype, context length, timed steps and JAX compilation cache on a
device. Parsers only: nothing is measured."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import pytest

from benchmarks import compare, max_batch, saved
from benchmarks import plan as plan_cli
from benchmarks.reports import tables
from jax_impl import train as jtrain
from shared_configs import load_spec
from shared_configs.defaults import (
    AUTO,
    CPU_ATTENTION_CHUNK,
    JAX_CACHE_ENV,
    Defaults,
    chunk_arg,
    defaults,
    resolve_chunk,
)
from shared_configs.planning.pipeline import DEVICE, Workload
from shared_configs.regime import Regime
from shared_configs.training.config import TrainConfig, options_of
from shared_configs.training.run_plan import workload_of
from torch_impl import train as ttrain

SPEC = load_spec("tiny")


@pytest.fixture(params=["folder", "off"])
def cache_env(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str | None:
    """The compilation cache as a user has it (XDG's folder) or turned off ($UNET_REMAT_JAX_CACHE=none)."""
    if request.param == "off":
        monkeypatch.setenv(JAX_CACHE_ENV, "none")
        return None
    monkeypatch.delenv(JAX_CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return str(tmp_path / "unet-remat" / "jax")


def _benchmark(args: argparse.Namespace, device: str) -> Defaults:
    """What `benchmarks.compare` / `max_batch` run with (the JAX worker resolves the chunk on its device)."""
    dtype = Regime(args.precision).compute_dtype or "float32"  # the regime's precision sets the forward's dtype
    return Defaults(
        device, resolve_chunk(args.jax_attention_chunk, device), dtype, args.context_length, args.steps, args.jax_cache
    )


def test_every_tool_resolves_to_the_same_defaults(cache_env: str | None) -> None:
    cpu = defaults("cpu")
    assert (cpu.attention_chunk, cpu.dtype, cpu.context_length, cpu.steps, cpu.jax_cache) == (
        CPU_ATTENTION_CHUNK,
        "float32",
        77,
        3,
        cache_env,
    )
    assert _benchmark(compare.build_parser().parse_args([]), "cpu") == cpu
    assert _benchmark(max_batch.parser().parse_args(["--budget-mib", "100"]), "cpu") == cpu
    # the planner: its CLI's workload is the library's (`plan_for_budget` builds Workload.of likewise)
    args, work, _ = plan_cli.parse_args(["--config", "tiny", "--batch-size", "2", "--budget-mib", "100"])
    assert DEVICE == "cpu" and work == Workload.of("tiny", batch_size=2)
    assert (work.attention_chunk, work.context_length, args.steps) == (
        cpu.attention_chunk,
        cpu.context_length,
        cpu.steps,
    )
    s = saved.build_parser().parse_args([])
    assert (resolve_chunk(s.attention_chunk, "cpu"), s.context_length) == (cpu.attention_chunk, cpu.context_length)
    for cfg in (jtrain.parse_args([]), TrainConfig()):  # fp32: float32 compute
        own = options_of(cfg, jtrain.JaxOptions)  # a config built in code (None): the defaults
        assert (resolve_chunk(own.attention_chunk, "cpu"), cfg.regime.compute_dtype or "float32", own.jax_cache) == (
            cpu.attention_chunk,
            cpu.dtype,
            cpu.jax_cache,
        )
    assert (ttrain.parse_args([]).regime.compute_dtype or "float32") == cpu.dtype  # torch: no chunk, no XLA cache
    # training to a budget plans the workload the run trains (its own context length: one token)
    assert workload_of(TrainConfig(config="tiny"), SPEC, 1).attention_chunk == cpu.attention_chunk


def test_on_gpu_jax_attention_is_xlas_own() -> None:
    gpu = defaults("gpu")
    assert gpu.attention_chunk is None and resolve_chunk(AUTO, "gpu") is None
    assert [f.name for f in fields(gpu) if getattr(gpu, f.name) != getattr(defaults("cpu"), f.name)] == [
        "device",
        "attention_chunk",
    ]
    assert _benchmark(compare.build_parser().parse_args([]), "gpu") == gpu
    assert resolve_chunk(7, "gpu") == 7 and resolve_chunk(None, "cpu") is None


def test_each_tool_says_what_it_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(JAX_CACHE_ENV, "/somewhere")
    line = "cpu: jax attention query-chunked, 64 queries per chunk, float32, context 77 tokens, 3 timed steps, "
    assert defaults("cpu").describe() == line + "jax compilation cache /somewhere"
    settings = vars(compare.build_parser().parse_args(["--jax-attention-chunk", "0"]))
    document = {
        "settings": settings | {"attention_chunk": settings["jax_attention_chunk"]},
        "device": {"requested": "auto", "torch": {"kind": "cpu"}, "jax": {"kind": "gpu"}},
    }
    assert tables.used(document) == (
        "settings gpu: jax attention unchunked, float32, context 77 tokens, 3 timed steps, jax compilation cache "
        "/somewhere"
    )
    assert Workload.of("tiny", batch_size=2).used(("torch",)) == "cpu: float32, context 77 tokens"
    bf16 = TrainConfig(regime=Regime(precision="bf16-mixed"))
    assert ttrain.run_settings(bf16, "cpu") == "cpu: bfloat16, torch attention SDPA"
    assert jtrain.run_settings(TrainConfig(options=jtrain.JaxOptions(attention_chunk=AUTO)), "gpu") == (
        "gpu: jax attention unchunked, float32, jax compilation cache /somewhere"
    )


@pytest.mark.parametrize(("text", "value"), [("auto", AUTO), ("0", None), ("32", 32)])
def test_chunk_flag(text: str, value: int | str | None) -> None:
    assert chunk_arg(text) == value
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected auto, 0 \(unchunked\) or a number of queries"):
        chunk_arg("-1")
