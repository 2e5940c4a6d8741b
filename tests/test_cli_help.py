"""What the commands tell a newcomer before any work: ``--config`` lists the presets in ``--help``,
and every folder a README command writes into is ignored by git. Parsers only; nothing runs."""

from __future__ import annotations

import fnmatch
import importlib
import re
import shlex
from pathlib import Path

import pytest

from shared_configs import preset_names

ROOT = Path(__file__).resolve().parents[1]
WITH_CONFIG = ["compare", "max_batch", "plan", "saved", "candidates_sweep", "guard_check"]


def parser_of(module: str):
    mod = importlib.import_module(f"benchmarks.{module}")
    return (getattr(mod, "build_parser", None) or mod.parser)()


@pytest.mark.parametrize("module", WITH_CONFIG)
def test_config_help_lists_the_presets(module: str) -> None:
    text = " ".join(parser_of(module).format_help().split())
    assert all(name in text for name in preset_names()), text


def readme_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = [ln.strip() for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M) for ln in block.splitlines()]
    commands = [part.strip() for ln in lines for part in ln.split("&&")]
    return [shlex.split(c.split("#")[0])[2:] for c in commands if c.startswith("python -m benchmarks.")]


def ignored(path: Path) -> bool:
    patterns = [p.strip() for p in (ROOT / ".gitignore").read_text().splitlines() if p.strip() and p[0] != "#"]
    top = path.parts[0] + "/" if len(path.parts) > 1 or path.suffix == "" else path.parts[0]
    return any(fnmatch.fnmatch(top, p) or fnmatch.fnmatch(path.name, p) for p in patterns)


def test_what_readme_commands_write_is_ignored_by_git() -> None:
    commands = readme_commands()
    assert len(commands) >= 4  # the check sees the README's commands
    written = []
    for argv in commands:
        args = parser_of(argv[0].removeprefix("benchmarks."))
        parsed = args.parse_args(argv[1:])
        written += [Path(getattr(parsed, k)) for k in ("out", "json", "sweep") if getattr(parsed, k, None)]
    assert written and not any(p.is_absolute() for p in written)
    assert [p for p in written if not ignored(p)] == []


@pytest.mark.parametrize(
    ("argv", "batch"),
    [([], 8), (["--config", "small"], 4), (["--config", "tiny"], 1), (["--config", "small", "--batch-size", "2"], 2)],
)
def test_compare_runs_each_preset_at_a_batch_where_checkpointing_shows(argv: list[str], batch: int) -> None:
    from benchmarks import compare

    jobs = compare.parse_args(["--framework", "torch", *argv])[1]
    assert [job.batch_sizes for job in jobs] == [(batch,)]
