"""The GPU flavour's terms (`shared_configs.planning.gpu`), each against a count made another way:
the allocator's rounding over a list of sizes, the logsumexp and autocast bytes from the shapes by
hand (and torch's CPU kernels keeping what the model says the CPU profile keeps), the workspace
from PyTorch's config string, the flavour's peak as the CPU estimate plus the terms."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks import plan as cli
from shared_configs import load_spec
from shared_configs.planning import gpu, pipeline
from shared_configs.planning.budget import Cost, Profile, predict
from shared_configs.planning.pipeline import CACHE_ENV, Workload, profile_path
from shared_configs.planning.units import PLAIN, assignment_of, block_layers
from shared_configs.regime import Regime
from tests.helpers.specs import random_profile
from torch_impl.unet import UNet

MIB = 2**20
SD15 = load_spec("sd15")  # 64x64 latents, 8 heads, one transformer layer per attention
TINY = load_spec("tiny")  # a "self" attention at level 0, a transformer at level 1 and in the middle


def test_rounding_against_a_direct_computation() -> None:
    sizes = [1, 511, 512, 513, 4096 * 320 * 2, MIB, MIB + 1, 10 * MIB - 1, 10 * MIB, 13 * MIB + 1]
    by_hand = [512, 512, 512, 1024, 4096 * 320 * 2, MIB, MIB + 512, 10 * MIB, 10 * MIB, 13 * MIB + 512]
    assert [gpu.round_size(s) for s in sizes] == by_hand


def test_workspaces_from_pytorchs_config_string() -> None:
    config = ":4096:2:16:8"  # CUBLAS_WORKSPACE_CONFIG's default: KiB per chunk, chunks
    numbers = [int(x) for x in config.strip(":").split(":")]
    per_handle = sum(kib * 1024 * n for kib, n in zip(numbers[::2], numbers[1::2], strict=True))
    assert per_handle == gpu.CUBLAS_WORKSPACE == 8 * MIB + 128 * 1024
    assert gpu.workspace_bytes() == 2 * per_handle  # cuBLAS and cuBLASLt
    assert gpu.workspace_bytes(hopper=True) == 64 * MIB
    # PR #86509's measurement less the 20 MiB segment its 6.4 MB tensor took (1-10 MiB requests take one)
    assert gpu.CONTEXT_LAZY == 287_047_680 - 20 * MIB


def test_logsumexp_from_shapes_by_hand() -> None:
    # sd15: 8 heads; a self and a cross attention per transformer; 5 transformers at 64x64 (down.0 x2,
    # up.3 x3), 5 at 32x32, 5 at 16x16, the middle one at 8x8
    per_attention = 2 * 4 * 8  # two attentions, float32, 8 heads: bytes per query
    for batch in (1, 8):
        by_hand = batch * per_attention * (5 * 64**2 + 5 * 32**2 + 5 * 16**2 + 8**2)
        lse = gpu.logsumexp_bytes(SD15, batch)
        assert sum(lse.values()) == by_hand
        assert lse["down.0.attentions.0"] == batch * per_attention * 64**2
        # the memory-efficient kernel's padding to 32 queries adds nothing for SD's token counts
        assert gpu.logsumexp_bytes(SD15, batch, block=32) == lse
    # tiny's 8x8 level: 64 queries; its 4x4 level's 16 pad to 32
    padded, plain = gpu.logsumexp_bytes(TINY, 1, block=32), gpu.logsumexp_bytes(TINY, 1)
    assert sum(padded.values()) > sum(plain.values())


def _saving(saved: list[torch.Tensor]) -> torch.autograd.graph.saved_tensors_hooks:
    """Every tensor autograd saves for the backward, appended to ``saved``."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)


def test_the_cpu_kernel_keeps_the_same_logsumexp() -> None:
    """What the model leaves to the CPU profile: torch's fused CPU attention keeps B x heads x queries float32."""
    saved: list[torch.Tensor] = []
    q = torch.randn(2, 8, 64, 40, requires_grad=True)
    with _saving(saved), torch.autocast("cpu", dtype=torch.bfloat16):
        F.scaled_dot_product_attention(q, q, q)
    lse = [t for t in saved if t.dtype == torch.float32]
    assert [tuple(t.shape) for t in lse] == [(2, 8, 64)]


def test_autocast_bytes_from_shapes_by_hand() -> None:
    terms = gpu.autocast_bytes(SD15, 1)
    elems = 320 * 64**2  # level 0's activations
    # a ResNet: GroupNorm + SiLU twice, float32 input copy and SiLU-saved output, 2 B each over bf16
    assert terms["down.0.resnets.0"] == 2 * elems * (2 + 2)
    # a transformer: proj_in's GroupNorm and three LayerNorms, their inputs only (a linear casts the output)
    assert terms["down.0.attentions.0"] == 4 * elems * 2
    assert terms["head"] == elems * (2 + 2)
    assert "down.0.downsample" not in terms and "stem" not in terms
    assert gpu.autocast_bytes(SD15, 8)["down.0.resnets.0"] == 8 * terms["down.0.resnets.0"]
    # tiny's level-0 "self" attention: one GroupNorm before q, k, v
    assert gpu.autocast_bytes(TINY, 2)["down.0.attentions.0"] == 2 * 16 * 8**2 * 2


