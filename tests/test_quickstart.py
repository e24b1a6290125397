"""`rdepth quickstart` end to end on a tiny recipe (the real one is measured, not tested: it takes minutes)."""

import dataclasses
import json
import sys

import pytest

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.train.quickstart import QuickstartRecipe, quickstart
from tests.train_support import VOCAB, OneThread, write_corpus

quickstart_module = sys.modules["recurrent_depth.train.quickstart"]  # the package exports a function of that name


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


def test_quickstart_writes_summary_model_plots_and_report(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus")
    recipe = QuickstartRecipe(
        preset="tiny", data=str(corpus), vocab_size=VOCAB, seq_len=32, batch_size=4, max_tokens=8 * 4 * 32,
        val_fraction=0.1, eval_depths=(1, 2, 4, 8), eval_batches=2, sample_tokens=6,
    )
    out = tmp_path / "qs"
    summary = quickstart(minutes=2, out=out, recipe=recipe, threads=1)
    saved = json.loads((out / "summary.json").read_text())
    assert saved["val_loss_by_depth"].keys() == {"1", "2", "4", "8"}
    assert saved["steps"] == 8 and saved["stop_reason"] == "max_tokens" and saved["total_seconds"] < 120
    assert saved["best_depth"] in (1, 2, 4, 8)
    losses = saved["val_loss_by_depth"]
    assert saved["depth_gain"] == pytest.approx(losses["1"] - min(losses.values()))
    assert saved["test_time_scaling"] == (saved["depth_gain"] >= 0.05)
    assert summary["val_loss_by_depth"] == saved["val_loss_by_depth"]
    for name in ("loss_curve.png", "val_loss_by_depth.png", "sampled_depths.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert "data:image/png;base64," in (out / "report.html").read_text()
    assert "| 8 |" in (out / "report.md").read_text()
    model = rd.RecurrentDepthLM.from_pretrained(out / "model")
    assert model.config.vocab_size == VOCAB
    printed = capsys.readouterr().out
    assert "depth  val loss" in printed and "sample (greedy" in printed
    # A second run in the same directory starts from scratch and reuses the tokenizer and the shards.
    quickstart(minutes=2, out=out, recipe=recipe, threads=1)
    assert "reusing the tokenizer" in capsys.readouterr().out
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 8


def test_a_quickstart_into_a_directory_in_use_clears_nothing(tmp_path):
    """A second quickstart into the --out of one still training deleted that run's checkpoints and model/ before
    the trainer's lock refused it: the clearing is refused first."""
    import fcntl

    from recurrent_depth.evaluation.reasoning.train import run_reasoning, task_preset
    from recurrent_depth.files import DIR_LOCK_FILE

    out = tmp_path / "qs"
    (out / "checkpoints" / "step-00000002").mkdir(parents=True)
    with open(out / DIR_LOCK_FILE, "w") as holder:
        holder.write("4242\n")
        holder.flush()
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match=f"--out {out} is in use by process 4242"):
            quickstart(minutes=2, out=out, threads=1, log=lambda _: None)
        with pytest.raises(ValueError, match=f"--out {out} is in use by process 4242"):  # (--task: the same)
            run_reasoning(task_preset("shells", out=str(out), max_steps=1), log=lambda _: None)
    assert (out / "checkpoints" / "step-00000002").is_dir()


def test_a_quickstart_holds_its_out_directory_while_it_prepares_the_tokenizer_and_shards(tmp_path, monkeypatch):
    """The lock was taken only to clear the directory, so for the ~40 s of tokenizer training and packing a second
    quickstart there could clear and rewrite the first one's tokenizer and shards; the lock now covers them."""
    from recurrent_depth.files import lock_directory

    out = tmp_path / "qs"
    seen = []

    def prepare_tokenizer(out_dir, recipe, seed, log):
        with pytest.raises(ValueError, match="is in use by another run in this process"):
            lock_directory(out_dir, "--out")
        seen.append(out_dir)
        raise KeyboardInterrupt  # (stop here: the rest is the trainer's, which takes the lock itself)

    monkeypatch.setattr(quickstart_module, "prepare_tokenizer", prepare_tokenizer)
    with pytest.raises(KeyboardInterrupt):
        quickstart(minutes=2, out=out, threads=1, log=lambda _: None)
    assert seen == [out]
    lock_directory(out, "--out").close()  # released when the preparation fails


def test_cli_help_and_bad_minutes(capsys):
    with pytest.raises(SystemExit) as info:
        main(["quickstart", "--help"])
    assert info.value.code == 0
    assert "(default: 10)" in capsys.readouterr().out
    assert main(["quickstart", "--minutes", "0.1", "--out", "unused"]) == 2
    assert "minutes" in capsys.readouterr().err


def test_quickstart_task_runs_the_reasoning_preset(monkeypatch, capsys):
    from recurrent_depth.evaluation.reasoning import train as reasoning_train

    seen = {}

    def fake_run(config):
        seen["config"] = config
        return {"extrapolation": {"trained_up_to": 12, "beyond_training_at_0.9": 16, "beyond_training_at_0.5": 20}}

    monkeypatch.setattr(reasoning_train, "run_reasoning", fake_run)
    assert main(["quickstart", "--task", "modsum", "--minutes", "3", "--threads", "1"]) == 0
    config = seen["config"]
    assert config.task == "modsum" and config.minutes == 3 and config.threads == 1
    assert config.out == "runs/quickstart-modsum"
    assert config.train_difficulties == reasoning_train.TASK_PRESETS["modsum"]["train_difficulties"]
    assert max(config.test_difficulties) > config.train_difficulties[1]  # it measures extrapolation
    assert "beyond training up to 16" in capsys.readouterr().out
    assert main(["quickstart", "--task", "modsum", "--minutes", "-1"]) == 2
    assert "--max-minutes=-1" in capsys.readouterr().err  # the old spelling --minutes is an alias
    for bad in ("inf", "0.2"):  # the plain quickstart's cap is [0.5, 1440], named as the flag (was `minutes=`)
        assert main(["quickstart", "--max-minutes", bad]) == 2
        assert f"error: --max-minutes={float(bad)!r} is invalid: expected a number of minutes in [0.5, 1440]" in \
            capsys.readouterr().err


def test_a_task_quickstart_run_twice_in_one_directory_trains_again(tmp_path):
    """`rdepth quickstart --task` always trains from scratch: its rerun replaces its own model/ (the trainer
    refuses a directory holding another run's model/ and no checkpoint), and that run's model/ is kept."""
    from recurrent_depth.evaluation.reasoning.train import run_reasoning, task_preset

    config = task_preset("shells", hidden_size=32, num_heads=2, intermediate_size=64, mean_recurrence=2,
                         backprop_depth=1, batch_size=4, max_steps=2, log_every=2, eval_count=2,
                         test_difficulties=[1, 2], depths=[1, 2], train_difficulties=(1, 3), out=str(tmp_path / "a"))
    for _ in range(2):
        assert run_reasoning(config, log=lambda _: None)["train"]["steps"] == 2
    assert len((tmp_path / "a" / "metrics.jsonl").read_text().splitlines()) == 2
    other = tmp_path / "b" / "model"
    other.mkdir(parents=True)  # another run's model/ (no accuracy.json beside it)
    with pytest.raises(ValueError, match="holds the model/ of an earlier run and no checkpoint"):
        run_reasoning(dataclasses.replace(config, out=str(tmp_path / "b")), log=lambda _: None)
    assert other.is_dir()


def test_task_preset_overrides_and_errors():
    from recurrent_depth.evaluation.reasoning import TASK_PRESETS, task_preset

    assert set(TASK_PRESETS) >= {"modsum", "chains", "addition"}
    config = task_preset("modsum", minutes=None, batch_size=8)
    assert config.minutes == TASK_PRESETS["modsum"]["minutes"] and config.batch_size == 8
    with pytest.raises(ValueError, match="unknown reasoning task 'sorting'"):
        task_preset("sorting")
    with pytest.raises(ValueError, match="batch_size=0"):
        task_preset("chains", batch_size=0)


def test_the_budget_plan_always_leaves_training_a_share():
    plan_budget = quickstart_module.plan_budget
    # A busy machine (the reported case): 80 s left, an evaluation batch of 30 s, a step of 3 s. The old reserve
    # (1.3 x 30 s x at least 2 batches + 12 s = 90 s) left no training time: 0 steps.
    plan = plan_budget(80.0, eval_batch_s=30.0, step_s=3.0, max_eval_batches=6)
    assert plan.eval_batches == 1 and plan.train_s >= 0.5 * (80.0 - plan.fixed_s) > 0
    assert plan.train_s + plan.reserve_s == pytest.approx(80.0) and plan.fixed_s == 12.0
    # However slow the measurements, at least half of what the fixed end and the first evaluation batch leave
    # trains; that first batch (which always runs) is reserved in full, so the budget holds where it fits.
    for left in (1.0, 10.0, 45.0, 120.0, 600.0):
        for eval_batch_s in (0.0, 0.5, 20.0, 1e4):
            for step_s in (0.0, 0.1, 5.0, 1e4):
                plan = plan_budget(left, eval_batch_s, step_s, 6)
                usable = left - plan.fixed_s
                rest = usable - min(1.1 * eval_batch_s, usable)
                assert 0.5 * rest - 1e-9 <= plan.train_s and (plan.train_s > 0 or rest == 0)
                assert plan.reserve_s - plan.fixed_s >= min(1.1 * eval_batch_s, usable) - 1e-9
                # every planned batch has its measured time (x 1.1), but the first may have to overrun the plan
                assert plan.eval_batches == 1 or plan.reserve_s - plan.fixed_s == pytest.approx(
                    plan.eval_batches * 1.1 * eval_batch_s)
                assert 1 <= plan.eval_batches <= 6 and plan.fixed_s <= 0.25 * left
                assert plan.train_s + plan.reserve_s == pytest.approx(left)
    # Time to spare: every batch is evaluated, with the measured time (x 1.1), not a worst case.
    plan = plan_budget(600.0, eval_batch_s=5.0, step_s=1.0, max_eval_batches=6)
    assert plan.eval_batches == 6 and plan.reserve_s == pytest.approx(12.0 + 6 * 5.5)
    # Twenty steps at the measured step time are kept when they fit (here more than half of the time left).
    plan = plan_budget(112.0, eval_batch_s=10.0, step_s=3.5, max_eval_batches=6)
    assert plan.eval_batches == 2 and plan.train_s == pytest.approx(100.0 - 2 * 11.0) and plan.train_s >= 20 * 3.5
    assert plan_budget(0.0, 1.0, 1.0, 6).train_s == 0.0
    # A 0.5-minute budget with ~25 s left after preparation and a 20 s evaluation batch: training got 80% of
    # what the fixed end left and the forced batch overran the budget by ~15 s; now the batch comes first.
    plan = plan_budget(25.0, eval_batch_s=20.0, step_s=8.0, max_eval_batches=6)
    assert plan.eval_batches == 1 and plan.train_s == 0.0 and plan.reserve_s == pytest.approx(25.0)
    plan = plan_budget(40.0, eval_batch_s=10.0, step_s=1.0, max_eval_batches=6)
    assert plan.train_s > 0 and plan.train_s + plan.fixed_s + plan.eval_batches * 11.0 <= 40.0 + 1e-9


def test_a_busy_machines_short_budget_still_trains(tmp_path, monkeypatch):
    """An evaluation batch measured at 60 s (a busy machine) in a 2-minute budget: the old reserve took all of
    the time left and the run trained 0 steps."""
    corpus = write_corpus(tmp_path / "corpus")
    recipe = QuickstartRecipe(
        preset="tiny", data=str(corpus), vocab_size=VOCAB, seq_len=32, batch_size=4, max_tokens=3 * 4 * 32,
        val_fraction=0.1, eval_depths=(1, 2), eval_batches=2, sample_tokens=2,
    )

    def measured_slow(model, rows, depths, batches, step_depth=None):
        return 60.0 * batches if step_depth is None else (60.0 * batches, 1.0)

    monkeypatch.setattr(quickstart_module, "estimate_eval_seconds", measured_slow)
    from recurrent_depth.train import report

    def no_plot(_data, path, *_args):  # (matplotlib is most of this test's time otherwise)
        path.write_bytes(b"\x89PNG\r\n\x1a\n")
        return path

    for name in ("plot_loss_curve", "plot_val_by_depth", "plot_depth_histogram"):
        monkeypatch.setattr(report, name, no_plot)
    summary = quickstart(minutes=2, out=tmp_path / "qs", recipe=recipe, threads=1, log=lambda _: None)
    assert summary["steps"] == 3 and summary["stop_reason"] == "max_tokens"
