"""Which card a fine-tune needs: ``python -m benchmarks.estimates ... --gpu-gib 12,16,24,40,80``.

Per preset and regime, the largest of the batches given that fits each card: with no checkpointing,
and with the cheapest fitting plan (and its predicted time cost). The step is the workload's whole
step (`shared_configs.planning.whole`: the GPU flavour, the encoders when asked), solved against
the card's memory as ``nvidia-smi`` counts it; the plans are solved, not checked on fake tensors
(the shapes profile is the fake step's own figures). Method and table: docs/regimes.md.
"""

from __future__ import annotations

from typing import Any

from shared_configs.planning import gpu, whole
from shared_configs.planning.budget import Profile, safety_margin
from shared_configs.planning.planner import Workload, predict_policy
from shared_configs.planning.solver import Infeasible, solve
from shared_configs.regime import Regime
from shared_configs.units import MIB

GIB = 1024 * MIB


def _reading(allocated: int, device: str) -> int:
    """What the card's memory counts for an allocated peak (nvidia-smi), or the peak on the CPU."""
    if device == "cpu":
        return allocated
    return round(allocated * gpu.FRAGMENTATION) + gpu.DEVICES[device].context


def card_row(config: str, regime_name: str, regime: Regime, batches: list[int], cards_gib: list[float],
             device: str, step: dict[str, bool]) -> dict[str, Any]:  # fmt: skip
    """One line of the card table: per card, the largest batch that fits plain and with a plan."""
    found: list[tuple[int, Workload, Profile, int]] = []
    for batch in sorted(batches):
        work = Workload.of(config, batch_size=batch, regime=regime, shapes=True, device=device, **step)
        sol, (profile,) = predict_policy(work, "none", "torch")
        found.append((batch, work, profile, sol.predictions[0].peak_bytes))
    cards = {}
    for gib in cards_gib:
        budget = whole.device_budget(found[0][1], int(gib * GIB))
        plain = [(b, peak) for b, _, _, peak in found if peak <= budget]
        cell: dict[str, Any] = {"none": None, "plan": None}
        if plain:
            cell["none"] = {"batch": plain[-1][0], "device_bytes": _reading(plain[-1][1], device)}
        for batch, work, profile, _ in reversed(found):
            try:
                sol = solve(profile, work.spec, budget, safety_margin(profile, work.spec))
            except Infeasible:
                continue
            pred = sol.predictions[0]
            cell["plan"] = {"batch": batch, "policy": sol.policy, "overhead": pred.overhead(profile),
                            "device_bytes": _reading(pred.peak_bytes, device), "peak_at": pred.peak_unit}  # fmt: skip
            break
        cards[f"{gib:g}"] = cell
    return {"config": config, "sample_size": found[0][1].spec.sample_size, "regime": regime_name, "cards": cards}


def _cell(cell: dict[str, Any]) -> str:
    none, plan = cell["none"], cell["plan"]
    if plan is None:
        return "none fits"
    head = f"plain {none['batch']}" if none else "plain -"
    if none and plan["batch"] == none["batch"]:
        return head
    return f"{head} · plan {plan['batch']} ({100 * plan['overhead']:+.0f}%)"


def markdown(doc: dict[str, Any]) -> str:
    """Per card, "plain B · plan B' (+X%)": the largest batch with no checkpointing, and with the
    cheapest plan that fits (its predicted step-time cost); "none fits": not even batch 1 planned."""
    cards, device = doc["cards_gib"], doc["device"]
    unit = "nvidia-smi GiB" if device != "cpu" else "GiB"
    head = ["config", "regime", *(f"{g:g} {unit}" for g in cards)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in doc["rows"]:
        cells = [f"{r['config']} {r['sample_size']}²", r["regime"], *(_cell(r["cards"][f"{g:g}"]) for g in cards)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n" + doc["method"] + "\n"


def method(device: str, batches: list[int], step: dict[str, bool]) -> str:
    extra = [k.replace("_", "-") for k, v in step.items() if v]
    listed = ",".join(map(str, batches))
    return (f"Predicted by `python -m benchmarks.estimates --gpu-gib` from shapes at batches {listed}"
            f" (device {device}{'; ' + ', '.join(extra) if extra else ''}): the largest of those batches whose "
            "predicted peak fits each card, plain and with the cheapest plan solved against the card (cost: "
            "recompute FLOPs at 100 TFLOP/s and elementwise bytes at 2 TB/s over the plain step).")  # fmt: skip