def test_cpu_autocast_keeps_norms_in_bfloat16() -> None:
    """The other side of the autocast term: on CPU, GroupNorm's output (saved by SiLU) is bfloat16."""
    saved: list[torch.Tensor] = []
    x = torch.randn(2, 64, 8, 8, requires_grad=True)
    with _saving(saved), torch.autocast("cpu", dtype=torch.bfloat16):
        F.silu(torch.nn.GroupNorm(32, 64)(x.to(torch.bfloat16)))
    activations = [t for t in saved if t.shape == x.shape]
    assert activations and all(t.dtype == torch.bfloat16 for t in activations)


def test_the_regime_decides_the_kept_terms() -> None:
    assert gpu.kept_bytes(SD15, 1, Regime("bf16-mixed")) == gpu.autocast_bytes(SD15, 1)
    assert gpu.kept_bytes(SD15, 1, Regime("fp32")) == {}  # no autocast; no padding at SD's token counts
    assert gpu.kept_bytes(SD15, 1, Regime("bf16")) == {}  # no autocast at all
    assert gpu.kept_bytes(TINY, 1, Regime("fp32"))  # tiny's 16 queries pad to 32


def _zero_profile(spec: object, batch: int) -> Profile:
    """A profile whose units keep nothing and peak at nothing: the flavour's peak is its terms alone."""
    base = random_profile(TINY, 0, framework="torch")
    units = {u: {c: Cost(0, 0, 0) for c in per} for u, per in base.units.items()}
    return dataclasses.replace(base, units=units, opt_peak=0, scale=1.0, batch_size=batch)


@pytest.mark.parametrize("batch", [1, 4])
def test_the_flavours_peak_is_the_cpu_estimate_plus_the_terms(batch: int) -> None:
    regime, profile = Regime("bf16-mixed"), _zero_profile(TINY, batch)
    static = gpu.workspace_bytes() + gpu.rounding_bound(TINY, regime)
    kept = gpu.kept_bytes(TINY, batch, regime)
    # all plain: by the last unit's backward every unit's float32 norms are alive
    flavour = gpu.estimate(profile, TINY, regime, {})
    assert flavour.cpu_peak_bytes == 0 and flavour.allocated_bytes == sum(kept.values()) + static
    assert flavour.reserved_bytes == round(flavour.allocated_bytes * gpu.FRAGMENTATION)
    assert flavour.device_bytes == flavour.reserved_bytes + gpu.CONTEXT_LAZY
    assert sum(v for k, v in flavour.terms.items() if "context" not in k and "fragmentation" not in k) == (
        flavour.allocated_bytes - flavour.cpu_peak_bytes
    )
    # every block recomputed: a block's norms are alive only in its own backward; the head stays plain
    blocks = block_layers(TINY)
    per_block = [sum(v for u, v in kept.items() if u.startswith(b + ".")) for b in blocks]
    full = gpu.estimate(profile, TINY, regime, assignment_of(TINY, "full"))
    assert full.allocated_bytes == max(*per_block, kept["head"]) + static


def test_a_real_profile_gains_the_static_terms_and_the_optimizers_at_the_optimizer() -> None:
    regime = Regime("fp32")  # tiny's padding is kept by plain units; at the optimizer it is gone
    params = list(UNet(TINY).parameters())  # the trained tensors, from the torch model itself
    trained_bytes, largest = 4 * sum(p.numel() for p in params), max(p.numel() for p in params)
    profile = dataclasses.replace(
        random_profile(TINY, 3, framework="torch"), opt_peak=10**10, scale=1.0, grad_bytes=trained_bytes
    )
    flavoured = gpu.gpu_profile(profile, TINY, regime)
    static = gpu.workspace_bytes() + gpu.rounding_bound(TINY, regime)
    # CUDA's foreach AdamW: one more copy of the trained weights, where the CPU's loop held two of the largest
    foreach = trained_bytes - 2 * 4 * largest
    assert predict(flavoured, TINY, {}).peak_bytes == predict(profile, TINY, {}).peak_bytes + static + foreach
    fused = gpu.gpu_profile(profile, TINY, regime, gpu.Device(optimizer_impl="fused"))
    assert predict(fused, TINY, {}).peak_bytes == predict(profile, TINY, {}).peak_bytes + static - 2 * 4 * largest
    # bitsandbytes' 8-bit kernel updates in place, as fused: the CPU loop's temporaries leave
    assert gpu.optimizer_delta(profile, TINY, Regime("fp32", optimizer="adamw8bit"), "bitsandbytes") == -8 * largest
    terms = gpu.estimate(profile, TINY, regime, {}).terms
    assert terms["optimizer step (foreach, over the CPU's peak)"] == foreach
    unit = "down.1.attentions.0"  # the 4x4 level's: 16 queries padded to 32
    extra = gpu.kept_bytes(TINY, profile.batch_size, regime)[unit]
    assert flavoured.units[unit][PLAIN].keep == profile.units[unit][PLAIN].keep + extra
    assert flavoured.units[unit]["full"].keep == profile.units[unit]["full"].keep  # recomputed: nothing kept


