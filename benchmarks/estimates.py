"""What fine-tuning Stable Diffusion's U-Nets needs, predicted from shapes: ``python -m benchmarks.estimates``.

Per preset (at its own sample size), batch and regime: the plain step's peak, diffusers-style
checkpointing's (`layers`), the planner's plan at each budget with its predicted time cost, and with
``--device cuda`` (the default) the GPU flavour (`shared_configs.planning.gpu`). Written as JSON and
Markdown into ``--out``, the JSON after every row (atomically; ``complete`` false until the last).
Profiles are cached, so a second run only solves. ``--gpu-gib``: the card table instead, per preset
and regime the largest batch that fits each card, plain and with the cheapest plan solved against the
card as ``nvidia-smi`` counts it. Method and tables: docs/regimes.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.reports.tables import atomic_write, markdown_table, write_json
from shared_configs.cli import OneLineParser, cli_errors, number_list, stopping
from shared_configs.planning import gpu, whole
from shared_configs.planning.budget import Profile, safety_margin
from shared_configs.planning.pipeline import Workload, plan, predict_policy, progress
from shared_configs.planning.solver import Infeasible, solve
from shared_configs.regime import Regime
from shared_configs.sizes import GIB
from shared_configs.spec import SpecError

CONFIGS = ("sd15", "sd21", "sdxl")  # each at its own sample size (64, 96, 128)
BATCHES = (1, 2, 4, 8)
BUDGETS_GIB = (12, 16, 24, 40, 80)
# The regimes of the table, by the name its rows use.
# bf16+adamw8bit: weights in bfloat16 too (kohya's --full_bf16); keep-grads: diffusers' DreamBooth default, the
# gradients allocated between steps (zeroed in place).
REGIMES: dict[str, Regime] = {
    "fp32": Regime(),
    "bf16-mixed": Regime("bf16-mixed"),
    "bf16-mixed+lora:8": Regime("bf16-mixed", "lora:8"),
    "bf16-mixed+adamw8bit": Regime("bf16-mixed", optimizer="adamw8bit"),
    "bf16-mixed+adafactor": Regime("bf16-mixed", optimizer="adafactor"),
    "bf16+adamw8bit": Regime("bf16", optimizer="adamw8bit"),
    "bf16-mixed+adamw8bit+keep-grads": Regime("bf16-mixed", optimizer="adamw8bit", keep_grads=True),
}
DEFAULT_REGIMES = ("fp32", "bf16-mixed", "bf16-mixed+lora:8", "bf16-mixed+adamw8bit", "bf16-mixed+adamw8bit+keep-grads")
DEVICES = ("cpu", *gpu.DEVICES)
DIFFUSERS_STYLE = "layers"


def _entry(workload: Workload, policy: str, device: str = "cpu") -> dict[str, Any]:
    sol, profiles = predict_policy(workload, policy, "torch")
    pred, profile = sol.predictions[0], profiles[0]
    entry = {"peak_bytes": pred.peak_bytes, "overhead": pred.overhead(profile)}
    if device != "cpu":
        entry[device] = asdict(
            gpu.estimate(profile, workload.spec, workload.regime, sol.assignment, gpu.DEVICES[device])
        )
    return entry


def _planned(workload: Workload, budget: int, none_peak: int) -> dict[str, Any]:
    if none_peak <= budget:
        return {"policy": "none", "peak_bytes": none_peak, "overhead": 0.0}
    try:
        found = plan(workload, budget, "torch")
    except Infeasible as err:
        return {"policy": None, "why": str(err)}
    pred = found.solution.predictions[0]
    return {"policy": found.policy, "peak_bytes": pred.peak_bytes, "overhead": pred.overhead(found.profiles[0])}


def row(
    config: str, batch: int, regime_name: str, budgets_gib: tuple[float, ...], device: str = "cpu"
) -> dict[str, Any]:
    """One line of the table: ``config`` at its own sample size, ``batch``, the named regime."""
    workload = Workload.of(config, batch_size=batch, regime=REGIMES[regime_name], shapes=True)
    none = _entry(workload, "none", device)
    return {
        "config": config,
        "sample_size": workload.spec.sample_size,
        "batch_size": batch,
        "regime": regime_name,
        "none": none,
        "diffusers_style": _entry(workload, DIFFUSERS_STYLE, device),
        "plans": {f"{gib:g}": _planned(workload, int(gib * GIB), none["peak_bytes"]) for gib in budgets_gib},
    }


def _gib(entry: dict[str, Any]) -> str:
    return f"{entry['peak_bytes'] / GIB:.1f}"


def _cell(entry: dict[str, Any]) -> str:
    if entry["policy"] is None:
        return "does not fit"
    if entry["policy"] == "none":
        return f"none fits ({_gib(entry)})"
    return f"{_gib(entry)} GiB, {100 * entry['overhead']:+.0f}%"


def markdown(doc: dict[str, Any]) -> str:
    """The table: peaks in GiB, costs as predicted overhead; on a GPU, allocated / nvidia-smi peaks too."""
    budgets, device = list(doc["budgets_gib"]), doc.get("device", "cpu")
    gpu_head = [f"{device}: none GiB (allocated / device)", f"{device}: diffusers-style GiB"] * (device != "cpu")
    rows = [
        ["config", "batch", "regime", "none GiB", "diffusers-style GiB (cost)", *gpu_head]
        + [f"plan @ {b:g} GiB" for b in budgets]
    ]
    for r in doc["rows"]:
        ds = r["diffusers_style"]
        rows.append(
            [
                f"{r['config']} {r['sample_size']}²",
                str(r["batch_size"]),
                r["regime"],
                _gib(r["none"]),
                f"{_gib(ds)} ({100 * ds['overhead']:+.0f}%)",
                *(
                    f"{e[device]['allocated_bytes'] / GIB:.1f} / {e[device]['device_bytes'] / GIB:.1f}"
                    for e in (r["none"], ds)
                    if device != "cpu"
                ),
                *(_cell(r["plans"][f"{b:g}"]) for b in budgets),
            ]
        )
    return markdown_table(rows) + "\n\n" + doc["method"] + "\n"


def _reading(allocated: int, device: str) -> int:
    """What the card's memory counts for an allocated peak (nvidia-smi), or the peak on the CPU."""
    return allocated if device == "cpu" else round(allocated * gpu.FRAGMENTATION) + gpu.DEVICES[device].context


