"""Thread choice (recurrent_depth.accel.threads) and `--threads` on every command."""

import argparse
import os
import subprocess
import sys
import time
import types

import pytest
import torch

from recurrent_depth.accel import threads as threads_module
from recurrent_depth.accel.threads import ThreadGuard, choose_threads, configure_threads
from recurrent_depth.cli import COMMANDS, MEASURE_THREADS, build_parser, main


@pytest.fixture(autouse=True)
def _restore_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(threads_module, "_measured", None)
    yield
    torch.set_num_threads(before)


def test_choose_threads_returns_a_candidate(monkeypatch):
    monkeypatch.setattr(threads_module.os, "cpu_count", lambda: 2)  # a 2-core machine
    assert choose_threads((1,)) == 1
    assert choose_threads((1, 2)) in (1, 2)
    monkeypatch.setattr(threads_module, "others_busy_cores", lambda window: 1.2)  # someone else is busy
    torch.set_num_threads(2)
    assert choose_threads() == 1 and torch.get_num_threads() == 1
    monkeypatch.setattr(threads_module, "others_busy_cores", lambda window: 0.1)  # idle: time the candidates
    torch.set_num_threads(2)
    assert choose_threads() in (1, 2)


def test_other_processes_load_subtracts_this_process_cpu_time(monkeypatch):
    # A fake clock: the readings are exact, whatever else this process's threads or the VM do meanwhile.
    clock = types.SimpleNamespace(wall=0.0, own=0.0, others=0.0)
    fake_time = types.SimpleNamespace(perf_counter=lambda: clock.wall, process_time=lambda: clock.own, sleep=time.sleep)
    monkeypatch.setattr(threads_module, "time", fake_time)
    monkeypatch.setattr(threads_module, "_machine_busy_seconds", lambda: clock.own + clock.others)
    load = threads_module.OtherProcessesLoad()
    clock.wall, clock.own, clock.others = 0.2, 0.2, 0.3  # our own work 0.2 CPU-s, other processes 0.3
    assert load.read() == pytest.approx(0.3 / 0.2)
    clock.wall, clock.own = 0.7, 0.7  # next window: only our own work
    assert load.read() == pytest.approx(0.0)
    monkeypatch.setattr(threads_module, "_machine_busy_seconds", lambda: None)  # no /proc/stat
    monkeypatch.setattr(threads_module, "_load_average", lambda: 1.25)
    load = threads_module.OtherProcessesLoad()
    clock.wall, clock.own = 1.7, 1.2  # half a core of our own inside the load average
    assert load.read() == pytest.approx(0.75)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux /proc/stat")
def test_others_busy_cores_sees_a_busy_process():
    busy_loop = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"
    spin = subprocess.Popen([sys.executable, "-c", busy_loop])
    try:
        time.sleep(0.3)  # let it start
        assert threads_module.others_busy_cores(0.6) >= 0.5  # one core kept busy by someone else
    finally:
        spin.wait()


def test_cores_too_busy_counts_the_idle_cores_left():
    too_busy = threads_module.cores_too_busy
    assert not too_busy(2, 0.3, cpus=2) and too_busy(2, 0.5, cpus=2) and too_busy(2, 1.2, cpus=2)
    # A large shared host (a container's /proc/stat covers all of it): busy neighbours, idle cores left.
    assert not too_busy(2, 30.0, cpus=64) and too_busy(2, 63.0, cpus=64)


def test_thread_guard_drops_to_one_thread_under_competition(monkeypatch):
    monkeypatch.setattr(threads_module.os, "cpu_count", lambda: 2)
    messages = []
    readings = iter([0.2, 1.3])
    monkeypatch.setattr(threads_module.OtherProcessesLoad, "read", lambda self: next(readings))
    guard = ThreadGuard(messages.append, every=2)
    torch.set_num_threads(2)
    guard(None, {"step": 2})  # others use 0.2 cores: keep both threads
    assert torch.get_num_threads() == 2 and not guard.changes
    guard(None, {"step": 3})  # not a check step
    assert torch.get_num_threads() == 2
    guard(None, {"step": 4})
    assert torch.get_num_threads() == 1 and guard.changes == [{"step": 4, "others_busy_cores": 1.3, "threads": 1}]
    assert "1 thread" in messages[0]


def test_other_processes_load_without_proc_stat_uses_the_load_average_less_our_own_use(monkeypatch):
    monkeypatch.setattr(threads_module, "_machine_busy_seconds", lambda: None)  # e.g. macOS
    monkeypatch.setattr(threads_module, "_load_average", lambda: 1.5)
    load = threads_module.OtherProcessesLoad()
    time.sleep(0.2)  # this process idle: the whole load average is someone else's
    assert load.read() == pytest.approx(1.5, abs=0.1)


def test_configure_threads_honours_the_request_and_measures_once(monkeypatch):
    calls = []
    monkeypatch.setattr(threads_module, "choose_threads", lambda: calls.append(1) or 1)
    lines = []
    assert configure_threads(2, lines.append) == 2 and torch.get_num_threads() == 2
    assert "--threads" in lines[-1]
    assert configure_threads(None, lines.append) == 1 and torch.get_num_threads() == 1
    assert configure_threads(None) == 1 and calls == [1]  # measured once per process
    assert "measured" in lines[-1]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="--threads"):
            configure_threads(bad)


def _leaf_parsers(parser: argparse.ArgumentParser):
    nested = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not nested:
        yield parser
    for action in nested:
        for child in action.choices.values():
            yield from _leaf_parsers(child)


def test_every_command_takes_threads():
    top = build_parser()
    commands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(COMMANDS) <= set(commands)
    for name, parser in commands.items():
        for leaf in _leaf_parsers(parser):
            assert any("--threads" in a.option_strings for a in leaf._actions), f"rdepth {name}: no --threads"


def test_cli_sets_the_requested_threads_and_prints_the_choice_once(monkeypatch, capsys, tmp_path):
    assert main(["info", "--preset", "tiny", "--threads", "3"]) == 0
    assert torch.get_num_threads() == 3
    monkeypatch.setattr(threads_module, "choose_threads", lambda: 1)
    torch.set_num_threads(2)
    assert "analyze" in MEASURE_THREADS
    capsys.readouterr()
    # a measured command: the choice is set before the command runs, and said once on stderr
    assert main(["analyze", "--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert torch.get_num_threads() == 1
    err = capsys.readouterr().err
    assert err.count("torch thread(s)") == 1 and "rdepth analyze: using 1 torch thread(s)" in err


def test_under_torchrun_rank_0_alone_prints_the_thread_choice(monkeypatch, capsys, tmp_path):
    # `torchrun --nproc_per_node 2 -m recurrent_depth.cli sft ...` printed "using N torch thread(s)" once per rank
    monkeypatch.setattr(threads_module, "choose_threads", lambda: 1)
    for rank, lines in (("0", 1), ("1", 0)):
        monkeypatch.setenv("RANK", rank)  # (torchrun's environment)
        assert main(["analyze", "--model", str(tmp_path / "missing"), "--prompt", "x"]) == 2
        assert torch.get_num_threads() == 1  # (every rank still sets it)
        assert capsys.readouterr().err.count("torch thread(s)") == lines, rank


def test_cli_refuses_a_bad_thread_count(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--model", "x", "--prompt", "y", "--threads", "0"])
    assert "--threads: expected an integer >= 1, got '0'" in capsys.readouterr().err