def test_plan_device_cuda_adds_the_flavour(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``plan --device cuda``: torch's entry carries the flavour of the policy, printed beside the CPU figure."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    profile = random_profile(TINY, 0, framework="torch")
    path = profile_path("torch", Workload.of("tiny", batch_size=2))
    path.parent.mkdir(parents=True)
    profile.save(path)
    out = tmp_path / "p.json"
    argv = ["--config", "tiny", "--batch-size", "2", "--policy", "layers", "--framework", "torch", "--json", str(out)]
    assert cli.main([*argv, "--device", "cuda"]) == 0
    want = dataclasses.asdict(gpu.estimate(profile, TINY, Regime(), assignment_of(TINY, "layers")))
    assert json.loads(out.read_text())["frameworks"]["torch"]["gpu"] == {"device": "cuda"} | want
    assert f"cuda: max_memory_allocated {want['allocated_bytes'] / MIB:.1f} MiB" in capsys.readouterr().out


ON_A_GPU = "--unfused-attention, --optimizer-impl: how a GPU runs the step; give --device cuda too"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--unfused-attention"], ON_A_GPU),
        (["--optimizer-impl", "fused"], ON_A_GPU),
        (
            ["--device", "cuda", "--optimizer-impl", "bitsandbytes"],
            "optimizer implementation: adamw runs as one of per-parameter, foreach, fused, got 'bitsandbytes'",
        ),
        (["--cached-latents"], "--cached-latents: leaves the VAE out of --with-encoders"),
        (["--with-encoders"], "--with-encoders: no known text encoders for cross_attention_dim 12"),
    ],
)
def test_plan_refuses_whole_step_flags_in_one_line(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--config", "tiny", "--batch-size", "2", "--shapes", "--policy", "layers", *extra])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_plan_refuses_the_flavour_for_jax_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--config", "tiny", "--batch-size", "2", "--shapes", "--policy", "layers", "--framework", "jax"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main([*argv, "--device", "cuda"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "--device cuda" in err


def test_a_plan_for_a_card_fits_the_card_where_the_cpu_models_would_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--device cuda --budget-mib B``: solved against the flavour, so B is the card's memory as
    nvidia-smi counts it; the plan solved on the CPU figures at the same B would not fit that card."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    profile = random_profile(TINY, 0, framework="torch")
    path = profile_path("torch", Workload.of("tiny", batch_size=2))
    path.parent.mkdir(parents=True)
    profile.save(path)

    def run_worker(request: dict) -> dict:  # the fit check: the CPU model's own prediction
        (policy,) = request["policies"]
        return {"peaks": {policy: predict(profile, TINY, assignment_of(TINY, policy)).peak_bytes}}

    monkeypatch.setattr(pipeline, "run_worker", run_worker)
    budget = 600 * MIB
    on_card = pipeline.plan(Workload.of("tiny", batch_size=2, device="cuda"), budget)
    card = gpu.estimate(profile, TINY, Regime(), on_card.solution.assignment)
    assert card.device_bytes <= budget and on_card.solution.predictions[0].peak_bytes == card.allocated_bytes
    on_cpu = pipeline.plan(Workload.of("tiny", batch_size=2), budget)
    assert gpu.estimate(profile, TINY, Regime(), on_cpu.solution.assignment).device_bytes > budget


def test_unfused_attention_keeps_its_probabilities() -> None:
    """``--unfused-attention``: by hand from the shapes, and what autograd saves when the attention
    runs as diffusers' ``AttnProcessor`` does (baddbmm, softmax, bmm): the softmax's output."""
    lse = gpu.logsumexp_bytes(SD15, 1)["down.0.attentions.0"]
    by_hand = 8 * 4096 * (4096 + 77)  # 8 heads, 4096 queries, a self (4096 keys) and a cross (77) attention
    assert gpu.probabilities_bytes(SD15, 1, Regime("fp32"))["down.0.attentions.0"] == 4 * by_hand - lse
    assert gpu.probabilities_bytes(SD15, 1, Regime("bf16-mixed"))["down.0.attentions.0"] == 6 * by_hand - lse
    assert gpu.kept_bytes(SD15, 1, Regime("fp32"), unfused=True) == gpu.probabilities_bytes(SD15, 1, Regime("fp32"))
    saved: list[torch.Tensor] = []
    q = torch.randn(2 * 8, 64, 40, requires_grad=True)  # (batch x heads, queries, head dim)
    with _saving(saved):
        scores = torch.baddbmm(torch.empty(16, 64, 64), q, q.transpose(1, 2), beta=0, alpha=40**-0.5)
        torch.bmm(scores.softmax(dim=-1), q)
    kept = {t.data_ptr(): t for t in saved if tuple(t.shape) == (16, 64, 64)}
    assert [t.dtype for t in kept.values()] == [torch.float32]  # the probabilities, once; the scores are not kept
