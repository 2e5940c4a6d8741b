"""The planner's profile cache, shared by every run on the machine: entries written whole (with the
SHA-256 of their body) and checked on read. A truncated, damaged, other-schema or other-workload
entry is profiled again after a one-line note, never a traceback; processes filling one entry take
turns, and the later ones read what the first wrote."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from jax_impl.memory import MemoryPlan, _read, _write
from shared_configs import load_spec
from shared_configs.planning import pipeline
from shared_configs.planning.budget import SCHEMA, Profile
from shared_configs.planning.pipeline import CACHE_ENV, Workload, get_profile, profile_path
from tests.helpers.specs import random_profile

WORKLOAD = Workload.of("tiny", batch_size=2)
GOOD = random_profile(load_spec("tiny"), 0, framework="torch")  # tiny at batch 2, as WORKLOAD


def damage(path: Path, fault: str) -> None:
    """Apply ``fault`` to the cached profile ``path``."""
    text = path.read_text()
    if fault == "truncated":
        path.write_text(text[: len(text) // 2])
    elif fault == "empty":
        path.write_text("")
    elif fault == "edited":  # valid JSON, one figure changed: only the SHA-256 tells
        data = json.loads(text)
        data["opt_peak"] += 1
        path.write_text(json.dumps(data))
    elif fault == "other_schema":  # as an earlier version wrote it: no checksum
        data = {k: v for k, v in json.loads(text).items() if k != "sha256"}
        path.write_text(json.dumps({**data, "schema": 2}))
    elif fault == "other_workload":
        dataclasses.replace(GOOD, batch_size=4).save(path)
    elif fault == "not_a_profile":
        path.write_text(json.dumps(["a", "list"]))


NOTES = {
    "truncated": "unreadable (",  # where the JSON breaks off decides the parser's words
    "empty": "unreadable (Expecting value",
    "edited": "damaged (its contents do not match its own SHA-256)",
    "other_schema": f"profile schema 2, this version reads {SCHEMA}",
    "other_workload": "the profile of another workload: batch_size 4 (wanted 2)",
    "not_a_profile": "unreadable (not a JSON object)",
}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """An empty profile cache; profiling stands in for a measurement: it returns `GOOD` and counts."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    made: list[str] = []

    def measure(framework: str, *args: Any) -> Profile:
        made.append(framework)
        return GOOD

    monkeypatch.setattr(pipeline, "_measure_profile", measure)
    return made


@pytest.mark.parametrize("fault", list(NOTES))
def test_an_unusable_cache_entry_is_profiled_again_after_a_one_line_note(fault: str, cache: list[str], capsys) -> None:
    path = profile_path("torch", WORKLOAD)
    assert get_profile("torch", WORKLOAD) == GOOD and cache == ["torch"]  # measured and cached
    assert get_profile("torch", WORKLOAD) == GOOD and cache == ["torch"]  # read back
    damage(path, fault)
    capsys.readouterr()
    assert get_profile("torch", WORKLOAD) == GOOD and cache == ["torch", "torch"]
    note = capsys.readouterr().err
    assert note.startswith(f"note: {path}: ") and note.endswith("; profiling again\n") and note.count("\n") == 1, note
    assert NOTES[fault] in note, note
    assert Profile.load(path) == GOOD  # replaced by a good one
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, f"{path.name}.lock"]  # no temp file


FILL = """
import sys, time
from pathlib import Path
from shared_configs import load_spec
from shared_configs.planning.budget import cached_profile
from tests.helpers.specs import random_profile
path, log = Path(sys.argv[1]), Path(sys.argv[2])

def make():
    with log.open("a") as f:
        f.write("made\\n")
    time.sleep(1.0)  # a profile takes minutes: the other process arrives meanwhile
    return random_profile(load_spec("tiny"), 0, framework="torch")

profile = cached_profile(path, {"batch_size": 2}, make)
print(profile.opt_peak, profile.units["mid"]["full"].keep)
"""


@pytest.mark.slow
def test_two_processes_filling_one_entry_at_once_both_get_it_and_it_is_made_once(tmp_path: Path) -> None:
    path, log = tmp_path / "cache" / "tiny-torch-0123.json", tmp_path / "log"
    root = Path(__file__).parents[1]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", FILL, str(path), str(log)],
            cwd=root,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    want = f"{GOOD.opt_peak} {GOOD.units['mid']['full'].keep}\n"
    assert [out for out, _ in results] == [want, want]
    assert log.read_text() == "made\n"  # the second waited and read the first one's entry
    assert sum("note: waiting for another process filling" in err for _, err in results) == 1
    assert Profile.load(path) == GOOD


def test_an_unreadable_xla_memory_cache_entry_is_compiled_again(tmp_path: Path, capsys) -> None:
    plan = MemoryPlan(peak=1, parts={"a": 1}, fragmentation=0, live_peak=1, xla_live_peak=1, timeline={})
    _write(str(tmp_path), "k", plan)
    assert _read(str(tmp_path), "k") == plan
    path = tmp_path / "xla-memory" / "k.json"
    path.write_text(path.read_text()[:20])
    assert _read(str(tmp_path), "k") is None
    assert capsys.readouterr().err == f"note: {path}: unreadable cache entry (JSONDecodeError); compiling again\n"
