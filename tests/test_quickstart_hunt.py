"""`rdepth quickstart` as a first-time user meets it: an --out holding another run, Ctrl-C, bad values, the summary."""

import json
import os
import signal
import sys

import pytest

from recurrent_depth.cli import main
from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.quickstart import QuickstartRecipe, quickstart
from tests.train_support import VOCAB, OneThread, write_corpus

quickstart_module = sys.modules["recurrent_depth.train.quickstart"]  # the package exports a function of that name


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


@pytest.fixture
def no_tokenizer(monkeypatch):
    """Any refusal below must come before the tokenizer is trained (~40 s of work on the real corpus)."""

    def prepare_tokenizer(*_args):
        raise AssertionError("the tokenizer was trained before the refusal")

    monkeypatch.setattr(quickstart_module, "prepare_tokenizer", prepare_tokenizer)


def _tiny_recipe(corpus) -> QuickstartRecipe:
    return QuickstartRecipe(preset="tiny", data=str(corpus), vocab_size=VOCAB, seq_len=32, batch_size=4,
                            max_tokens=4 * 4 * 32, val_fraction=0.1, eval_depths=(1, 4), eval_batches=3,
                            sample_tokens=2)


def _no_plots(monkeypatch):
    from recurrent_depth.train import report

    def no_plot(_data, path, *_args):  # (matplotlib is most of a tiny run's time otherwise)
        path.write_bytes(b"\x89PNG\r\n\x1a\n")
        return path

    for name in ("plot_loss_curve", "plot_val_by_depth", "plot_depth_histogram"):
        monkeypatch.setattr(report, name, no_plot)


def test_a_quickstart_refuses_to_delete_another_runs_model_and_checkpoints(tmp_path, no_tokenizer):
    """`rdepth quickstart --out DIR` deleted DIR/model and DIR/checkpoints of a `rdepth train` run (or a user's
    report.md) without a word, where `rdepth train` itself refuses such a directory."""
    out = tmp_path / "trained"
    (out / "checkpoints" / "step-00000100").mkdir(parents=True)
    (out / "model").mkdir()
    (out / "model" / "model.safetensors").write_bytes(b"weights")
    (out / "run.json").write_text(json.dumps({"config": {"tokenizer": None, "data_dir": None}}))
    with pytest.raises(ValueError, match=rf"--out {out} holds checkpoints, model, run.json of a run that is not a "
                                         r"quickstart's, .*choose a new --out"):
        quickstart(minutes=2, out=out, threads=1, log=lambda _: None)
    assert (out / "model" / "model.safetensors").read_bytes() == b"weights"
    assert (out / "checkpoints" / "step-00000100").is_dir() and (out / "run.json").is_file()
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "report.md").write_text("my notes")
    assert main(["quickstart", "--out", str(mine), "--threads", "1"]) == 2
    assert (mine / "report.md").read_text() == "my notes"
    # an earlier quickstart's run, finished (its summary) or stopped (its run.json names out's caches), is its own
    for record in ({"summary.json": {"title": "rdepth quickstart"}},
                   {"run.json": {"config": {"tokenizer": str(tmp_path / "qs" / "tokenizer"),
                                            "data_dir": str(tmp_path / "qs" / "data")}}}):
        (tmp_path / "qs" / "model").mkdir(parents=True)
        for name, content in record.items():
            (tmp_path / "qs" / name).write_text(json.dumps(content))
        quickstart_module.clear_previous_run(tmp_path / "qs")
        assert not any((tmp_path / "qs").iterdir())


def test_bad_seed_and_out_are_refused_before_any_work(tmp_path, capsys, no_tokenizer):
    """--seed -1 failed after the tokenizer was trained, --seed 2**64 after the shards were packed too ("Overflow when
    unpacking long long"); an --out naming a file failed with a bare "[Errno 17] File exists"."""
    for seed in (-1, 2**64):
        assert main(["quickstart", "--seed", str(seed), "--out", str(tmp_path / "a"), "--threads", "1"]) == 2
        assert f"error: --seed={seed} is invalid: expected an integer in [0, 2**63)" in capsys.readouterr().err
        with pytest.raises(ValueError, match=rf"TrainConfig.seed={seed} is invalid"):
            quickstart(minutes=2, out=tmp_path / "a", seed=seed, threads=1, log=lambda _: None)
    with pytest.raises(ValueError, match=r"TrainConfig.seed=9223372036854775808 is invalid"):  # `rdepth train` too
        TrainConfig(preset="tiny", max_steps=1, seed=2**63).validate()
    TrainConfig(preset="tiny", max_steps=1, seed=2**63 - 1).validate()
    assert not (tmp_path / "a").exists()
    afile = tmp_path / "afile"
    afile.write_text("")
    assert main(["quickstart", "--out", str(afile), "--threads", "1"]) == 2
    assert f"error: --out {afile} is an existing file, not a directory" in capsys.readouterr().err


