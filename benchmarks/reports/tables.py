"""Rows into results: derived columns, the JSON/CSV files (written atomically), the rich tables (the
compact one a person reads at 100 columns, and the wide one with every figure) and the lines under them.
Printed by `benchmarks.compare` and reprinted from a saved run by `benchmarks.report`."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterable
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

from rich.table import Table

from shared_configs.defaults import Defaults, resolve_chunk
from shared_configs.files import atomic_write
from shared_configs.regime import DEFAULT, Regime
from shared_configs.sizes import MIB

Row = dict[str, Any]
UNRELIABLE_SHARE = 0.1  # other processes' share of the cores above which a run's times are not trusted

# Every row has every column (None where it does not apply); CSV columns follow this order.
# The peak's parts (f"{kind}_bytes" for kind in shared_configs.memory.CATEGORIES) add up to peak_bytes.
COLUMNS: tuple[str, ...] = (
    "framework",
    "policy",
    "batch_size",
    "world_size",
    "status",
    "peak_bytes",
    "max_rank_peak_bytes",
    "params_bytes",
    "optimizer_bytes",
    "grads_bytes",
    "input_bytes",
    "activation_bytes",
    "temporary_bytes",
    "static_bytes",
    "saved_bytes",
    "peak_reduction",
    "activation_reduction",
    "saved_reduction",
    "step_time_s",
    "step_time_min_s",
    "step_time_max_s",
    "time_overhead",
    "compile_s",
    "activation_memory_budget",
    "first_step_s",
    "flops",
    "recompute_flops",
    "flops_ratio",
    "memtracker_peak_bytes",
    "tracker_peak_bytes",
    "allocator_peak_bytes",
    "compiled_peak_bytes",
    "fragmentation_bytes",
    "live_peak_bytes",
    "xla_live_peak_bytes",
    "xla_default_peak_bytes",
    "xla_default_peak_reduction",
    "param_count",
    "peak_method",
    "saved_method",
    "flops_method",
    "check_method",
    "xla_default_method",
    "error",
)
# (column, column it is compared with, kind): reductions are 1 - x / x_none, ratios x / x_none.
RELATIVE: tuple[tuple[str, str, str], ...] = (
    ("peak_reduction", "peak_bytes", "reduction"),
    ("activation_reduction", "activation_bytes", "reduction"),
    ("saved_reduction", "saved_bytes", "reduction"),
    ("xla_default_peak_reduction", "xla_default_peak_bytes", "reduction"),
    ("time_overhead", "step_time_s", "ratio"),
    ("flops_ratio", "flops", "ratio"),
    ("recompute_flops", "flops", "difference"),
)
# A row's method columns, by the names the lines under the table give them.
METHODS = {
    "peak_method": "peak",
    "saved_method": "saved",
    "flops_method": "FLOPs",
    "check_method": "check",
    "xla_default_method": "XLA:CPU default",
}


def complete(rows: Iterable[Row]) -> list[Row]:
    """Rows with every column, and the columns measured against policy ``none`` filled in."""
    out = [{col: row.get(col) for col in COLUMNS} for row in rows]
    baselines = {(r["framework"], r["batch_size"]): r for r in out if r["policy"] == "none" and r["status"] == "ok"}
    for row in out:
        base = baselines.get((row["framework"], row["batch_size"])) or {}
        row |= {col: _relative(row.get(source), base.get(source), kind) for col, source, kind in RELATIVE}
    return out


def _relative(value: float | None, base: float | None, kind: str) -> float | None:
    if value is None or base is None:
        return None
    if kind == "difference":
        return value - base
    if base <= 0 or value < 0:
        return None
    return 1.0 - value / base if kind == "reduction" else value / base


def write_json(path: Path, document: dict[str, Any]) -> None:
    atomic_write(path, json.dumps(document, indent=2, allow_nan=False).encode())


def write_csv(path: Path, rows: list[Row]) -> None:
    writer = csv.DictWriter(text := io.StringIO(newline=""), fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(path, text.getvalue().encode())


def markdown_table(rows: list[list[str]]) -> str:
    """A Markdown table: the first row is its head."""
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join([lines[0], "|" + "---|" * len(rows[0]), *lines[1:]])


def mib(value: int | None) -> str:
    """Bytes in MiB for a table's cell; "-" where there is no figure."""
    return "-" if value is None else f"{value / MIB:,.1f}"


def _cell_bytes(row: Row, col: str, rel: str) -> str:
    """MiB, and the change against none beside it."""
    change = None if row["policy"] == "none" else row[rel]
    return mib(row[col]) + ("" if change is None else f" ({-change:+.0%})")


