"""What the training CLIs show a person: every default in ``--help``, and, when stderr is not a
terminal (a log file, a pipe), the running loss every ``--log-every`` steps beside the speed line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from shared_configs.training.config import TrainConfig
from shared_configs.training.outputs import progress_bar
from tests.helpers.training import MAINS

D = TrainConfig()
SHOWN = {
    "--batch-size": D.batch_size,
    "--steps": D.steps,
    "--lr": D.lr,
    "--data": D.data,
    "--schedule": D.schedule,
    "--timesteps": D.timesteps,
    "--checkpoint-every": D.checkpoint_every,
    "--sample-steps": D.sample_steps,
    "--num-samples": D.num_samples,
    "--seed": D.seed,
    "--weight-decay": D.weight_decay,
    "--config": D.config,
    "--log-every": D.log_every,
}


def help_of(framework: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_:
        MAINS[framework](["--help"])
    assert exit_.value.code == 0
    options = capsys.readouterr().out.split("options:", 1)[1]  # after the usage lines
    return " ".join(options.split())  # argparse wraps lines: one line, single spaces


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_help_shows_every_default(framework: str, capsys: pytest.CaptureFixture[str]) -> None:
    text = help_of(framework, capsys)
    for flag, value in SHOWN.items():
        # the flag's entry runs to the next flag; its default is in it, once
        entry = re.search(rf"{flag}\b.*?(?= --[a-z]|$)", text).group(0)
        assert entry.count(f"(default: {value})") == 1, (flag, entry)
    assert f"(default: runs/{framework}_impl)" in text  # --out: each framework's own folder
    assert "(default: False)" not in text and "(default: None)" not in text  # switches, unset options: no noise


def test_the_loss_is_printed_every_n_steps_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    with progress_bar(5, 0, "torch tiny none", log_every=2) as update:
        for loss in (1.0, 0.5, 0.25, 0.125, 0.0625):
            update(loss)
    lines = capsys.readouterr().err.splitlines()
    assert lines[:3] == [
        "torch tiny none: step 2/5, loss 0.7500 (mean of the last 2)",
        "torch tiny none: step 4/5, loss 0.1875 (mean of the last 2)",
        "torch tiny none: step 5/5, loss 0.0625 (mean of the last 1)",
    ]
    assert lines[3].startswith("torch tiny none: 5 step(s)")  # the speed line still ends it


@pytest.mark.slow
def test_a_piped_training_run_logs_its_loss(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--steps", "3", "--batch-size", "2", "--sample-steps", "0", "--log-every", "2", "--out", str(tmp_path)]
    assert MAINS["torch"](args) == 0
    err = capsys.readouterr().err
    assert re.search(r"^torch tiny none: step 2/3, loss \d+\.\d{4} \(mean of the last 2\)$", err, re.M), err
    assert re.search(r"^torch tiny none: step 3/3, loss \d+\.\d{4}", err, re.M), err