def card_row(
    config: str,
    regime_name: str,
    batches: list[int],
    cards_gib: list[float],
    device: str,
    step: dict[str, bool],
) -> dict[str, Any]:
    """One line of the card table: per card, the largest batch that fits plain and with a plan."""
    found: list[tuple[int, Workload, Profile, int]] = []
    for batch in sorted(batches):
        work = Workload.of(config, batch_size=batch, regime=REGIMES[regime_name], shapes=True, device=device, **step)
        sol, (profile,) = predict_policy(work, "none", "torch")
        found.append((batch, work, profile, sol.predictions[0].peak_bytes))
    cards = {}
    for gib in cards_gib:
        budget = whole.device_budget(found[0][1], int(gib * GIB))
        plain = [{"batch": b, "device_bytes": _reading(peak, device)} for b, _, _, peak in found if peak <= budget]
        cell: dict[str, Any] = {"none": plain[-1] if plain else None, "plan": None}  # the largest batch that fits
        for batch, work, profile, _ in reversed(found):
            try:
                sol = solve(profile, work.spec, budget, safety_margin(profile, work.spec))
            except Infeasible:
                continue
            pred = sol.predictions[0]
            cell["plan"] = {
                "batch": batch,
                "policy": sol.policy,
                "overhead": pred.overhead(profile),
                "device_bytes": _reading(pred.peak_bytes, device),
                "peak_at": pred.peak_unit,
            }
            break
        cards[f"{gib:g}"] = cell
    return {"config": config, "sample_size": found[0][1].spec.sample_size, "regime": regime_name, "cards": cards}


def _card_cell(cell: dict[str, Any]) -> str:
    none, plan = cell["none"], cell["plan"]
    if plan is None:
        return "none fits"
    head = f"plain {none['batch']}" if none else "plain -"
    if none and plan["batch"] == none["batch"]:
        return head
    return f"{head} · plan {plan['batch']} ({100 * plan['overhead']:+.0f}%)"


def cards_markdown(doc: dict[str, Any]) -> str:
    """Per card, "plain B · plan B' (+X%)", the largest batch plain and with the cheapest plan that fits."""
    cards = doc["cards_gib"]
    unit = "nvidia-smi GiB" if doc["device"] != "cpu" else "GiB"
    rows = [
        [f"{r['config']} {r['sample_size']}²", r["regime"], *(_card_cell(r["cards"][f"{g:g}"]) for g in cards)]
        for r in doc["rows"]
    ]
    return (
        markdown_table([["config", "regime", *(f"{g:g} {unit}" for g in cards)], *rows]) + "\n\n" + doc["method"] + "\n"
    )


def cards_method(device: str, batches: list[int], step: dict[str, bool]) -> str:
    extra = [k.replace("_", "-") for k, v in step.items() if v]
    return (
        f"Predicted by `python -m benchmarks.estimates --gpu-gib` from shapes at batches {','.join(map(str, batches))}"
        f" (device {device}{'; ' + ', '.join(extra) if extra else ''}): the largest of those batches whose "
        "predicted peak fits each card, plain and with the cheapest plan solved against the card (cost: "
        "recompute FLOPs at 100 TFLOP/s and elementwise bytes at 2 TB/s over the plain step)."
    )