COLUMNS_SHOWN: tuple[tuple[str, Callable[[Row], str]], ...] = (
    ("framework", lambda r: r["framework"]),
    ("policy", lambda r: r["policy"]),
    ("batch", lambda r: str(r["batch_size"])),
    ("peak MiB", lambda r: _cell_bytes(r, "peak_bytes", "peak_reduction")),
    ("= params", lambda r: mib(r["params_bytes"])),
    ("+ opt state", lambda r: mib(r["optimizer_bytes"])),
    ("+ grads", lambda r: mib(r["grads_bytes"])),
    ("+ inputs", lambda r: mib(r["input_bytes"])),
    ("+ activations", lambda r: _cell_bytes(r, "activation_bytes", "activation_reduction")),
    ("+ temps", lambda r: mib(r["temporary_bytes"])),
    (
        r"step s: median \[min-max]",
        lambda r: (
            "-"
            if r["step_time_s"] is None
            else f"{r['step_time_s']:.3f} [{r['step_time_min_s']:.3f}-{r['step_time_max_s']:.3f}]"
        ),
    ),
    ("overhead", lambda r: "-" if r["time_overhead"] is None else f"{r['time_overhead']:.2f}x"),
    ("compile s", lambda r: "-" if r["compile_s"] is None else f"{r['compile_s']:.1f}"),
    (
        "GFLOP (+recompute)",
        lambda r: (
            "-"
            if r["flops"] is None
            else f"{r['flops'] / 1e9:.1f}"
            + (f" (+{r['recompute_flops'] / 1e9:.1f})" if r["recompute_flops"] and r["policy"] != "none" else "")
        ),
    ),
    ("XLA:CPU default peak MiB", lambda r: _cell_bytes(r, "xla_default_peak_bytes", "xla_default_peak_reduction")),
)


FITS = {"ok": "yes", "oom": "[red]OOM[/red]", "error": "[red]error[/red]"}

# The table a person reads (fits 100 columns): the peak, what checkpointing saved, the time it cost.
COMPACT: tuple[tuple[str, Callable[[Row], str]], ...] = (
    *COLUMNS_SHOWN[:3],
    ("peak\nMiB", lambda r: mib(r["peak_bytes"])),
    (
        "saved\nvs none",
        lambda r: "-" if r["policy"] == "none" or r["peak_reduction"] is None else f"{100 * r['peak_reduction']:.0f}%",
    ),
    ("activations\nMiB", lambda r: mib(r["activation_bytes"])),
)


def table(rows: list[Row], title: str, wide: bool = False, unreliable: bool = False) -> Table:
    """The terminal table (``wide``: every figure); ``unreliable`` timings mark the ratios ``?``."""
    if wide:
        xla_default = any(r["xla_default_peak_bytes"] is not None for r in rows)  # only with --xla-default
        shown = [c for c in COLUMNS_SHOWN if xla_default or c[0] != "XLA:CPU default peak MiB"]
    else:
        shown = [
            *COMPACT,
            (
                "step time\nvs none",
                lambda r: (
                    "-"
                    if r["time_overhead"] is None
                    else f"{r['time_overhead']:.2f}x" + (" ?" if unreliable and r["policy"] != "none" else "")
                ),
            ),
        ]
    if any((r["world_size"] or 1) > 1 for r in rows):  # --world-size: rank 0's peak and the largest over the ranks
        sep = " " if wide else "\n"
        shown[3:4] = [
            *([("ranks", lambda r: str(r["world_size"]))] if wide else []),
            (f"rank 0{sep}peak MiB", shown[3][1]),
            (f"max rank{sep}MiB", lambda r: mib(r["max_rank_peak_bytes"])),
        ]
    t = Table(title=title, title_justify="left", header_style="bold")
    for i, (name, _) in enumerate(shown if wide else [*shown, ("fits", None)]):
        # compact: headers break where written; only a long policy string folds onto the next line (never cut)
        t.add_column(
            name, justify="left" if i < 2 else "right", **({} if wide else {"overflow": "fold", "no_wrap": i != 1})
        )
    for row in rows:
        ok = row["status"] == "ok"
        if not wide:
            t.add_row(
                *(cell(row) if ok or i < 3 else "-" for i, (_, cell) in enumerate(shown)),
                FITS.get(row["status"], row["status"]),
            )
        elif ok:
            t.add_row(*(cell(row) for _, cell in shown))
        else:
            status = FITS["oom" if row["status"] == "oom" else "error"]
            t.add_row(row["framework"], row["policy"], str(row["batch_size"]), status, row["error"] or "")
    return t


def errors(rows: list[Row]) -> list[str]:
    """One line per failed row (the compact table says only that it failed)."""
    return [
        f"[red]{r['framework']} {r['policy']} @ batch {r['batch_size']}: {r['status']}[/red]: {r['error'] or ''}"
        for r in rows
        if r["status"] != "ok"
    ]


