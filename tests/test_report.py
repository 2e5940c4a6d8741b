"""A run's table for people and its reprint: `benchmarks.compare`'s default table fits 100 columns with
no cell cut, --wide keeps every column, `python -m benchmarks.report RUN.json` reprints a saved run
(and its plots), and the Pareto plot marks unreliable timings, keeps labels apart and puts in its
legend only what it draws. Reads a committed default run (docs/data/default, 2026-12-03's); nothing is measured."""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pytest
from rich.console import Console

from benchmarks import report as cli
from benchmarks.reports import plot, tables

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RUN = ROOT / "docs" / "data" / "default" / "compare-sd_narrow-20261203.json"  # its times judged unreliable
FSDP_RUN = ROOT / "docs" / "data" / "fsdp" / "compare-sd_narrow-jax-n2.json"
LONG_POLICY = "down.1.attentions.0+down.2+mid+up.0.resnets.1/save=conv+matmul"


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """The default run, saved as compare writes it, with a long plan, an OOM row and an error row added."""
    doc = json.loads(DEFAULT_RUN.read_text())
    extra = copy.deepcopy(doc["rows"][1]) | {"policy": LONG_POLICY, "peak_bytes": 123_456_789_012}
    oom = copy.deepcopy(doc["rows"][1]) | {"policy": "layers", "batch_size": 64, "status": "oom", "error": "OOM"}
    error = copy.deepcopy(oom) | {"status": "error", "error": "RuntimeError: " + "a long message " * 12}
    doc["rows"] = tables.complete([*doc["rows"], extra, oom, error])
    path = tmp_path / "compare-sd_narrow-20261203-120000.json"
    tables.write_json(path, doc)
    return path


def printed(document: dict[str, Any], width: int, wide: bool = False) -> str:
    out = io.StringIO()
    cli.show(Console(file=out, width=width), document, wide)
    return out.getvalue()


def table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line[:1] in "┏┃┡│└"]


@pytest.mark.parametrize("source", [DEFAULT_RUN, FSDP_RUN], ids=["default", "fsdp"])
def test_the_default_table_fits_100_columns_with_no_cell_cut(source: Path, run: Path) -> None:
    document = cli.load(run if source == DEFAULT_RUN else source)
    lines = table_lines(printed(document, 100))
    assert lines and max(len(line) for line in lines) <= 100
    body = "\n".join(lines)
    assert "…" not in body
    for row in document["rows"]:
        if row["status"] == "ok":
            assert f"{row['peak_bytes'] / 2**20:,.1f}" in body
    policy_column = "".join(line.split("│")[2].strip() for line in lines if line.startswith("│"))
    assert (LONG_POLICY in policy_column) == (source == DEFAULT_RUN)  # folded over lines, never cut
    for header in ("peak", "MiB", "saved", "vs none", "fits"):
        assert header in body


def test_the_default_table_says_saved_ratio_and_whether_it_fits(run: Path) -> None:
    text = printed(cli.load(run), 100)
    full = next(line for line in table_lines(text) if "torch" in line and " full " in line)
    cells = [c.strip() for c in full.strip("│").split("│")]
    assert cells == ["torch", "full", "8", "91.4", "39%", "40.9", "0.54x ?", "yes"]  # the run judged times unreliable
    assert any("OOM" in line for line in table_lines(text))
    assert "layers @ batch 64: error" in text and "a long message" in text  # the error in full, under the table


def test_wide_keeps_every_column(run: Path) -> None:
    text = printed(cli.load(run), cli.WIDE_WIDTH, wide=True)
    header = "".join(table_lines(text)[:4])
    for name, _ in tables.COLUMNS_SHOWN[:-1]:  # the last is XLA's default peak, only with --xla-default
        assert name.replace("\\", "") in header, name
    assert "5.587 [4.909-8.366]" in text


def test_report_reprints_a_saved_run_and_its_plots(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    assert cli.main([str(run), "--plots", str(tmp_path / "again")]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in table_lines(out)) <= 100 and "…" not in "".join(table_lines(out))
    assert "91.4" in out and "other processes used 66% of the cores" in out
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == [f"{run.stem}.png"]


@pytest.mark.parametrize(
    ("content", "match"),
    [(None, "no such file"), ("{not json", "is not a JSON file"), ('{"rows": 3}', "is not a benchmarks.compare run")],
)
def test_a_bad_run_file_is_one_line(
    content: str | None, match: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_:
        cli.main([str(path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and match in err and len(err.strip().splitlines()) == 1


def _panel(rows: list[dict[str, Any]], unreliable: float | None) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4.5))
    plot._panel(ax, rows, 8, unreliable)
    fig.canvas.draw()
    return fig, ax


def test_plot_labels_do_not_overlap_and_the_legend_shows_only_what_is_drawn() -> None:
    rows = tables.complete(json.loads(DEFAULT_RUN.read_text())["rows"])
    jax_none = next(r for r in rows if r["framework"] == "jax" and r["policy"] == "none")
    torch_rows = [r | {"time_overhead": t} for r, t in zip(rows[:3], (1.0, 1.13, 1.21), strict=True)]  # README's
    rows = [*torch_rows, jax_none]  # jax: one point, no front to draw
    fig, ax = _panel(rows, None)
    boxes = [t.get_window_extent() for t in ax.texts]
    assert len(boxes) == 4  # torch none, full, layers and jax none (both "none" at 1.0x, 0%)
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["jax", "torch", "torch Pareto front"]
    plt.close(fig)


def test_plot_marks_timings_the_run_judged_unreliable() -> None:
    rows = tables.complete(json.loads(DEFAULT_RUN.read_text())["rows"])
    for share, hollow in ((None, False), (0.66, True)):
        fig, ax = _panel(rows, share)
        faces = [c.get_facecolors() for c in ax.collections if len(c.get_offsets())]
        assert all(len(f) == 0 or f[0][3] == 0 for f in faces) == hollow
        assert any("unreliable" in t.get_text() and "66%" in t.get_text() for t in ax.texts) == hollow
        plt.close(fig)