_ints, _floats = number_list(int, "positive integers"), number_list(float, "positive numbers")
_configs = number_list(str, "preset names or spec files", ok=bool, skip_blank=True)
_regimes = number_list(str, f"names from {', '.join(REGIMES)}", ok=REGIMES.__contains__, skip_blank=True)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m benchmarks.estimates", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--configs", "--config", type=_configs, default=list(CONFIGS), help="presets (default: sd15,sd21,sdxl)"
    )
    p.add_argument("--batches", type=_ints, default=list(BATCHES), help="batch sizes (default: 1,2,4,8)")
    p.add_argument(
        "--regimes",
        type=_regimes,
        default=list(DEFAULT_REGIMES),
        help=f"regimes, from {', '.join(REGIMES)} (default: {','.join(DEFAULT_REGIMES)})",
    )
    p.add_argument("--budgets-gib", type=_ints, default=list(BUDGETS_GIB), help="budgets, GiB (default 12,16,24,40,80)")
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="cuda",
        help="add the GPU flavour of the none and diffusers-style peaks (cuda: before Hopper; "
        "cuda-sm90: Hopper's workspaces; cpu: none; default cuda)",
    )
    p.add_argument(
        "--gpu-gib",
        type=_floats,
        default=[],
        help="the card table instead: per preset and regime, the largest of --batches that fits each of "
        "these cards (GiB, as nvidia-smi counts with --device cuda), plain and with a plan",
    )
    p.add_argument("--with-encoders", action="store_true", help="--gpu-gib: the VAE and text encoders beside the U-Net")
    p.add_argument("--cached-latents", action="store_true", help="--gpu-gib --with-encoders: no VAE")
    p.add_argument("--train-text-encoder", action="store_true", help="--gpu-gib: the text encoder trained too")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("estimates"),
        help="folder for estimates.json and .md (cards.json and .md with --gpu-gib)",
    )
    return p


METHOD = (
    "Predicted by `python -m benchmarks.estimates` (PyTorch's step on fake tensors; peaks of live tensors, step-time "
    "cost from recompute FLOPs at 100 TFLOP/s and elementwise bytes at 2 TB/s, the step counted in its regime; "
    "adamw8bit's state modelled from torchao's layout). Plans are checked below the budget on fake tensors."
)
GPU_METHOD = (
    " GPU flavour (`shared_configs.planning.gpu`, {device}): allocated = the CPU estimate with CUDA autocast's float32 "
    "norms, the cuBLAS/cuBLASLt workspaces and a 512-byte rounding bound; device = allocated x 1.11 "
    "(fragmentation) + the CUDA context, what nvidia-smi shows."
)


def parse_args(
    argv: list[str] | None = None,
) -> tuple[argparse.Namespace, list[tuple], Callable[..., dict[str, Any]], dict[str, Any], str]:
    """The flags and the table they ask for: each row's arguments and what makes a row of them, the document's
    fields and method (``--gpu-gib``: the card table, a row per preset and regime over every batch); SpecError
    for the card table's options without --gpu-gib."""
    args = build_parser().parse_args(argv)
    step = {k: getattr(args, k) for k in ("with_encoders", "cached_latents", "train_text_encoder")}
    if not args.gpu_gib and any(step.values()):
        raise SpecError("--with-encoders, --cached-latents, --train-text-encoder: for the card table (--gpu-gib)")
    if args.gpu_gib:
        cases = [(c, r) for c in args.configs for r in args.regimes]
        make = partial(card_row, batches=args.batches, cards_gib=args.gpu_gib, device=args.device, step=step)
        return args, cases, make, {"cards_gib": args.gpu_gib}, cards_method(args.device, args.batches, step)
    cases = [(c, b, r) for c in args.configs for b in args.batches for r in args.regimes]
    make = partial(row, budgets_gib=tuple(args.budgets_gib), device=args.device)
    method = METHOD + (GPU_METHOD.format(device=args.device) if args.device != "cpu" else "")
    return args, cases, make, {"budgets_gib": args.budgets_gib}, method


def main(argv: list[str] | None = None) -> int:
    rows: list[dict[str, Any]] = []
    with cli_errors("benchmarks.estimates"):
        args, cases, make, fields, method = parse_args(argv)
        name, render = ("cards", cards_markdown) if args.gpu_gib else ("estimates", markdown)
        try:
            start = time.perf_counter()
            args.out.mkdir(parents=True, exist_ok=True)
            for i, case in enumerate(cases, start=1):
                what = ", ".join(str(c) if not isinstance(c, int) else f"batch {c}" for c in case)
                progress(f"{name} {i}/{len(cases)}: {what} ({time.perf_counter() - start:.0f} s so far)")
                try:
                    rows.append(make(*case))
                except SpecError as err:
                    raise SpecError(f"{what}: {err}") from None
                doc = (  # ``complete`` false (and ``rows`` of ``cases``) until the last row is in
                    {"complete": len(rows) == len(cases), "cases": len(cases), "device": args.device}
                    | fields
                    | {"rows": rows, "seconds": round(time.perf_counter() - start, 1), "method": method}
                )
                write_json(args.out / f"{name}.json", doc)  # after every row: a cut run keeps what it did
        except KeyboardInterrupt as stop:
            kept = (
                f"{len(rows)} of {len(cases)} rows written to {args.out / (name + '.json')}, marked incomplete "
                f'("complete": false); {name}.md not written'
                if rows
                else "nothing written"
            )
            with stopping(f"{kept} (profiles made stay cached)"):
                raise stop from None
        atomic_write(args.out / f"{name}.md", render(doc).encode())
        print(render(doc))
        print(f"wrote {args.out / (name + '.json')}, {args.out / (name + '.md')} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
