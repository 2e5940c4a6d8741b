"""The GPU check, one command: ``python -m benchmarks.gpu_check --out DIR``.

On a CUDA machine: the default benchmark, a planner sweep with ``--verify``, the sd15 estimates,
`torch_impl.BudgetGuard` on sd15 and sd15 measured per policy and precision, each step time-limited;
it writes ``DIR/gpu_check.md`` and ``DIR/gpu_check.json``. Without CUDA the same steps run on `tiny`.
What each step does, and how to bring the wheels a GPU machine lacks: docs/regimes.md "The GPU check".
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.reports.tables import atomic_write, write_json
from shared_configs.cli import OneLineParser, cli_errors, stopping
from shared_configs.planning.workers import REPO_ROOT, stop_group, worker_group
from shared_configs.sizes import MIB

TAIL = 6000  # characters of each step's output kept in the report


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]
    limit_s: int


# name, module, arguments, limit in seconds; OUT/name is each step's folder.
GPU_SD15 = "--config sd15 --sample-size 64 --batch-size 1 2 4 --policies layers,full --steps 3 --timeline off"
# The limits add up to 8 minutes; the guard's 70 s were taken from the others (not yet timed on a GPU).
GPU_STEPS = (
    ("compare", "benchmarks.compare", "--framework both", 105),
    # the planner's workers profile and measure on the CPU, one thread each: a small workload
    ("sweep", "benchmarks.plan", "--config tiny --sample-size 32 --batch-size 4 --verify --budgets 3 --sweep", 80),
    ("estimates", "benchmarks.estimates", "--configs sd15 --batches 1,2,4 --regimes fp32,bf16-mixed+lora:8", 130),
    # after `estimates`: its sd15 batch-1 fp32 profile from shapes is the guard's, cached
    ("guard", "benchmarks.guard_check", "--config sd15 --batch-size 1 --device cuda --shapes --steps 3", 70),
    ("measured", "benchmarks.compare", f"{GPU_SD15} --framework torch --device gpu", 50),
    ("measured_bf16", "benchmarks.compare", f"{GPU_SD15} --framework torch --device gpu --precision bf16-mixed", 45),
)
TINY = "--config tiny --batch-size 2"
CPU_STEPS = (
    ("compare", "benchmarks.compare", f"--framework both {TINY} --policies full --steps 1 --timeline off", 300),
    ("sweep", "benchmarks.plan", f"{TINY} --verify --budgets 2 --steps 1 --sweep", 400),
    (
        "estimates",
        "benchmarks.estimates",
        "--configs tiny --batches 1,2 --regimes fp32,bf16-mixed --budgets-gib 1",
        200,
    ),
    ("guard", "benchmarks.guard_check", "--config tiny --sample-size 16 --batch-size 2 --device cpu --steps 3", 300),
    ("measured", "benchmarks.compare", f"--framework torch {TINY} --policies layers --steps 1 --timeline off", 200),
)


def steps(cuda: bool, out: Path) -> list[Step]:
    """The check's commands: the GPU's (``cuda``) or the same ones on `tiny`, small, for the CPU."""
    # the sweep's folder follows its --sweep flag; the others take --out
    return [
        Step(
            name,
            [
                sys.executable,
                "-m",
                module,
                *args.split(),
                *([] if args.endswith("--sweep") else ["--out"]),
                str(out / name),
            ],
            limit,
        )
        for name, module, args, limit in (GPU_STEPS if cuda else CPU_STEPS)
    ]


def run_step(step: Step) -> dict[str, Any]:
    """Run ``step`` (stopped at its limit), its output kept."""
    start, env = time.perf_counter(), {**os.environ, "PYTHONUNBUFFERED": "1"}
    print(f"gpu_check: {step.name} (up to {step.limit_s} s): {' '.join(step.argv[2:])}", file=sys.stderr, flush=True)
    with worker_group(
        step.argv, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        try:
            output, rc = proc.communicate(timeout=step.limit_s)[0], proc.returncode
        except subprocess.TimeoutExpired:
            stop_group(proc)
            output, rc = proc.communicate()[0] + f"\n(stopped at its {step.limit_s} s limit)", None
    return {
        "name": step.name,
        "command": " ".join(step.argv[1:]),
        "rc": rc,
        "seconds": round(time.perf_counter() - start, 1),
        "output": output[-TAIL:],
    }


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# GPU check: {doc['device']}", "", f"{doc['seconds']:.0f} s in all.", ""]
    for r in doc["steps"]:
        status = "stopped at its limit" if r["rc"] is None else f"exit {r['rc']}"
        lines += [
            f"## {r['name']}: {status}, {r['seconds']:.0f} s",
            "",
            f"`python {r['command']}`",
            "",
            "```",
            r["output"].rstrip(),
            "```",
            "",
        ]
    return "\n".join(lines)


def device() -> tuple[bool, str]:
    """Whether CUDA is here, and the device in words (asked in a child: this process stays torch-free)."""
    code = (
        "import torch; ok = torch.cuda.is_available(); "
        "print(ok, torch.cuda.get_device_name(0) if ok else 'CPU', "
        "torch.cuda.get_device_properties(0).total_memory if ok else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    ok, total = out[0] == "True", int(out[-1])
    return ok, " ".join(out[1:-1]) + (f", {total / MIB / 1024:.0f} GiB" if ok else "")


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_check"), help="the folder for the report (%(default)s)")
    p.add_argument("--cpu", action="store_true", help="the small CPU version even where CUDA is present")
    args = p.parse_args(argv)
    with cli_errors("benchmarks.gpu_check"), stopping("the steps finished so far are not written"):
        cuda, name = device()
        cuda = cuda and not args.cpu
        args.out.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        results = [run_step(s) for s in steps(cuda, args.out)]
        doc = {
            "device": name if cuda else "CPU (tiny)",
            "seconds": round(time.perf_counter() - start, 1),
            "steps": results,
        }
        write_json(args.out / "gpu_check.json", doc)
        atomic_write(args.out / "gpu_check.md", markdown(doc).encode())
        failed = [r["name"] for r in results if r["rc"] != 0]
        print(f"wrote {args.out / 'gpu_check.md'}; " + (f"failed: {', '.join(failed)}" if failed else "every step ran"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
