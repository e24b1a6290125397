"""Findings of the torchrun user-journey hunt (2 CPU ranks, gloo, `torchrun -m recurrent_depth.cli ...`): each test is
the regression of one bug."""

from __future__ import annotations

import signal

import pytest

import recurrent_depth.cli.train as train_cli
from recurrent_depth.cli import main
from recurrent_depth.train.trainer import TrainingInterrupted

STOPPED = "SIGTERM (preempted): stopped after step 8; checkpoint runs/x/checkpoints/step-00000008 is saved: continue " \
          "with --resume"


@pytest.mark.parametrize(("rank", "said"), [(None, True), ("0", True), ("1", False)])
def test_a_preempted_run_under_torchrun_says_so_once_on_rank_0(monkeypatch, capsys, rank, said):
    """SIGTERM to the torchrun launcher (what SLURM sends) stopped every rank after the same step, and each rank
    printed the same `interrupted: ... checkpoint ... is saved` line (8 GPUs: 8 lines), where the run's other lines
    are rank 0's alone. Now rank 0 says it; every rank still exits 143."""
    def preempted(args) -> int:  # (the trainer's agreed stop, as every rank raises it)
        raise TrainingInterrupted(STOPPED, signal.SIGTERM)

    monkeypatch.setattr(train_cli, "run", preempted)
    if rank is None:
        monkeypatch.delenv("RANK", raising=False)  # (one process, no torchrun)
    else:
        monkeypatch.setenv("RANK", rank)
    assert main(["train", "--threads", "1"]) == 143
    err = capsys.readouterr().err
    assert err.count("interrupted") == int(said)
    if said:
        assert err.strip().splitlines()[-1] == f"rdepth train: interrupted: {STOPPED}"


def test_a_bare_ctrl_c_is_still_said_on_every_rank(monkeypatch, capsys):
    """A KeyboardInterrupt that is not the trainer's agreed stop (Ctrl-C in a rank's setup) is that rank's own."""
    def ctrl_c(args) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(train_cli, "run", ctrl_c)
    monkeypatch.setenv("RANK", "1")
    assert main(["train", "--threads", "1"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "rdepth train: interrupted"
