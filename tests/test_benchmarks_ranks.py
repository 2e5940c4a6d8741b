"""Per-rank memory in the benchmark (``--world-size``): FSDP2 over torchrun processes in torch, the
FSDP-sharded step over forced host devices in JAX. Under FSDP each rank's static memory shrinks by
the number of ranks while its activations, for the same per-rank batch, stay.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import compare
from tests.helpers.processes import rows_of, run_compare

TINY_ROW = ["--config", "tiny", "--policies", "none", "--batch-size", "4", "--steps", "1", "--device", "cpu"]


@pytest.mark.heavy
def test_two_ranks_halve_the_static_memory_and_keep_the_activations(tmp_path: Path) -> None:
    docs = {}
    for world in (1, 2):
        args = ["--framework", "both", *TINY_ROW, "--world-size", str(world), "--timeline", "off"]
        proc, doc = run_compare(args, tmp_path / str(world))
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert doc is not None and doc["settings"]["world_size"] == world
        docs[world] = doc
    for framework in ("torch", "jax"):
        one, two = rows_of(docs[1], framework)["none"], rows_of(docs[2], framework)["none"]
        assert one["world_size"] == 1 and two["world_size"] == 2
        assert two["batch_size"] == one["batch_size"] == 4  # per rank
        # Parameters and AdamW state between steps: each rank holds its half (FSDP2 pads uneven
        # shards; JAX keeps leaves under 1,024 elements replicated).
        assert 0.45 <= two["static_bytes"] / one["static_bytes"] <= 0.6, framework
        # At the peak, rank 0 also holds the parameters its running block gathered: more than half.
        assert two["params_bytes"] < 0.8 * one["params_bytes"], framework
        assert abs(two["activation_bytes"] / one["activation_bytes"] - 1) <= 0.1, framework
        assert two["max_rank_peak_bytes"] >= two["peak_bytes"]
        parts = sum(two[k] for k in ("params_bytes", "optimizer_bytes", "grads_bytes", "input_bytes"))
        assert parts + two["activation_bytes"] + two["temporary_bytes"] == two["peak_bytes"]
    torch_two = rows_of(docs[2], "torch")["none"]
    assert abs(torch_two["tracker_peak_bytes"] / torch_two["memtracker_peak_bytes"] - 1) <= 0.05


@pytest.mark.parametrize(
    "args, message",
    [
        (["--world-size", "0"], "--world-size"),
        (["--world-size", "2", "--framework", "torch,diffusers"], "--world-size: diffusers"),
        (["--world-size", "2", "--device", "gpu"], "--world-size: ranks are CPU"),
    ],
)
def test_world_size_bad_input_is_one_line(args: list[str], message: str, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        compare.main([*args, "--config", "tiny", "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err, err
    assert not (tmp_path / "out").exists()


def test_world_size_help_says_the_batch_is_per_rank(capsys) -> None:
    with pytest.raises(SystemExit):
        compare.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--batch-size is then per rank" in text and "global batch = N x it" in text
