"""`torch_impl.BudgetGuard` on this CPU, each case against a reference the guard does not compute:

* a step that holds an extra buffer beyond the model's step (budget and buffer sized from the
  predicted peaks of `none` and `full`) goes over budget under the planner's first plan and is
  within it after at most 3 guarded steps, both as PyTorch's ``MemTracker`` measures the step
  outside the guard; for our U-Net, for diffusers' ``UNet2DConditionModel`` and for the ControlNet
  step (`torch_impl.ControlNetPair`, planned as the pair); it is measured only in the first steps
  and after the change;
* a step that holds less than the profiled one (SGD: no optimizer state) loosens once;
* an out-of-memory error inside the step: the same step runs once more under a plan that recomputes
  more, and returns what an unguarded plain step returns (loss and gradients compared);
* one that fails even under `full`: one line, re-raised.

Profiles are measured once per spec into a temporary cache (tens of seconds each). The
extra-buffer and loosening cases plan with the planner's own check of each plan; the
out-of-memory cases stand the check in by the profile's prediction (their budgets do not matter).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from benchmarks.backends.diffusers_bench import DiffusersForward
from shared_configs import UNetSpec
from shared_configs.pair import ControlNetPairSpec, controlnet_pair, example_pair_batch
from shared_configs.planning import closed_loop, gpu, pipeline, whole
from shared_configs.planning.pipeline import Workload
from shared_configs.training.data import example_batch
from tests.helpers.diffusers_ref import diffusers_pair
from tests.helpers.guard import check_by_prediction, plan_cache  # noqa: F401 (fixtures)
from tests.helpers.guard import predicted as _predicted
from tests.helpers.specs import variant
from tests.helpers.tensors import rel_err
from torch_impl import BudgetGuard, ControlNetPair, UNet
from torch_impl import guard as guard_module
from torch_impl import memory as memory_module
from torch_impl.diffusers_adapter import diffusers_spec
from torch_impl.guard_model import RegimeWatch, gpu_flavour
from torch_impl.memory import memtracker, step_peak
from torch_impl.step import as_tensors

pytestmark = pytest.mark.usefixtures("plan_cache")  # one profile per spec for the module
BATCH = 4
SIZE = 16  # 16x16: activations above the weights, gradients and AdamW state (docs/guard.md has the peaks)


class Case:
    """A model (ours, diffusers', or a ControlNet pair: the U-Net frozen), the net the step calls,
    AdamW over the trained parameters (after a warm-up step), a batch, and a user step that holds
    ``extra`` bytes through forward, backward and the optimizer step."""

    def __init__(self, spec: UNetSpec | ControlNetPairSpec, diffusers: bool, optimizer: str = "adamw") -> None:
        pair = isinstance(spec, ControlNetPairSpec)
        ours, theirs = diffusers_pair(spec) if diffusers else (ControlNetPair(spec) if pair else UNet(spec), None)
        self.model = theirs if diffusers else ours
        self.net = DiffusersForward(theirs) if diffusers else ours
        params = [p for p in self.model.parameters() if p.requires_grad]
        sgd = optimizer == "sgd"
        self.optimizer = torch.optim.SGD(params, lr=1e-4) if sgd else torch.optim.AdamW(params, lr=1e-4, weight_decay=0)
        batch = example_pair_batch(spec, BATCH, 77) if pair else example_batch(spec, BATCH, 77, seed=0)
        noisy, t, noise, conditioning = as_tensors(batch)
        self.inputs = {"x": noisy, "t": t, **{k: v for k, v in conditioning.items() if v is not None}}
        self.noise = noise
        self.workload = Workload.of(spec if not diffusers else diffusers_spec(theirs), batch_size=BATCH)
        self.step()  # a warm-up, as the planner's profile has: AdamW's state exists from here on

    def step(self, extra: int = 0) -> float:
        """The user's training step: zero the gradients, hold ``extra`` bytes, forward, backward, update."""
        self.optimizer.zero_grad(set_to_none=True)
        held = torch.zeros(extra // 4)  # a teacher's features, a second batch, ...
        loss = F.mse_loss(self.net(**self.inputs), self.noise)
        loss.backward()
        self.optimizer.step()
        del held
        return loss.item()

    def independent_peak(self, extra: int) -> int:
        """The step's peak by PyTorch's ``MemTracker`` (model, AdamW state, the inputs), outside any guard."""
        with memtracker(self.model, self.optimizer, [*self.inputs.values(), self.noise]) as found:
            self.step(extra)
        return found["peak"]


def _sizes(work: Workload) -> tuple[int, int]:
    """Budget 60% of the way from `full`'s predicted peak to `none`'s; an extra buffer of a quarter of that gap."""
    none, full = _predicted(work, "none"), _predicted(work, "full")
    assert full < none
    return full + 6 * (none - full) // 10, (none - full) // 4


SPECS: dict[str, Callable[[], tuple[UNetSpec | ControlNetPairSpec, bool]]] = {
    "ours": lambda: (variant("tiny", sample_size=SIZE), False),
    "diffusers": lambda: (variant("sdxl_style", sample_size=SIZE, dropout=0.0), True),  # UNet2DConditionModel
    # the ControlNet step: a small conditioning embedding, the image at 2x the sample
    "controlnet": lambda: (controlnet_pair(variant("tiny", sample_size=SIZE), **SMALL_CONDITIONING), False),
}
SMALL_CONDITIONING = {"conditioning_embedding_out_channels": (8, 16)}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",  # diffusers' U-Net: heavy, as test_guard_scripts' guarded runs (its default tests read the model)
    [pytest.param(n, marks=pytest.mark.heavy) if n == "diffusers" else n for n in SPECS],
)
def test_an_extra_buffer_is_kept_within_budget_after_at_most_3_steps(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    if name == "controlnet":  # its plans' worker checks (slow) stood in for: MemTracker judges the step below
        request.getfixturevalue("check_by_prediction")
    torch.manual_seed(0)
    case = Case(*SPECS[name]())
    budget, extra = _sizes(case.workload)
    entered: list[int] = []
    # the guard's measurements (it takes `step_peak` from its module when it measures)
    monkeypatch.setattr(memory_module, "step_peak", _counting(entered))
    guard = BudgetGuard(case.model, budget, batch_size=BATCH)
    first = guard.plan
    assert first not in ("none", "full")
    capsys.readouterr()
    # The reference: the first plan in the user's step, by MemTracker outside the guard, is over budget.
    over = case.independent_peak(extra)
    assert over > budget, (over, budget)
    for _ in range(5):  # the step's optimizer is in its closure: the guard spots it stepping
        guard.run(case.step, extra)
    changes = [r for r in guard.history if r.measured is None]
    assert [r.action for r in changes] == ["planned", "tightened"] and changes[-1].step <= 3, guard.history
    tight = changes[-1]
    assert tight.plan == guard.plan != first and tight.predicted < changes[0].predicted
    over_record = guard.history[guard.history.index(tight) - 1]
    assert over_record.action == "over budget" and over_record.measured > budget
    assert tight.outside == over_record.measured - over_record.predicted  # the excess it re-planned for
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"guard: step {tight.step}: peaked at ") and "over the" in lines[0]
    target = round(budget * (1 - closed_loop.REPLAN_MARGIN)) - tight.outside  # a margin: plans' predictions err apart
    assert f"planned for {target / 2**20:.1f} MiB: " in lines[0] and tight.predicted <= target
    # Measured in the first 2 steps and the 2 after the change only, never in the steady state.
    measured = [r for r in guard.history if r.measured is not None]
    assert [r.step for r in measured] == sorted({1, 2, tight.step + 1, tight.step + 2})
    assert len(entered) == len(measured)
    # The check: the plan now in force, in the user's step, by MemTracker outside the guard.
    final = case.independent_peak(extra)
    assert final <= budget, (final, budget, guard.history)
    _report(name, guard, over, final, extra)


def _counting(entered: list[int]) -> Callable[..., Any]:
    def counting(*args: Any, **kwargs: Any) -> Any:
        entered.append(1)
        return step_peak(*args, **kwargs)

    return counting


def _report(name: str, guard: BudgetGuard, over: int, final: int, extra: int) -> None:
    """The run in one line (``pytest -s``): docs/guard.md's table."""
    mib, h = 2**20, guard.history
    first, tight = h[0], next(r for r in h if r.action == "tightened")
    before = max(r.measured for r in h if r.measured is not None and r.plan == first.plan)
    after = max(r.measured for r in h if r.measured is not None and r.plan == tight.plan)
    print(
        f"\n{name}: budget {guard.budget / mib:.2f} MiB | buffer {extra / mib:.2f} MiB | first {first.plan} "
        f"(predicted {first.predicted / mib:.2f}; guard {before / mib:.2f}; MemTracker {over / mib:.2f}) | excess "
        f"{tight.outside / mib:.2f} at step {tight.step} | then {tight.plan} (predicted {tight.predicted / mib:.2f};"
        f" guard {after / mib:.2f}; MemTracker {final / mib:.2f})"
    )


@pytest.mark.slow
def test_a_step_holding_less_than_the_profiled_one_loosens_once(capsys: pytest.CaptureFixture[str]) -> None:
    """SGD (no optimizer state) under a plan for AdamW's step: the first window peaks over 10% under
    the budget, so the guard re-plans once for budget - (measured - predicted), recomputing less;
    the step stays within budget (MemTracker, outside the guard)."""
    torch.manual_seed(0)
    case = Case(*SPECS["ours"](), optimizer="sgd")
    budget, _ = _sizes(case.workload)
    guard = BudgetGuard(case.model, budget, batch_size=BATCH)
    first = guard.history[-1]
    for _ in range(4):
        guard.run(case.step)
    actions = [r.action for r in guard.history]
    assert actions == ["planned", "measured", "measured", "loosened", "measured", "measured"], guard.history
    loose = guard.history[3]
    assert loose.predicted > first.predicted and loose.outside < 0
    assert "recomputes less" in capsys.readouterr().err
    assert case.independent_peak(0) <= budget


class FailingStep:
    """A user step that raises ``torch.OutOfMemoryError`` after its forward on its first ``fails``
    calls (as a GPU would), noting the plan and the predicted peak in force at each call."""

    def __init__(self, case: Case, guard: BudgetGuard, fails: int) -> None:
        self.case, self.guard, self.fails, self.plans = case, guard, fails, []

    def __call__(self) -> float:
        self.plans.append((self.guard.plan, self.guard.history[-1].predicted))
        if len(self.plans) > self.fails:
            return self.case.step()
        self.case.optimizer.zero_grad(set_to_none=True)
        out = self.case.net(**self.case.inputs)
        F.mse_loss(out, self.case.noise).backward(retain_graph=True)  # gradients and activations left behind
        raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")


@pytest.mark.slow
@pytest.mark.usefixtures("check_by_prediction")
def test_out_of_memory_runs_the_same_step_again_recomputing_more(capsys: pytest.CaptureFixture[str]) -> None:
    """The step fails once: it runs again (the same arguments, the same dropout draws) under a plan of
    lower predicted peak, and returns the loss and gradients of an unguarded plain step on the same batch."""
    torch.manual_seed(0)
    case = Case(*SPECS["ours"]())  # tiny: dropout 0.1, so the retry must draw the same masks
    reference = copy.deepcopy(case)
    none, full = _predicted(case.workload, "none"), _predicted(case.workload, "full")
    guard = BudgetGuard(case.model, full + 9 * (none - full) // 10, batch_size=BATCH)
    step = FailingStep(case, guard, fails=1)
    capsys.readouterr()
    torch.manual_seed(1)
    loss = guard.run(step)
    torch.manual_seed(1)
    expected = reference.step()  # no plan, no guard
    assert loss == pytest.approx(expected, rel=1e-6)
    for (n, p), q in zip(case.model.named_parameters(), reference.model.parameters(), strict=True):
        assert rel_err(p.grad, q.grad) < 1e-5, n
    (failed, p0), (retried, p1) = step.plans
    assert retried != failed and p1 < p0 and guard.plan == retried
    assert [r.action for r in guard.history] == ["planned", "out of memory", "recompute more", "measured"]
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("guard: step 1: ran out of memory under") and "running it again" in line


@pytest.mark.slow
@pytest.mark.usefixtures("check_by_prediction")
def test_out_of_memory_even_under_full_is_one_line_and_re_raised(capsys: pytest.CaptureFixture[str]) -> None:
    """Every attempt fails: the guard steps to plans of lower predicted peak up to `full`, then says
    so in one line and re-raises the step's own error, the gradients zeroed."""
    torch.manual_seed(0)
    case = Case(*SPECS["ours"]())
    none, full = _predicted(case.workload, "none"), _predicted(case.workload, "full")
    guard = BudgetGuard(case.model, full + 9 * (none - full) // 10, batch_size=BATCH)
    step = FailingStep(case, guard, fails=100)
    capsys.readouterr()
    assert all(p.grad is not None for p in case.model.parameters())  # the warm-up step's
    with pytest.raises(torch.OutOfMemoryError, match="raised by the test"):
        guard.run(step)
    predicted = [p for _, p in step.plans]
    assert step.plans[-1][0] == "full" and 2 <= len(step.plans) <= 2 + closed_loop.OOM_HALVINGS
    assert all(b < a for a, b in itertools.pairwise(predicted)), step.plans
    assert guard.history[-1].action == "full failed"
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == len(step.plans) and lines[-1] == (
        f"guard: step 1: ran out of memory under full (predicted {full / 2**20:.1f} MiB), which recomputes the "
        "most: the step does not fit this device; re-raising"
    )
    for p in case.model.parameters():  # as the window began, an optimizer step having used them: zeroed
        assert not p.grad.any()


def test_a_model_that_is_not_a_u_net_is_refused_before_planning() -> None:
    with pytest.raises(TypeError, match=r"UNet2DModel or UNet2DConditionModel.*, not Linear"):
        BudgetGuard(torch.nn.Linear(2, 2), 1 << 20, batch_size=1)


@pytest.mark.parametrize(
    ("capability", "flavour"), [((7, 5), "cuda"), ((8, 9), "cuda"), ((9, 0), "cuda-sm90"), ((12, 0), "cuda-sm90")]
)
def test_the_gpu_flavour_by_compute_capability(
    capability: tuple[int, int], flavour: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's cuBLAS workspaces are 32 MiB from compute capability 9 (Hopper) on: `gpu.DEVICES`' cuda-sm90."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    assert gpu_flavour(torch.device("cuda", 0)) == flavour
    assert gpu_flavour(torch.device("cpu")) == "cpu"


def test_the_update_an_optimizer_runs() -> None:
    """What the GPU flavour reads off the optimizers: torch's ``fused`` / ``foreach`` when given, bitsandbytes'
    8-bit class (its module stood in), None for torch's default, a mix, or an update the optimizer does not run."""
    params = list(torch.nn.Linear(4, 4).parameters())
    bnb = type("AdamW8bit", (torch.optim.AdamW,), {"__module__": "bitsandbytes.optim.adamw"})(params)
    assert RegimeWatch.update([torch.optim.AdamW(params, fused=True)], "adamw") == "fused"
    assert RegimeWatch.update([torch.optim.AdamW(params, foreach=False)], "adamw") == "per-parameter"
    assert RegimeWatch.update([torch.optim.Adafactor(params, foreach=True)], "adafactor") == "foreach"
    assert RegimeWatch.update([bnb], "adamw8bit") == "bitsandbytes"
    assert RegimeWatch.update([torch.optim.AdamW(params)], "adamw") is None
    assert RegimeWatch.update([torch.optim.AdamW(params, foreach=True)], "adamw") is None  # CUDA's default anyway
    assert RegimeWatch.update([torch.optim.AdamW(params, fused=True), torch.optim.AdamW(params)], "adamw") is None
    assert RegimeWatch.update([bnb], "adamw") is None  # bitsandbytes' 32-bit update is not modelled: torch's default


def planning_full(monkeypatch: pytest.MonkeyPatch, peak: int = 100 << 20) -> list[tuple[Workload, int]]:
    """`pipeline.plan` stood in: `full`, with ``peak`` as its predicted peak; returns the (workload, budget) asked."""
    asked: list[tuple[Workload, int]] = []

    def plan(workload: Workload, budget: int, framework: str, **options: Any) -> SimpleNamespace:
        asked.append((workload, budget))
        return SimpleNamespace(policy="full", solution=SimpleNamespace(prediction=SimpleNamespace(peak_bytes=peak)))

    monkeypatch.setattr(pipeline, "plan", plan)
    return asked


def test_on_cuda_a_re_plan_takes_the_update_the_optimizer_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU (device and capability stood in), the first optimizer step's optimizer names its update: a
    fused AdamW re-plans without foreach's copy; an ``optimizer_impl`` given is kept."""
    asked = planning_full(monkeypatch)
    monkeypatch.setattr(guard_module.BudgetGuard, "_device", lambda self: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    model = UNet(variant("tiny", sample_size=SIZE))
    for given, want in (({}, "fused"), ({"optimizer_impl": "foreach"}, "foreach")):
        guard = BudgetGuard(model, 1 << 30, batch_size=1, **given)
        guard._optimizers.append(torch.optim.AdamW(model.parameters(), fused=True))
        guard._watch.forwarded = True  # as after the first forward: fp32, AdamW, as planned
        monkeypatch.setattr(guard._watch, "seen", lambda planned, optimizers: (planned, []))
        assert guard._regime_differs() == (want == "fused")
        assert asked[-1][0].optimizer_impl == want and asked[-1][0].device == "cuda"


def test_what_the_script_holds_beside_the_step_is_planned_and_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """``holds=``: a teacher the step never reads is taken off the budget the planner gets, added to the prediction,
    and counted in the CPU measurement: the same step peaks higher by the teacher's bytes exactly."""
    asked = planning_full(monkeypatch)
    spec = variant("tiny", sample_size=8, dropout=0.0)
    model, teacher = UNet(spec), UNet(spec).requires_grad_(False)
    teacher_bytes = sum(t.nbytes for t in [*teacher.parameters(), *teacher.buffers()])
    optimizer = torch.optim.AdamW(model.parameters())
    noisy, t, noise, conditioning = as_tensors(example_batch(spec, 2, 77, seed=0))

    def step() -> None:
        optimizer.zero_grad()
        F.mse_loss(model(noisy, t, **conditioning), noise).backward()
        optimizer.step()

    step()  # AdamW's state, before both measured steps
    peaks = []
    for holds in ((), [teacher]):
        guard = BudgetGuard(model, 1 << 30, batch_size=2, holds=holds)
        guard.run(step)
        peaks.append(next(r.measured for r in guard.history if r.measured is not None))
    assert [budget for _, budget in asked] == [1 << 30, (1 << 30) - teacher_bytes]
    assert guard.history[0].predicted == (100 << 20) + teacher_bytes
    assert peaks[1] - peaks[0] == teacher_bytes


def test_the_first_plan_is_solved_for_the_models_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU model is planned for the CPU. On CUDA (device and capability stood in) for its GPU flavour: the
    plan's allocated peak may reach the budget over the allocator's fragmentation (the guard judges the reserve,
    which leaves the CUDA context out), and the predicted peak is stated as reserved. A ``device=`` given wins."""
    allocated = 100 << 20
    asked = planning_full(monkeypatch, allocated)
    model, budget = UNet(variant("tiny", sample_size=SIZE)), 1 << 30
    assert BudgetGuard(model, budget, batch_size=1).history[0].predicted == allocated
    monkeypatch.setattr(guard_module.BudgetGuard, "_device", lambda self: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    guarded = BudgetGuard(model, budget, batch_size=1)
    given = BudgetGuard(model, budget, batch_size=1, device="cuda")
    assert [w.device for w, _ in asked] == ["cpu", "cuda-sm90", "cuda"]
    assert asked[0][1] == budget
    for workload, planned_for in asked[1:]:
        assert whole.device_budget(workload, planned_for) == int(budget / gpu.FRAGMENTATION)
    assert guarded.history[0].predicted == given.history[0].predicted == round(allocated * gpu.FRAGMENTATION)
