"""`rdepth quickstart` end to end on a tiny recipe (the real one is measured, not tested: it takes minutes)."""

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


def test_task_preset_overrides_and_errors():
    from recurrent_depth.evaluation.reasoning import TASK_PRESETS, task_preset

    assert set(TASK_PRESETS) >= {"modsum", "chains", "addition"}
    config = task_preset("modsum", minutes=None, batch_size=8)
    assert config.minutes == TASK_PRESETS["modsum"]["minutes"] and config.batch_size == 8
    with pytest.raises(ValueError, match="unknown reasoning task 'sorting'"):
        task_preset("sorting")
    with pytest.raises(ValueError, match="batch_size=0"):
        task_preset("chains", batch_size=0)
