"""`rdepth quickstart` end to end on a tiny recipe (the real one is measured, not tested: it takes minutes)."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.train.quickstart import QuickstartRecipe, ThreadGuard, choose_threads, quickstart
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


def test_choose_threads_returns_a_candidate(monkeypatch):
    monkeypatch.setattr(quickstart_module.os, "cpu_count", lambda: 2)  # a 2-core machine
    assert choose_threads((1,)) == 1
    assert choose_threads((1, 2)) in (1, 2)
    monkeypatch.setattr(quickstart_module, "others_busy_cores", lambda window: 1.2)  # someone else is busy
    torch.set_num_threads(2)
    assert choose_threads() == 1 and torch.get_num_threads() == 1
    monkeypatch.setattr(quickstart_module, "others_busy_cores", lambda window: 0.1)  # idle: time the candidates
    torch.set_num_threads(2)
    assert choose_threads() in (1, 2)


def test_other_processes_load_subtracts_this_process_cpu_time(monkeypatch):
    others = {"seconds": 0.0}
    monkeypatch.setattr(quickstart_module, "_machine_busy_seconds", lambda: time.process_time() + others["seconds"])
    load = quickstart_module.OtherProcessesLoad()
    start = time.perf_counter()
    while time.perf_counter() - start < 0.2:  # our own work: the machine's busy time rises by as much
        sum(range(1000))
    others["seconds"] = 0.3  # meanwhile other processes used 0.3 CPU-seconds
    busy = load.read()
    elapsed = time.perf_counter() - start
    assert 0.3 / (elapsed + 0.05) < busy <= 0.3 / 0.2


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux /proc/stat")
def test_others_busy_cores_sees_a_busy_process():
    busy_loop = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"
    spin = subprocess.Popen([sys.executable, "-c", busy_loop])
    try:
        time.sleep(0.3)  # let it start
        assert quickstart_module.others_busy_cores(0.6) >= 0.5  # one core kept busy by someone else
    finally:
        spin.wait()


def test_cores_too_busy_counts_the_idle_cores_left():
    too_busy = quickstart_module.cores_too_busy
    assert not too_busy(2, 0.3, cpus=2) and too_busy(2, 0.5, cpus=2) and too_busy(2, 1.2, cpus=2)
    # A large shared host (a container's /proc/stat covers all of it): busy neighbours, idle cores left.
    assert not too_busy(2, 30.0, cpus=64) and too_busy(2, 63.0, cpus=64)


def test_thread_guard_drops_to_one_thread_under_competition(monkeypatch):
    monkeypatch.setattr(quickstart_module.os, "cpu_count", lambda: 2)
    messages = []
    readings = iter([0.2, 1.3])
    monkeypatch.setattr(quickstart_module.OtherProcessesLoad, "read", lambda self: next(readings))
    guard = ThreadGuard(messages.append, every=2)
    torch.set_num_threads(2)
    guard(None, {"step": 2})  # others use 0.2 cores: keep both threads
    assert torch.get_num_threads() == 2 and not guard.changes
    guard(None, {"step": 3})  # not a check step
    assert torch.get_num_threads() == 2
    guard(None, {"step": 4})
    assert torch.get_num_threads() == 1 and guard.changes == [{"step": 4, "others_busy_cores": 1.3, "threads": 1}]
    assert "1 thread" in messages[0]


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
    assert "--minutes=-1" in capsys.readouterr().err


def test_task_preset_overrides_and_errors():
    from recurrent_depth.evaluation.reasoning import TASK_PRESETS, task_preset

    assert set(TASK_PRESETS) >= {"modsum", "chains", "addition"}
    config = task_preset("modsum", minutes=None, batch_size=8)
    assert config.minutes == TASK_PRESETS["modsum"]["minutes"] and config.batch_size == 8
    with pytest.raises(ValueError, match="unknown reasoning task 'sorting'"):
        task_preset("sorting")
    with pytest.raises(ValueError, match="batch_size=0"):
        task_preset("chains", batch_size=0)


def test_other_processes_load_without_proc_stat_uses_the_load_average_less_our_own_use(monkeypatch):
    monkeypatch.setattr(quickstart_module, "_machine_busy_seconds", lambda: None)  # e.g. macOS
    monkeypatch.setattr(quickstart_module, "_load_average", lambda: 1.5)
    load = quickstart_module.OtherProcessesLoad()
    time.sleep(0.2)  # this process idle: the whole load average is someone else's
    assert load.read() == pytest.approx(1.5, abs=0.1)
