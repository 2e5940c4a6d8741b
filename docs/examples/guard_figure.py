"""docs/img/guard.png: the closed loop on a real guarded torch run on this CPU.

``python docs/examples/guard_figure.py [--config tiny --sample-size 16 --batch-size 4 --steps 5]``

`benchmarks.guard_check.guarded_run` trains the spec under `torch_impl.BudgetGuard` with an extra
buffer held through each step (budget and buffer sized from `none`'s and `full`'s predicted peaks, as
tests/test_guard.py sizes them); each measured step's peak (PyTorch's MemTracker) is drawn against
the budget, each re-plan marked. The run's records go beside the figure (``guard.json``).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

from benchmarks.guard_check import guarded_run, lines
from shared_configs import load_spec, spec_from_dict
from shared_configs.files import atomic_write
from shared_configs.sizes import MIB

IMG = Path(__file__).resolve().parents[1] / "img"


def figure(doc: dict[str, Any]) -> bytes:
    """The measured peak per guarded step against the budget and the model-step prediction, re-plans marked."""
    measured = [r for r in doc["history"] if r["measured"] is not None]
    changes = [r for r in doc["history"] if r["measured"] is None and r["step"] > 0]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    ax.plot([r["step"] for r in measured], [r["measured"] / MIB for r in measured], "o-", label="measured peak")
    ax.plot(
        [r["step"] for r in measured], [r["predicted"] / MIB for r in measured], "x--", label="predicted (model's step)"
    )
    ax.axhline(doc["budget"] / MIB, color="red", label="budget")
    for r in changes:  # a change takes effect from the next step
        ax.axvline(r["step"] + 0.5, color="grey", linestyle=":")
        ax.annotate(r["action"], (r["step"] + 0.5, doc["budget"] / MIB), rotation=90, fontsize=8, va="top", ha="right")
    ax.set_xticks([r["step"] for r in measured])  # whole steps
    ax.set_xlabel("guarded step (measured ones)")
    ax.set_ylabel("MiB")
    ax.set_title(f"BudgetGuard: {doc['spec']} batch {doc['batch_size']}, extra buffer {doc['extra'] / MIB:.1f} MiB")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--sample-size", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    spec = spec_from_dict({**load_spec(args.config).model_dump(), "sample_size": args.sample_size})
    doc = guarded_run(spec, args.batch_size, args.steps, "cpu")
    print("\n".join(lines(doc)))
    atomic_write(IMG / "guard.json", json.dumps(doc, indent=2).encode())
    atomic_write(IMG / "guard.png", figure(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
