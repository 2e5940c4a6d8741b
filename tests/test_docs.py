"""The manual holds together: every relative link in README.md and docs/*.md reaches a file (and a
heading, when it names one), every module, name and repository path it quotes exists, the README
stays short, and no doc or module speaks of how the project is developed (numbered stops, working
sessions): a reader has no use for either. Reads files only; no framework import."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = ("shared_configs", "torch_impl", "jax_impl", "benchmarks", "tests")
SOURCE_SUFFIXES = (".py", ".md", ".yaml")
README_MAX_CHARS = 7_000  # the front page: what it is, how to start, where to read on

FENCE = re.compile(r"^(`{3,}|~{3,}).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...
# A module path (``torch_impl.profile.memory_run``) and a repository path (``benchmarks/harness/runner.py``,
# ``torch_impl/memory.py:StepTracker``, ``tests/test_plan_*.py``) as docs quote them in code.
MODULE = re.compile(r"(?<![\w./-])(?:shared_configs|torch_impl|jax_impl|benchmarks|tests)(?:\.\w+)+")
REPO_PATH = re.compile(
    r"(?<![\w./-])(?:shared_configs|torch_impl|jax_impl|benchmarks|tests|docs|\.ci)/[\w./*-]*(?::\w+)?"
)
PLACEHOLDER = re.compile(r"\b[A-Z]{3,}\b")  # docs/data/candidates/SPEC.yaml: a name to fill in
# "stop" and a number (after a space or "-"), and the word for a sitting, except pytest's fixture scope
PROCESS_WORDS = re.compile(r"\b[Ss]top[ -]\d+|(?<!scope=\")\b[Ss]ession\b")


def prose(markdown: str) -> str:
    """The text outside fenced blocks and code spans: where a link is a link."""
    return CODE_SPAN.sub("", FENCE.sub("", markdown))


def relative_links(markdown: str) -> list[str]:
    """Link targets that are not URLs (e.g. ``docs/planning.md``, ``benchmark.md#time``, ``#time``)."""
    return [t for t in LINK.findall(prose(markdown)) if not SCHEME.match(t)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-``/``_`` dropped, spaces -> ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", markdown)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(doc: Path) -> list[str]:
    bad = []
    for target in relative_links(doc.read_text(encoding="utf-8")):
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            bad.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text(encoding="utf-8")):
            bad.append(f"{target}: no heading #{anchor} in {file.relative_to(ROOT)}")
    return bad


def test_the_checks_see_what_they_check() -> None:
    text = "see [a](a.md), [b](https://x.org/b.md) and ![c](img/c.png#top)\n```\n[d](d.md)\n```\n`[e](e.md)`"
    assert relative_links(text) == ["a.md", "img/c.png#top"]
    assert slug("Per rank under FSDP: `--world-size N`") == "per-rank-under-fsdp---world-size-n"
    assert anchors("# Time\n## Time\n```\n# not a heading\n```") == {"time", "time-1"}
    stop, sitting = "st" + "op", "sess" + "ion"  # built, so that this file passes its own check
    caught = [f"as at {stop} 20", f"{stop.title()}-3 said", f"in this {sitting}", f"{sitting.title()} note"]
    assert all(PROCESS_WORDS.search(t) for t in caught)
    kept = [f'scope="{sitting}"', f"start_new_{sitting}", f"{stop}s 3 times"]
    assert not any(PROCESS_WORDS.search(t) for t in kept)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    assert broken_links(doc) == []


def sources() -> list[Path]:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*")) if p.suffix in SOURCE_SUFFIXES]
    return DOCS + [p for p in files if "__pycache__" not in p.parts]


def test_no_development_process_words() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sources()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if PROCESS_WORDS.search(line)
    ]
    assert found == []


DOC_PAGE = re.compile(r"\bdocs/[A-Za-z0-9_]+\.md\b")


def test_pages_the_code_names_exist() -> None:
    """A module that points its reader to a page of the manual points to one that is there."""
    missing = [
        f"{path.relative_to(ROOT)}: {page}"
        for path in sources()
        if path.suffix == ".py"
        for page in sorted(set(DOC_PAGE.findall(path.read_text(encoding="utf-8"))))
        if not (ROOT / page).is_file()
    ]
    assert missing == []


def test_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text(encoding="utf-8")) <= README_MAX_CHARS


SETUP = (
    'pip install "torch==2.13.0" -e ".[dev]" && python -m benchmarks.compare --framework both',
    "python -m pytest -n 2",
)


def test_readme_setup_is_what_ci_runs() -> None:
    """The README's two set-up commands, verbatim in one block; CI runs the second as its last step."""
    blocks = [m.group(0).splitlines() for m in FENCE.finditer((ROOT / "README.md").read_text(encoding="utf-8"))]
    assert any(list(SETUP) == [line.strip() for line in block[1:-1]] for block in blocks)
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines() if line.strip()]
    assert ci[-1] == SETUP[1]


def code(markdown: str) -> str:
    """The fenced blocks and code spans: where docs quote modules and paths."""
    fenced = [m.group(0) for m in FENCE.finditer(markdown)]
    return "\n".join(fenced + CODE_SPAN.findall(FENCE.sub("", markdown)))


@functools.cache
def defined(file: Path) -> frozenset[str]:
    """Every name a module binds (functions, classes, methods, assignments, fields, attributes set,
    imports): what ``module.name`` and ``module.Class.name`` may quote."""
    names = set()
    for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for file in (base.with_suffix(".py"), base / "__init__.py"):
        if file.is_file():
            return file
    return None


def missing_module(dotted: str) -> str | None:
    """Why ``dotted`` (a module, then names in it) does not resolve; None when it does."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if file := module_file(parts[:i]):
            break
    else:
        return f"{dotted}: no such module"
    wanted = [n for n in parts[i:] if n not in ("py", "md", "yaml", "json")]
    if gone := [n for n in wanted if n not in defined(file)]:
        return f"{dotted}: {gone[0]!r} not in {file.relative_to(ROOT)}"
    return None


def missing_path(quoted: str) -> str | None:
    """Why a quoted repository path (a glob, and ``:name`` for a name in it, may follow) does not resolve."""
    path, _, name = quoted.rstrip(".,;").partition(":")
    if PLACEHOLDER.search(path):
        return None
    found = sorted(ROOT.glob(path)) if "*" in path else [ROOT / path] if (ROOT / path).exists() else []
    if not found:
        return f"{quoted}: no such file"
    if name and not any(f.suffix == ".py" and name in defined(f) for f in found):
        return f"{quoted}: {name!r} not in {path}"
    return None


def unresolved(markdown: str) -> list[str]:
    text = code(markdown)
    bad = [missing_path(p) for p in sorted(set(REPO_PATH.findall(text)))]
    bad += [missing_module(m) for m in sorted(set(MODULE.findall(text)))]
    return [b for b in bad if b]


def test_the_reference_check_sees_what_it_checks() -> None:
    text = "`torch_impl.profile.memory_run`, `benchmarks/harness/runner.py` and\n```\npython -m benchmarks.plan\n```"
    assert unresolved(text) == []
    wrong = "`torch_impl.profile.no_such_name` `benchmarks/nowhere.py` `shared_configs.gone` `tests/test_docs.py:nope`"
    assert len(unresolved(wrong)) == 4
    assert unresolved("`docs/data/candidates/SPEC.yaml` and `tests/test_plan_*.py`") == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_quoted_modules_and_paths_exist(doc: Path) -> None:
    assert unresolved(doc.read_text(encoding="utf-8")) == []
