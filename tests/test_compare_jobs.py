"""``benchmarks.compare``'s flags become typed jobs in one place (`parse_args`), --controlnet's too:
its refusals are one line there, before anything is measured. No framework import."""

from __future__ import annotations

import pytest

from benchmarks import compare
from shared_configs import SpecError


def jobs(*argv: str) -> list:
    return compare.parse_args(["--config", "tiny", *argv])[1]


def test_controlnet_jobs_carry_the_pair_workload() -> None:
    made = jobs("--controlnet", "--policies", "full,controlnet.mid+up.0")
    assert [j.framework for j in made] == ["torch", "jax"]
    for job in made:
        assert job.policies == ("none", "full", "controlnet.mid,up.0")
        assert job.batch_sizes == (compare.DEFAULT_BATCH_SIZES[0],)  # the pair's default, whatever the preset
        assert job.attention_chunk == "auto"  # the pair's one workload carries it, torch's job too


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--world-size", "2"], "--controlnet: measures the torch and jax steps in one CPU process each"),
        (["--batch-size", "2", "4"], "--controlnet: one --batch-size at a time"),
        (["--policies", "controlnet.up.0"], "controlnet.up.0"),
    ],
)
def test_controlnet_refusals_come_from_parse_args(argv: list[str], message: str) -> None:
    with pytest.raises(SpecError, match=message.replace(".", r"\.").replace("-", r"\-")):
        jobs("--controlnet", *argv)


def test_plan_budget_needs_controlnet() -> None:
    with pytest.raises(SpecError, match="only with --controlnet"):
        jobs("--plan-budget-mib", "100")
