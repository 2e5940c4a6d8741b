"""`torch_impl.BudgetGuard` in a step shaped as diffusers' training scripts hold theirs, built from the
libraries themselves (nothing downloaded): accelerate's ``prepare`` / ``accumulate`` / ``backward``,
peft LoRA through ``unet.add_adapter``, a frozen ``AutoencoderKL`` and ``CLIPTextModel`` from tiny
configs, ``cast_training_params``; and diffusers' ``ControlNetModel`` beside its frozen U-Net.

Each guarded run is held against the same run unguarded (weights compared), and its peak after the
guard's last change against the budget. One profile per model, in the module's cache; the planner's
worker check of each plan is stood in for by the profile's prediction (`tests.helpers.guard`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from shared_configs import to_diffusers_config
from shared_configs.planning import pipeline
from shared_configs.planning.pipeline import Workload, predict_policy
from shared_configs.regime import Regime
from tests.helpers.guard import check_by_prediction, checking_by_prediction, plan_cache  # noqa: F401 (fixtures)
from tests.helpers.specs import variant
from torch_impl import BudgetGuard, ControlNetPair
from torch_impl.guard_model import regime_seen, step_spec, take_over_checkpointing
from torch_impl.guard_retry import RetryPoint
from torch_impl.wrappers import compiled, unwrap

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("plan_cache", "check_by_prediction")]
heavy = pytest.mark.heavy  # a profile of its own each (docs/guard.md: how long): left out of the default run
SPEC = variant("tiny", down_attention=["transformer", "none"], sample_size=8, dropout=0.0)  # SD-shaped, 8x8 latents
BATCH, TOKENS, RANK = 2, 8, 4
LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


class Script:
    """What a script holds after ``accelerator.prepare``: the trained model (the U-Net's LoRA
    adapters, or a ControlNet), the frozen VAE, text encoder (and U-Net), the optimizer, batches."""

    def __init__(self, controlnet: bool = False, accumulation: int = 1, weight_dtype: torch.dtype | None = None):
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
            self.vae = diffusers.AutoencoderKL(
                down_block_types=("DownEncoderBlock2D",) * 2,
                up_block_types=("UpDecoderBlock2D",) * 2,
                block_out_channels=(8, 16),
                layers_per_block=1,
                norm_num_groups=4,
                sample_size=16,
            )
            self.text = CLIPTextModel(
                CLIPTextConfig(
                    vocab_size=64,
                    hidden_size=12,
                    intermediate_size=24,
                    num_hidden_layers=1,
                    num_attention_heads=2,
                    max_position_embeddings=TOKENS,
                    bos_token_id=0,
                    eos_token_id=1,
                    pad_token_id=1,
                )
            )
        for module in (self.unet, self.vae, self.text):
            module.requires_grad_(False)
            module.to(dtype=weight_dtype)  # --mixed_precision bf16: the frozen weights in bfloat16
        self.controlnet = None
        if controlnet:  # train_controlnet.py: a ControlNet from the U-Net, trained whole
            widths = {"conditioning_embedding_out_channels": (8, 16)}  # the image at 2x the latents: 16x16
            self.controlnet = diffusers.ControlNetModel.from_unet(self.unet, **widths)
            self.controlnet.train()
        else:  # train_text_to_image_lora.py
            self.unet.add_adapter(
                LoraConfig(r=RANK, lora_alpha=RANK, init_lora_weights="gaussian", target_modules=LORA_TARGETS)
            )
            cast_training_params(self.unet, dtype=torch.float32)
        mixed = {torch.bfloat16: "bf16", None: "no"}[weight_dtype]
        self.accelerator = Accelerator(gradient_accumulation_steps=accumulation, cpu=True, mixed_precision=mixed)
        trained = self.controlnet if controlnet else self.unet
        optimizer = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=1e-3)
        self.trained, self.optimizer = self.accelerator.prepare(trained, optimizer)
        self.scheduler = diffusers.DDPMScheduler(num_train_timesteps=1000)
        g = torch.Generator().manual_seed(1)
        self.batches = [
            (torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 64, (BATCH, TOKENS), generator=g))
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

        losses.append(float(loss))
    return losses


def sizes(model: torch.nn.Module) -> int:
    """The budget 60% of the way from `full`'s predicted peak to `none`'s, in the regime the model shows."""
    model = unwrap(model)
    work = Workload.of(step_spec(model), batch_size=BATCH, regime=regime_seen(model)[0], context_length=TOKENS)
    none, full = (predict_policy(work, p)[0].prediction.peak_bytes for p in ("none", "full"))
    return full + 6 * (none - full) // 10


def largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def test_the_model_is_read_as_the_script_holds_it(capsys: pytest.CaptureFixture[str]) -> None:
    """No planning: wrappers taken off, the regime the weights show, diffusers' own checkpointing
    turned off in one line, `ControlNetPair.of` over the live networks (no copy)."""
    script = Script()
    assert unwrap(torch.compile(script.trained)) is script.unet and compiled(torch.compile(script.trained))
    assert regime_seen(script.unet)[0] == Regime(trainable=f"lora:{RANK}")
    script.unet.enable_gradient_checkpointing()
    assert take_over_checkpointing(script.unet) == ["UNet2DConditionModel"]
    assert not any(getattr(m, "gradient_checkpointing", False) for m in script.unet.modules())
    bf16 = Script(weight_dtype=torch.bfloat16)
    assert regime_seen(bf16.unet)[0] == Regime("bf16-frozen", f"lora:{RANK}")
    pair = Script(controlnet=True)
    both = ControlNetPair.of(pair.unet, torch.compile(pair.trained))
    assert both.unet is pair.unet and both.controlnet is pair.controlnet
    assert {id(p) for p in both.parameters()} == {id(p) for m in (pair.unet, pair.controlnet) for p in m.parameters()}
    assert regime_seen(both)[0] == Regime()  # the ControlNet trained whole, float32
    assert step_spec(both).controlnet.conditioning_embedding_out_channels == (8, 16)
    with pytest.raises(ValueError, match=r"^controlnet: its block_out_channels .* is not the U-Net's"):
        ControlNetPair.of(
            bf16.unet.__class__.from_config({**bf16.unet.config, "block_out_channels": (16, 48)}), pair.controlnet
        )


def test_a_retry_point_puts_back_accumulated_gradients_and_accelerates_counter() -> None:
    """Without planning: micro-step 2 of an accumulation of 2 fails after its backward; the retry
    point restores micro-step 1's gradients and accelerate's counter, and the run ends as the
    unguarded one (weights equal)."""
    plain, script = Script(accumulation=2), Script(accumulation=2)
    run(plain, None, 2)
    torch.manual_seed(5)
    params = [p for p in script.trained.parameters() if p.requires_grad]
    for i, (pixels, ids) in enumerate(script.batches[:2]):
        point = RetryPoint(params, torch.device("cpu"), [script.accelerator], fresh=i == 0)
        if i == 1:
            before = [p.grad.clone() for p in params]
            script.fail = lambda: True
            with pytest.raises(torch.OutOfMemoryError), script.accelerator.accumulate(script.trained):
                script.body(pixels, ids)
            assert script.accelerator.sync_gradients  # the failed attempt advanced the counter
            point.restore()
            assert not script.accelerator.sync_gradients
            assert all(torch.equal(p.grad, g) for p, g in zip(params, before, strict=True))
            script.fail = lambda: False
        with script.accelerator.accumulate(script.trained):
            script.body(pixels, ids)
    assert largest_difference(script.weights(), plain.weights()) == 0.0


@heavy
@pytest.mark.parametrize("controlnet", [False, True], ids=["lora", "controlnet"])
def test_a_script_step_keeps_the_budget_and_the_unguarded_weights(controlnet: bool) -> None:
    """No regime given: the guard reads it (LoRA rank 4 / the ControlNet trained whole), plans,
    re-plans on what the VAE and text encoder hold, and from the step after its last change the
    step's peak is within budget; the weights are the unguarded run's."""
    plain = Script(controlnet)
    run(plain, None, 6)
    script = Script(controlnet)
    budget = sizes(script.guarded_model())
    guard = BudgetGuard(script.guarded_model(), budget, batch_size=BATCH, context_length=TOKENS)
    assert guard._workload.regime == Regime(trainable="all" if controlnet else f"lora:{RANK}")
    run(script, guard, 6)
    last = max(i for i, r in enumerate(guard.history) if r.measured is None)
    after = [r.measured for r in guard.history[last:] if r.measured is not None]
    assert after and max(after) <= budget, guard.history
    assert largest_difference(script.weights(), plain.weights()) == 0.0
    print(
        f"\n{'controlnet' if controlnet else 'lora'}: budget {budget / 2**20:.3f} MiB;",
        *(
            f"{r.step} {r.action} {r.plan} {r.predicted / 2**20:.3f}/{(r.measured or 0) / 2**20:.3f}"
            for r in guard.history
        ),
        sep="\n  ",
    )


@heavy
@pytest.mark.parametrize("failing", [1, 2], ids=["micro-step-1", "micro-step-2"])
def test_out_of_memory_in_a_micro_step_retries_it_as_the_unguarded_run_has_it(
    failing: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """Gradient accumulation 2, an out-of-memory error after the backward of micro-step ``failing``
    (the gradients of micro-step 1 accumulated, accelerate's counter advanced): the micro-step runs
    again and every weight equals the unguarded run's."""
    plain = Script(accumulation=2)
    expected = run(plain, None, 4)
    script = Script(accumulation=2)
    guard = BudgetGuard(script.trained, sizes(script.trained), batch_size=BATCH, context_length=TOKENS)
    calls = iter(range(1, 100))
    script.fail = lambda: next(calls) == failing
    capsys.readouterr()
    losses = run(script, guard, 4)
    difference = largest_difference(script.weights(), plain.weights())
    print(f"\nout of memory in micro-step {failing}: largest weight difference {difference}")
    assert difference == 0.0 and losses == expected
    assert [r.action for r in guard.history].count("out of memory") == 1
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("guard:")]
    assert any(f"step {failing}: ran out of memory under" in x and "running it again" in x for x in lines), lines


