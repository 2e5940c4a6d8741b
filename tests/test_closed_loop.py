"""`shared_configs.planning.closed_loop`: the guards' decisions on bytes alone, neither torch nor JAX.

The planner is a table of plans (policy -> predicted peak; `full` the lowest), solved as the real one
is: the plan of highest predicted peak within the budget, `Infeasible` where none fits. Properties run
on random tables and random steps (seeded): a loosened plan's prediction for the user's step never
exceeds the budget; the loop ends in a bounded number of changes when the excess moves between plans;
`full` is the last resort, never skipped.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import asdict

import pytest

from shared_configs.planning import closed_loop as cl
from shared_configs.planning.closed_loop import FULL, Action, ClosedLoop
from shared_configs.planning.solver import Infeasible

MIB = 2**20
SEEDS = range(200)


class Table:
    """A planner over fixed plans: ``plan(budget)`` the costliest-to-hold plan within it."""

    def __init__(self, peaks: dict[str, int]) -> None:
        self.peaks, self.asked = peaks, []

    def plan(self, budget: int) -> tuple[str, int]:
        self.asked.append(budget)
        fits = [(peak, p) for p, peak in self.peaks.items() if peak <= budget]
        if not fits:
            raise Infeasible(budget, min(self.peaks.values()))
        peak, policy = max(fits)
        return policy, peak

    def predict(self, policy: str) -> int:
        return self.peaks[policy]


def table(rng: random.Random, plans: int = 6) -> Table:
    """`none` the highest, `full` the lowest, the rest between (MiB-ish bytes)."""
    full, none = rng.randint(40, 60) * MIB, rng.randint(90, 120) * MIB
    middle = {f"p{i}": rng.randint(full + 1, none - 1) for i in range(plans)}
    return Table({"none": none, **middle, FULL: full})


def loop(t: Table, budget: int, lines: list[str] | None = None, **kw: object) -> ClosedLoop:
    said = lines if lines is not None else []
    return ClosedLoop(budget, t.plan, t.predict, said.append, **kw)  # type: ignore[arg-type]


PLANS = {"none": 100 * MIB, "a": 90 * MIB, "b": 80 * MIB, "c": 70 * MIB, FULL: 60 * MIB}


def test_a_window_of_measured_steps_after_each_change_then_none() -> None:
    t = Table(PLANS)
    lp = loop(t, 95 * MIB)
    assert lp.start() == "a" and lp.predicted == 90 * MIB
    for step in range(1, cl.MEASURED_STEPS + 1):
        assert lp.due
        assert lp.judge(step, 91 * MIB) is None  # within budget, not far under: kept
    assert not lp.due
    assert [r.action for r in lp.history] == ["planned", *["measured"] * cl.MEASURED_STEPS]


def test_over_budget_tightens_for_the_budget_less_the_margin_and_the_excess() -> None:
    t, lines = Table(PLANS), []
    lp = loop(t, 95 * MIB, lines)
    lp.start()
    measured = 99 * MIB  # 9 MiB held beyond the model's step
    assert lp.judge(1, measured) == "b"
    target = round(95 * MIB * (1 - cl.REPLAN_MARGIN)) - 9 * MIB
    assert t.asked[-1] == target and lp.predicted == 80 * MIB <= target
    over, change = lp.history[-2:]
    assert (over.action, over.outside, change.action, change.outside) == ("over budget", 9 * MIB, "tightened", 9 * MIB)
    assert lines == [
        f"peaked at 99.0 MiB, over the 95.0 MiB budget (predicted 90.0 MiB, 9.0 MiB held outside the model's step); "
        f"planned for {target / MIB:.1f} MiB: b (predicted 80.0 MiB)"
    ]
    assert lp.due and lp.left == cl.MEASURED_STEPS  # the new plan's window


def test_no_plan_fits_then_full_and_over_under_full_stops_measuring() -> None:
    t, lines = Table(PLANS), []
    lp = loop(t, 95 * MIB, lines)
    lp.start()
    assert lp.judge(1, 140 * MIB) == FULL  # 50 MiB outside: nothing but full is predicted to fit 43 MiB
    assert lp.judge(2, 112 * MIB) is None and not lp.due
    assert lp.plan == FULL and lines[-1].endswith(
        "under full: nothing recomputes more (52.0 MiB held outside the model's step)"
    )


def test_after_rounds_re_plans_full() -> None:
    t = Table(PLANS)
    lp = loop(t, 95 * MIB, rounds=1)
    lp.start()
    assert lp.judge(1, 99 * MIB) == "b"  # the one re-plan
    assert lp.judge(2, 96 * MIB) == FULL  # no second: full
    assert [r.action for r in lp.history if r.measured is None] == ["planned", "tightened", "tightened"]


def test_loosens_once_when_the_first_window_is_far_under() -> None:
    t, lines = Table(PLANS), []
    lp = loop(t, 75 * MIB, lines)
    assert lp.start() == "c"
    assert lp.judge(1, 60 * MIB) is None  # the window is not over yet
    assert lp.judge(2, 61 * MIB) == "b"  # 9 MiB less than predicted: room for b
    assert lines[-1].endswith("recomputes less)")
    assert lp.judge(3, 50 * MIB) is None and lp.judge(4, 50 * MIB) is None  # once only
    assert [r.action for r in lp.history].count("loosened") == 1


def test_compiles_are_judged_one_per_plan_and_never_loosened() -> None:
    lp = loop(Table(PLANS), 95 * MIB, exact=True)
    lp.start()
    assert lp.judge(0, 97 * MIB) == "b" and lp.judge(1, 50 * MIB) is None
    assert lp.history[-1].action == "fits" and not lp.due
    assert [r.action for r in cl.measured(lp.history)] == ["over budget", "fits"]


def test_a_given_plan_is_predicted_not_planned() -> None:
    t = Table(PLANS)
    lp = loop(t, 95 * MIB)
    assert lp.start("c") == "c" and lp.predicted == 70 * MIB and not t.asked
    assert (lp.history[0].action, lp.history[0].outside) == ("given", None)


def test_out_of_memory_refused_in_one_line_when_the_attempt_cannot_be_undone() -> None:
    lines: list[str] = []
    lp = loop(Table(PLANS), 95 * MIB, lines)
    lp.start()
    assert not lp.out_of_memory(3, "the optimizer step had begun", measured=99 * MIB, refusal=Action.CONSUMED)
    assert [(r.action, r.measured) for r in lp.history[-2:]] == [("out of memory", 99 * MIB), ("consumed", 99 * MIB)]
    assert lines == ["ran out of memory under a; not run again: the optimizer step had begun; re-raising"]


def test_the_record_is_plain_json() -> None:
    lp = loop(Table(PLANS), 95 * MIB)
    lp.start()
    lp.judge(1, 99 * MIB, allocated=98 * MIB)
    records = json.loads(json.dumps([asdict(r) for r in lp.history]))
    assert [r["action"] for r in records] == ["planned", "over budget", "tightened"]
    assert records[1]["allocated"] == 98 * MIB


@pytest.mark.parametrize("seed", SEEDS)
def test_a_loosened_plans_prediction_for_the_step_never_exceeds_the_budget(seed: int) -> None:
    """Whatever the step holds beyond the model's (here less: negative), the loosened plan's predicted peak
    plus that excess is within the budget, and it recomputes less than the plan it replaces."""
    rng = random.Random(seed)
    t = table(rng)
    budget = rng.randint(t.peaks[FULL], t.peaks["none"] + 20 * MIB)
    lp = loop(t, budget)
    try:
        lp.start()
    except Infeasible:
        return
    outside = -rng.randint(0, 40 * MIB)
    before = lp.predicted
    for step in (1, 2):
        lp.judge(step, lp.predicted + outside)
    loose = [r for r in lp.history if r.action == "loosened"]
    for r in loose:
        assert r.predicted + outside <= budget and r.predicted > before
    assert len(loose) <= 1


@pytest.mark.parametrize("seed", SEEDS)
def test_the_loop_ends_in_a_bounded_number_of_changes_when_the_excess_moves_between_plans(seed: int) -> None:
    """Each plan's excess is its own: mostly just enough to put it over the budget whatever was corrected for,
    else up to a quarter of the budget either way. The loop makes at most ``rounds`` + 1 tightenings and one
    loosening, then stops changing; it ends within budget or under `full`."""
    rng = random.Random(seed)
    t = table(rng)
    budget = rng.randint(t.peaks[FULL] + MIB, t.peaks["none"])
    rounds = rng.randint(0, 4)
    lp = loop(t, budget, rounds=rounds)
    lp.start()
    just_over = {p: rng.random() < 0.7 for p in t.peaks}
    excess = {
        p: budget - peak + MIB if just_over[p] else rng.randint(-budget // 4, budget // 4)
        for p, peak in t.peaks.items()
    }
    for step in range(1, 60):
        if lp.due:
            lp.judge(step, max(1, lp.predicted + excess[lp.plan]))
    actions = [r.action for r in lp.history]
    assert actions.count("tightened") <= rounds + 1 and actions.count("loosened") <= 1
    assert not lp.due  # measuring has stopped
    last = lp.history[-1]
    assert last.action in ("measured", "over budget")
    assert last.measured <= budget or lp.plan == FULL


@pytest.mark.parametrize("seed", SEEDS)
def test_full_is_the_last_resort_never_skipped(seed: int) -> None:
    """Out of memory again and again in one step: each retry recomputes more (a lower predicted peak), at most
    `OOM_HALVINGS` halfway plans, then `full`; the error is given up on only under `full`."""
    rng = random.Random(seed)
    t = table(rng, plans=rng.randint(0, 12))
    lp = loop(t, t.peaks["none"])
    lp.start()
    step, plans = rng.randint(1, 9), [lp.plan]
    while lp.out_of_memory(step):
        before = lp.predicted
        plans.append(lp.recompute_more(step))
        assert lp.predicted < before or plans[-1] == FULL
    assert plans[-1] == FULL and plans.count(FULL) == 1
    assert len(plans) <= 2 + cl.OOM_HALVINGS
    assert lp.history[-1].action == "full failed"
    # A later step starts its ladder afresh.
    lp.change(step, "none", t.peaks["none"], Action.GIVEN, None)
    assert lp.out_of_memory(step + 1)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_ranks_act_on_the_largest_vote_and_know_who_cast_it(seed: int) -> None:
    """Several processes' votes, one integer each (`ballot`): the largest, read back (`tally`), is the largest
    vote and one of the ranks that cast it; another rank's out-of-memory line names it."""
    rng = random.Random(seed)
    ranks = rng.randint(1, 64)
    votes = [rng.choice(list(cl.Vote)) for _ in range(ranks)]
    vote, who = cl.tally(max(cl.ballot(v, r, ranks) for r, v in enumerate(votes)), ranks)
    assert vote == max(votes) and votes[who] == vote
    lines: list[str] = []
    lp = loop(Table(PLANS), 95 * MIB, lines)
    lp.start()
    assert lp.out_of_memory(3, who=f"rank {who} ")
    lp.recompute_more(3, f"rank {who} ")
    assert lines[-1].startswith(f"rank {who} ran out of memory under a (predicted")


def test_the_core_imports_neither_torch_nor_jax() -> None:
    code = (
        "import sys, shared_configs.planning.closed_loop\n"
        "assert not {'torch', 'jax', 'flax'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