def test_an_interrupted_quickstart_says_how_to_go_on_and_its_rerun_trains_again(tmp_path, monkeypatch):
    """Ctrl-C during training said "continue with --resume", which `rdepth quickstart` does not have (its rerun
    trains from scratch). The rerun then reports the validation batches it evaluated, not the planned ones."""
    corpus = write_corpus(tmp_path / "corpus")
    recipe, out = _tiny_recipe(corpus), tmp_path / "qs"
    _no_plots(monkeypatch)

    class CtrlC:  # Ctrl-C during step 2 (the trainer stops after that step and checkpoints it)
        def __init__(self, _log):
            self.changes = []

        def __call__(self, trainer, _record):
            if trainer.state.step == 2:
                os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(quickstart_module, "ThreadGuard", CtrlC)
    with pytest.raises(KeyboardInterrupt) as info:
        quickstart(minutes=2, out=out, recipe=recipe, threads=1, log=lambda _: None)
    message = str(info.value)
    assert message.startswith("stopped after step 2; a quickstart does not resume: run it again to train from "
                              "scratch") and "--resume" not in message
    assert (out / "checkpoints").is_dir()

    class NoGuard(CtrlC):
        def __call__(self, trainer, _record):
            pass

    def late_evaluation(left_s, *_args):  # the evaluation's deadline already past: one batch of the 3 planned runs
        return quickstart_module.BudgetPlan(eval_batches=3, train_s=left_s, reserve_s=0.0, fixed_s=left_s)

    monkeypatch.setattr(quickstart_module, "ThreadGuard", NoGuard)
    monkeypatch.setattr(quickstart_module, "plan_budget", late_evaluation)
    summary = quickstart(minutes=2, out=out, recipe=recipe, threads=1, log=lambda _: None)
    assert summary["steps"] == 4 and summary["stop_reason"] == "max_tokens"  # from scratch: all 4 steps
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4
    assert summary["val_tokens"] == 1 * 4 * 32 and summary["eval_batches"] == 1  # was 3: the plan's


def test_an_interrupted_task_quickstart_does_not_point_to_resume(monkeypatch, capsys):
    """`rdepth quickstart --task` interrupted printed the trainer's "continue with --resume" too; its rerun clears
    the checkpoints and trains from scratch."""
    from recurrent_depth.evaluation.reasoning import train as reasoning_train
    from recurrent_depth.train.trainer import TrainingInterrupted

    def interrupted(_config):
        raise TrainingInterrupted("stopped after step 3; checkpoint runs/x/checkpoints/step-00000003 is saved: "
                                  "continue with --resume")

    monkeypatch.setattr(reasoning_train, "run_reasoning", interrupted)
    assert main(["quickstart", "--task", "modsum", "--threads", "1"]) == 130
    assert capsys.readouterr().err.strip() == ("rdepth quickstart: interrupted: stopped after step 3; a quickstart "
                                               "does not resume: run it again to train from scratch")


def test_a_task_quickstart_keeps_another_runs_checkpoints(tmp_path):
    """`rdepth quickstart --task ... --out DIR` deleted DIR/checkpoints of any run before the trainer looked (then
    refused DIR/model, too late for the checkpoints); a reasoning run stopped early is still its own to clear."""
    import dataclasses

    from recurrent_depth.evaluation.reasoning.train import run_reasoning, task_preset

    config = task_preset("shells", hidden_size=32, num_heads=2, intermediate_size=64, mean_recurrence=2,
                         backprop_depth=1, batch_size=4, max_steps=2, log_every=2, eval_count=2,
                         test_difficulties=[1, 2], depths=[1, 2], train_difficulties=(1, 3), out=str(tmp_path / "a"))
    other = tmp_path / "trained"
    (other / "checkpoints" / "step-00000100").mkdir(parents=True)
    with pytest.raises(ValueError, match=rf"--out {other} holds the checkpoints of a run that is not a reasoning"):
        run_reasoning(dataclasses.replace(config, out=str(other)), log=lambda _: None)
    assert (other / "checkpoints" / "step-00000100").is_dir()
    stopped = tmp_path / "a"  # a reasoning run interrupted in training: its checkpoint and run.json, no accuracy.json
    (stopped / "checkpoints" / "step-00000001").mkdir(parents=True)
    (stopped / "run.json").write_text(json.dumps({"data": {"source": "reasoning problems", "task": "shells"}}))
    assert run_reasoning(config, log=lambda _: None)["train"]["steps"] == 2


def test_an_out_that_cannot_be_made_is_named(tmp_path, capsys):
    """`rdepth train --out` under a file (or /proc) printed mkdir's bare "[Errno 20] Not a directory: ..."."""
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "run"
    assert main(["train", "--preset", "tiny", "--max-steps", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"rdepth train: error: --out {out} cannot be created (Not a directory): choose a writable directory"