@heavy
def test_out_of_memory_inside_the_optimizer_step_is_not_retried(capsys: pytest.CaptureFixture[str]) -> None:
    """Once the optimizer step has begun some weights may be updated: one line, the error re-raised."""
    script = Script()
    guard = BudgetGuard(script.trained, sizes(script.trained), batch_size=BATCH, context_length=TOKENS)

    def failing_step(opt: torch.optim.Optimizer, *_: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")

    handle = script.optimizer.optimizer.register_step_pre_hook(failing_step)
    capsys.readouterr()
    with pytest.raises(torch.OutOfMemoryError, match="raised by the test"):
        run(script, guard, 1)
    handle.remove()
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("guard:")]
    assert line.startswith("guard: step 1: ran out of memory under ") and "not run again: the optimizer step" in line


@heavy
def test_wrapped_models_are_unwrapped_and_own_checkpointing_is_taken_over(capsys: pytest.CaptureFixture[str]) -> None:
    """DDP (gloo, one process), ``torch.compile``'s module and accelerate's prepared one: the guard
    plans and puts its plan on the U-Net inside. diffusers' own checkpointing, on: turned off, one line."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    script = Script()
    unet = script.unet
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        wrapped = {"ddp": DistributedDataParallel(unet), "compiled": torch.compile(unet), "accelerate": script.trained}
        for name, model in wrapped.items():
            guard = BudgetGuard(model, 1 << 30, batch_size=BATCH, context_length=TOKENS, policy="full")
            assert guard.model is unet and guard.plan == "full", name
    finally:
        dist.destroy_process_group()
    unet.enable_gradient_checkpointing()
    capsys.readouterr()
    guard = BudgetGuard(torch.compile(unet), 1 << 30, batch_size=BATCH, context_length=TOKENS, policy="none")
    assert not any(getattr(m, "gradient_checkpointing", False) for m in unet.modules())
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        "guard: step 0: UNet2DConditionModel: its own gradient checkpointing is off; the guard's plan replaces it"
    )


@heavy
def test_a_bf16_base_with_fp32_lora_is_read_from_the_step_and_predicted_within_5_percent(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """diffusers' LoRA scripts under ``--mixed_precision bf16``: the frozen U-Net cast to bfloat16,
    the adapters float32 (``cast_training_params``), accelerate's autocast. With no regime given the
    guard plans ``bf16-frozen``; its prediction of the U-Net's own step (no VAE, no text encoder) is
    within 5% of the step's measured peak. A regime given by hand that the step does not run: one line."""
    script = Script(weight_dtype=torch.bfloat16)
    inputs = (torch.randn(BATCH, 4, 8, 8).bfloat16(), torch.tensor([3, 517]), torch.randn(BATCH, TOKENS, 12).bfloat16())

    def step() -> float:
        loss = F.mse_loss(script.trained(*inputs, return_dict=False)[0].float(), torch.zeros(BATCH, 4, 8, 8))
        script.accelerator.backward(loss)
        script.optimizer.step()
        script.optimizer.zero_grad()
        return loss.item()

    step()  # AdamW's state, as the profile's step has it
    guard = BudgetGuard(script.trained, 1 << 30, batch_size=BATCH, context_length=TOKENS, policy="none")
    assert guard._workload.regime == Regime("bf16-frozen", f"lora:{RANK}")
    for _ in range(2):
        guard.run(step)
    (record, *_), predicted = [r for r in guard.history if r.measured], guard.history[0].predicted
    print(f"\nbf16 base + fp32 LoRA: predicted {predicted} B, measured {record.measured} B")
    assert abs(predicted - record.measured) <= 0.05 * record.measured
    given = Regime("bf16-frozen", f"lora:{RANK}", optimizer="adamw8bit")  # profiled as adamw: no new profile
    guard = BudgetGuard(script.trained, 1 << 30, batch_size=BATCH, context_length=TOKENS, policy="none", regime=given)
    capsys.readouterr()
    guard.run(step)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        f"guard: step 1: the step runs in bf16-frozen, lora:{RANK}, adamw, not in the regime given "
        f"(bf16-frozen, lora:{RANK}, adamw8bit); planned for the one given"
    )