def regime(rows: list[Row]) -> list[str]:
    """Per framework, at none's peak: activations + temporaries against static memory."""
    return [
        f"{row['framework']} none @ batch {row['batch_size']}: activations + temps = "
        f"{(row['activation_bytes'] + row['temporary_bytes']) / row['static_bytes']:.1f}x static "
        f"(params + optimizer state, {mib(row['static_bytes'])} MiB)"
        for row in rows
        if row["policy"] == "none"
        and row["status"] == "ok"
        and row["static_bytes"]
        and row["activation_bytes"] is not None
    ]


def checks(rows: list[Row]) -> list[str]:
    """Each framework's figures against an independent count of the same step (MemTracker; XLA's own)."""
    pairs = {
        "tracker peak vs MemTracker's": ("tracker_peak_bytes", "memtracker_peak_bytes"),
        "live bytes rebuilt from XLA's dump vs XLA's own count at its peak": ("live_peak_bytes", "xla_live_peak_bytes"),
    }
    out = []
    for label, (mine, theirs) in pairs.items():
        for fw in dict.fromkeys(r["framework"] for r in rows):
            checked = [r for r in rows if r["framework"] == fw and r["status"] == "ok" and r[mine] and r[theirs]]
            if checked:
                out.append(
                    f"{fw} {label}: " + ", ".join(f"{r['policy']} {r[mine] / r[theirs] - 1:+.1%}" for r in checked)
                )
    return out


def methods(rows: list[Row]) -> dict[str, dict[str, str]]:
    """Which method produced each framework's figures (the first successful row's)."""
    out: dict[str, dict[str, str]] = {}
    for row in (r for r in rows if r["status"] == "ok" and r["framework"] not in out):
        out[row["framework"]] = {k: row[k] for k in METHODS if row[k] is not None}
    return out


def title(document: dict[str, Any]) -> str:
    s = document["settings"]
    ranks = s.get("world_size", 1)
    per_rank = f", per rank of {ranks} (FSDP; batch per rank)" if ranks > 1 else ""
    return (
        f"{document['config']['name']} @ {s['sample_size']}x{s['sample_size']}, {document['dtype']}{per_rank}, "
        f"{s['steps']} timed steps after warm-up, git {(document['git_sha'] or '?')[:12]}"
    )


def used(document: dict[str, Any]) -> str:
    """The settings this run used, as `shared_configs.defaults.Defaults.describe` writes them."""
    s, devices = document["settings"], document["device"]
    kind = devices.get("jax", next((d for fw, d in devices.items() if fw != "requested"), {"kind": "cpu"}))["kind"]
    # older documents lack some of the regime's fields; the oldest lack it all, and give the dtype
    regime = (
        Regime(**{f.name: s[f.name] for f in dataclass_fields(Regime) if f.name in s}) if "precision" in s else DEFAULT
    )
    fields = {k: s[k] for k in ("context_length", "steps", "jax_cache", "dtype") if k in s}
    if "precision" in s:  # the forward's dtype, from the regime
        fields["dtype"] = regime.compute_dtype or "float32"
    line = "settings " + Defaults(kind, resolve_chunk(s["attention_chunk"], kind), **fields).describe()
    if regime != DEFAULT:
        line += "; regime " + regime.describe()
    return line


def unreliable_share(document: dict[str, Any]) -> float | None:
    """Other processes' share of the cores, when over `UNRELIABLE_SHARE`; else None."""
    share = document.get("other_cpu_share")
    return share if share is not None and share > UNRELIABLE_SHARE else None


def notes(document: dict[str, Any]) -> list[str]:
    """Lines under the table: devices, versions, and which method produced each figure."""
    lines = [
        "devices: "
        + ", ".join(f"{fw}: {d['kind']} ({d['name']})" for fw, d in document["device"].items() if fw != "requested"),
        "versions: " + ", ".join(f"{k} {v}" for k, v in document["versions"].items()),
        "wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in document["wall_s"].items()),
        used(document),
    ]
    if (share := unreliable_share(document)) is not None:
        lines.append(
            f"[bold red]warning: other processes used {share:.0%} of the cores during the run: "
            "step times and ratios are unreliable[/]"
        )
    for fw, found in document["methods"].items():
        lines += [f"{fw} {METHODS[k]}: {v}" for k, v in found.items()]
    lines += regime(document["rows"]) + checks(document["rows"])
    return [
        *lines,
        "peak = params + opt state + grads + inputs + activations + temps, all at the peak's moment; "
        "(+/-%) = change against policy none, same framework and run",
    ]
