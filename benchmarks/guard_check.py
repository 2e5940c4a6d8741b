"""`torch_impl.BudgetGuard` on a real step: ``python -m benchmarks.guard_check --config sd15 --out DIR``.

The budget is 60% of the way from `full`'s predicted peak to `none`'s, and the user's step holds an
extra buffer of a quarter of that gap all step long (`sizes`). The guard plans, runs ``--steps`` steps
and re-plans when a measured step is over budget; every record (predicted against measured) is
printed and written to ``DIR/guard.json``. ``--shapes``: the planner's profile from shapes only.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.harness.job import load_benchmark_spec
from benchmarks.reports.tables import write_json
from shared_configs.cli import cli_errors, config_help
from shared_configs.planning.pipeline import Workload, predict_policy
from shared_configs.sizes import MIB
from shared_configs.spec import UNetSpec


def sizes(work: Workload) -> tuple[int, int]:
    """(budget, extra): 60% of the way from `full`'s predicted peak to `none`'s; a quarter of that gap."""
    none, full = (predict_policy(work, p)[0].prediction.peak_bytes for p in ("none", "full"))
    return full + 6 * (none - full) // 10, (none - full) // 4


def guarded_run(spec: UNetSpec, batch_size: int, steps: int, device: str, shapes: bool = False) -> dict[str, Any]:
    """Train ``spec`` for ``steps`` guarded steps holding the extra buffer; the budget, extra and history."""
    import torch
    import torch.nn.functional as F

    from shared_configs.training.data import example_batch
    from torch_impl import BudgetGuard, UNet
    from torch_impl.step import as_tensors

    work = Workload.of(spec, batch_size=batch_size, shapes=shapes)
    budget, extra = sizes(work)
    model = UNet(spec).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0)
    noisy, t, noise, cond = as_tensors(example_batch(spec, batch_size, work.context_length, seed=0))
    inputs = {k: v.to(device) for k, v in {"x": noisy, "t": t, **cond}.items() if v is not None}
    noise = noise.to(device)

    def step(hold: int) -> float:
        """The user's step: it holds ``hold`` bytes (a teacher's features, say) all step long."""
        optimizer.zero_grad(set_to_none=True)
        held = torch.zeros(hold // 4, device=device)  # noqa: F841 (alive until the step returns)
        loss = F.mse_loss(model(**inputs), noise)
        loss.backward()
        optimizer.step()
        return loss.item()

    step(0)  # a warm-up, as the planner's profile has: AdamW's state exists from here on
    guard = BudgetGuard(model, budget, batch_size=batch_size, shapes=shapes)
    for _ in range(steps):
        guard.run(step, extra)
    return {
        "spec": spec.name,
        "batch_size": batch_size,
        "device": device,
        "budget": budget,
        "extra": extra,
        "plan": guard.plan,
        "history": [asdict(r) for r in guard.history],
    }


def lines(doc: dict[str, Any]) -> list[str]:
    """One line per record: step, action, plan, predicted, measured, outside (MiB)."""
    mib = lambda b: "-" if b is None else f"{b / MIB:.1f}"  # noqa: E731
    head = (
        f"{doc['spec']} batch {doc['batch_size']} on {doc['device']}: budget {mib(doc['budget'])} MiB, "
        f"extra buffer {mib(doc['extra'])} MiB"
    )
    return [
        head,
        *(
            f"step {r['step']}: {r['action']:<14} predicted {mib(r['predicted'])} measured "
            f"{mib(r['measured'])} outside {mib(r['outside'])} MiB  {r['plan'][:60]}"
            for r in doc["history"]
        ),
    ]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.guard_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="sd15", help=config_help("sd15"))
    p.add_argument("--sample-size", type=int, default=None, help="the spec's sample size (its own)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="guarded steps (%(default)s)")
    p.add_argument("--device", default="cuda", help="cuda or cpu (%(default)s)")
    p.add_argument("--shapes", action="store_true", help="the planner's profile from shapes only")
    p.add_argument("--out", type=Path, required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with cli_errors("benchmarks.guard_check"):
        spec = load_benchmark_spec(args.config, args.sample_size)
        doc = guarded_run(spec, args.batch_size, args.steps, args.device, args.shapes)
        print("\n".join(lines(doc)))
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / "guard.json", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