@heavy
def test_two_processes_re_plan_together(tmp_path: Path) -> None:
    """torchrun, 2 CPU processes (gloo, accelerate's DDP): rank 1's step holds 0.4 MiB more; both
    ranks judge the larger peak (one all-reduce) and put on rank 0's plan before the same step."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "tests.test_guard_scripts",
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the module's profile cache (`plan_cache`) among them
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, start_new_session=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    histories = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert histories[0] == histories[1], histories  # the same measurements judged, the same plans, the same steps
    assert "tightened" in [r["action"] for r in histories[0]], histories[0]
    print("\ntwo ranks:", *(f"{r['step']} {r['action']} {r['plan']} {r['measured']}" for r in histories[0]), sep="\n  ")


def _rank_main(out: str) -> None:
    """One rank of `test_two_processes_re_plan_together` (``python -m tests.test_guard_scripts OUT``)."""
    import dataclasses

    from torch_impl.guard_retry import from_rank0

    pipeline.run_worker = checking_by_prediction(pipeline.run_worker)
    torch.set_num_threads(1)
    script = Script()  # accelerate joins the torchrun group (gloo) and wraps the U-Net in DDP
    rank = torch.distributed.get_rank()
    script.extra = (400 << 10) * rank
    budget = from_rank0(lambda: sizes(script.trained))  # one profile, rank 0's
    guard = BudgetGuard(script.trained, budget, batch_size=BATCH, context_length=TOKENS)
    run(script, guard, 5)
    history = [dataclasses.asdict(r) for r in guard.history]
    Path(out, f"rank{rank}.json").write_text(json.dumps(history))


if __name__ == "__main__":
    _rank_main(sys.argv[1])
