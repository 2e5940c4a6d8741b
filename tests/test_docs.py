"""The manual holds together: every relative link in README.md and docs/*.md reaches a file (and a
heading, when it names one), and no doc or module speaks of how the project is developed (numbered
stops, working sessions): a reader has no use for either. Reads files only; no framework import."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = ("shared_configs", "torch_impl", "jax_impl", "benchmarks", "tests")
SOURCE_SUFFIXES = (".py", ".md", ".yaml")
PLANNING_MAX_CHARS = 15_000  # the planning page is a manual, not a log of reruns

FENCE = re.compile(r"^(`{3,}|~{3,}).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...
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


def test_planning_page_is_a_manual_not_a_log() -> None:
    assert len((ROOT / "docs" / "planning.md").read_text(encoding="utf-8")) < PLANNING_MAX_CHARS
