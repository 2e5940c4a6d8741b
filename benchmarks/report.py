"""Reprint a saved `benchmarks.compare` (or `max_batch`) run: its table, the lines under it, and with
--plots its pictures again.

    python -m benchmarks.report results/compare-sd_narrow-20261203-190000.json
    python -m benchmarks.report RUN.json --wide                # every column
    python -m benchmarks.report RUN.json --plots results/      # the PNGs again, into that folder

The table and lines are `benchmarks.reports.tables`'s, the pictures `benchmarks.reports.plot`'s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.harness import compiled
from benchmarks.reports import plot, tables
from shared_configs import SpecError
from shared_configs.cli import OneLineParser, check_out_dir, cli_errors

WIDE_HELP = (
    "print every column (the peak's parts, step seconds with their spread, compile seconds, FLOPs); the default "
    "table fits 100 columns: peak, saving, activations, step-time ratio, fits. The JSON and CSV keep every column"
)
WIDE_WIDTH = 240  # the wide table's natural width, whatever the terminal's


def console_for(wide: bool) -> Console:
    """The terminal's width (or $COLUMNS); 100 when neither is known (a pipe, a log); wide: room for every column."""
    if wide:
        return Console(width=WIDE_WIDTH)
    return Console() if sys.stdout.isatty() or "COLUMNS" in os.environ else Console(width=100)


def show(console: Console, document: dict[str, Any], wide: bool = False) -> None:
    """A run as `benchmarks.compare` prints it: the table, the failed rows, and the lines under it."""
    unreliable = tables.unreliable_share(document) is not None  # its ratios marked "?"
    console.print(tables.table(document["rows"], tables.title(document), wide, unreliable))
    if document.get("incomplete"):
        console.print(f"[bold yellow]incomplete: {document['incomplete']}[/]")
    for line in (
        ([] if wide else tables.errors(document["rows"]))
        + tables.notes(document)
        + compiled.comparison(document["rows"])
    ):
        console.print(line, highlight=False)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m benchmarks.report", description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, metavar="RUN.json", help="a JSON file benchmarks.compare or max_batch wrote")
    p.add_argument("--wide", action="store_true", help=WIDE_HELP)
    p.add_argument("--plots", type=Path, metavar="DIR", help="also draw the run's pictures again, into DIR")
    return p


def load(path: Path) -> dict[str, Any]:
    """The run's document; SpecError naming the file when it is not one."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(f"RUN.json: no such file: {path}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecError(f"RUN.json: {path} is not a JSON file ({e})") from None
    if not isinstance(document, dict) or not isinstance(document.get("rows"), list) or "settings" not in document:
        raise SpecError(f"RUN.json: {path} is not a benchmarks.compare run (no 'rows' and 'settings')")
    document["rows"] = tables.complete(document["rows"])  # older runs lack columns added since
    return document


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    with cli_errors("benchmarks.report"):
        document = load(args.run)
        console = console_for(args.wide)
        show(console, document, args.wide)
        if args.plots is not None:
            check_out_dir(args.plots, "--plots")
            for path in plot.write_plots(document, args.plots, args.run.stem):
                console.print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
