"""The benchmark scripts' arguments: --help describes instead of running, and a bad value is one line naming its
flag (argparse's exit 2) before anything heavy runs, not a traceback from deep inside, a silent default or a crash
at the end of the measurement. Only the argument checks run here (no benchmark)."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import _args  # noqa: E402


def _one_line_error(capsys, excinfo) -> str:
    assert excinfo.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.fixture
def stop_after_parsing(monkeypatch):
    """For scripts that parse inside main(): should the arguments be accepted (the bug), stop there instead of
    running the benchmark."""
    original = argparse.ArgumentParser.parse_args

    def parse(self, *a, **kw):
        original(self, *a, **kw)
        raise AssertionError("the arguments were accepted")

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)


def test_checkpoint_attacks_help_describes_instead_of_running(capsys):
    # before: main() took no arguments and `--help` ran the whole attack suite (14 damaged resumes)
    attacks = importlib.import_module("checkpoint_attacks")
    with pytest.raises(SystemExit) as excinfo:
        attacks.main(["--help"])
    assert excinfo.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and "--resume" in out
    with pytest.raises(SystemExit) as excinfo:
        attacks.main(["--bogus"])
    assert "unrecognized arguments: --bogus" in _one_line_error(capsys, excinfo)


@pytest.mark.parametrize(("module", "argv", "expected"), [
    ("generation", ["--model", "/nonexistent-model"], "--model /nonexistent-model: no such directory"),
    ("generation", ["--threads", "0"], "argument --threads: expected an integer >= 1"),
    ("generation", ["--num-steps", "0"], "argument --num-steps: expected an integer >= 1"),  # was r = 16
    ("generation", ["--prompts-file", "p.txt"], "--prompts-file needs --model"),  # was ignored
    ("kv_memory", ["--model", "/nonexistent-model"], "--model /nonexistent-model: no such directory"),
    ("kv_memory", ["--plot", "/"], "argument --plot: / is a directory"),  # failed after the run
    ("weight_quant", ["--model", "/nonexistent-model", "--skip-kernels"], "--model /nonexistent-model"),
    ("rl_rollouts", ["--preset", "nope"], "argument --preset: unknown preset 'nope'"),
    ("decode_roofline", ["--preset", "nope"], "argument --preset: unknown preset 'nope'"),
    ("ouro_exit", ["--layers", "0"], "argument --layers: expected an integer >= 1"),
    ("ouro_exit", ["--new-tokens", "2"], "--new-tokens must be at least 3"),  # NaN KV bytes in the JSON
    ("looping_decode", ["--new-tokens", "1"], "--new-tokens must be at least 2"),  # divided by zero
    ("looping_decode", ["--window", "x"], "--window: expected FIRST-LAST"),
    ("serving", ["--max-tokens", "5,1"], "argument --max-tokens: expected LO,HI"),  # randint's traceback
    ("serving", ["--concurrency", "0"], "argument --concurrency: expected comma-separated integers >= 1"),
    ("serving", ["--out", "/"], "argument --out: / is a directory"),
    ("serving_kv_quant", ["--kv-quant", "none;bogus"], "--kv-quant: kv_quant='bogus' is invalid"),
])
def test_parse_args_refuses_in_one_line(capsys, module, argv, expected):
    with pytest.raises(SystemExit) as excinfo:
        importlib.import_module(module).parse_args(argv)
    assert expected in _one_line_error(capsys, excinfo)


@pytest.mark.parametrize(("module", "argv", "expected"), [
    ("lora_decode", ["--preset", "nope"], "argument --preset: unknown preset 'nope'"),
    ("qk_clip_cost", ["--seq-len", "0"], "argument --seq-len: expected an integer >= 1"),
    ("mixers", ["--lengths", "0"], "argument --lengths: expected an integer >= 1"),  # ran T = 0 rows
    ("gradmem_write", ["--model", "m", "--threads", "0"], "argument --threads: expected an integer >= 1"),
    ("retrofit_demo", ["--plot", "/"], "argument --plot: / is a directory"),
])
def test_main_refuses_before_running(capsys, monkeypatch, stop_after_parsing, module, argv, expected):
    monkeypatch.setattr(sys, "argv", [f"{module}.py", *argv])
    with pytest.raises(SystemExit) as excinfo:
        importlib.import_module(module).main()
    assert expected in _one_line_error(capsys, excinfo)


def test_demo_out_that_is_a_file_is_refused(capsys, monkeypatch, stop_after_parsing, tmp_path):
    # before: mkdir's FileExistsError traceback (after pretraining, for distill_demo's teacher)
    taken = tmp_path / "taken"
    taken.write_text("")
    for module in ("sft_demo", "distill_demo"):
        monkeypatch.setattr(sys, "argv", [f"{module}.py", "--out", str(taken)])
        with pytest.raises(SystemExit) as excinfo:
            importlib.import_module(module).main()
        assert f"argument --out: {taken} is a file" in _one_line_error(capsys, excinfo)


def test_reasoning_depth_checks_task_before_training(capsys):
    # before: an unknown --task (or --difficulties) raised only after the model had trained for --minutes
    reasoning = importlib.import_module("reasoning_depth")
    with pytest.raises(SystemExit) as excinfo:
        reasoning.main(["--task", "nope"])
    assert "unknown reasoning task 'nope'" in _one_line_error(capsys, excinfo)


def test_checked_model_dir_takes_a_run_directory(tmp_path, capsys):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    parser = argparse.ArgumentParser(prog="bench.py")
    assert _args.checked_model_dir(parser, str(tmp_path)) == str(tmp_path / "model")
    assert _args.checked_model_dir(parser, None) is None
    with pytest.raises(SystemExit) as excinfo:
        _args.checked_model_dir(parser, str(tmp_path / "model" / "config.json"), "--base")
    assert "--base" in _one_line_error(capsys, excinfo)


def test_serving_requests_use_the_parsed_ranges():
    # before: a single number ("--prompt-tokens 3") failed to unpack, a traceback
    import random

    serving = importlib.import_module("serving")
    args = serving.parse_args(["--prompt-tokens", "3", "--max-tokens", "2,4"])
    assert args.prompt_tokens == (3, 3) and args.max_tokens == (2, 4)
    requests = serving.random_requests(random.Random(0), 300, args.prompt_tokens, args.max_tokens, 20)
    assert {len(prompt) for prompt, _ in requests} == {3}
    assert {n for _, n in requests} <= {2, 3, 4}


def test_generation_table_columns_line_up():
    # before: a fixed width of 22 ran "core_cache_mb" into "agreement_teacher_forced" (24 characters)
    generation = importlib.import_module("generation")
    row = {c: 123456.789 for c in generation.TABLE_COLUMNS}
    lines = generation.mode_table({"fixed": row, "speculative exact": {**row, "agreement_teacher_forced": None}})
    header = lines[0].split()
    assert header == ["mode", *generation.TABLE_COLUMNS]
    for line in lines[1:]:
        assert len(line) == len(lines[0])
    ends = [lines[0].index(c) + len(c) for c in generation.TABLE_COLUMNS]
    for line in lines[1:]:
        assert all(line[end - 1] != " " and (end == len(line) or line[end] == " ") for end in ends)


def test_distill_demo_evaluates_each_depth_once():
    # before: --teacher-depth 4 (the student's depth) evaluated r = 4 twice and printed two identical columns
    distill = importlib.import_module("distill_demo")
    assert distill.eval_depths(distill.STUDENT_DEPTH) == [distill.STUDENT_DEPTH]
    assert distill.eval_depths(32) == [distill.STUDENT_DEPTH, 32]


def test_ab_commits_refuses_zero_rounds_and_an_unknown_base(capsys, monkeypatch, tmp_path):
    # before: --rounds 0 extracted the base and then failed on an empty list; an unknown --base was
    # CalledProcessError's traceback
    ab = importlib.import_module("ab_commits")
    with pytest.raises(SystemExit) as excinfo:
        ab.main(["generation", "--rounds", "0"])
    assert "argument --rounds: expected an integer >= 1" in _one_line_error(capsys, excinfo)
    with pytest.raises(SystemExit) as excinfo:
        ab.extract("no-such-commit-0000", tmp_path)
    assert str(excinfo.value).startswith("ab_commits.py: error: --base no-such-commit-0000: ")
    assert "\n" not in str(excinfo.value)


@pytest.mark.parametrize(("module", "argv", "first_work", "expected"), [
    ("optim_sweep", ["--grid", "adamw:3e-3", "bogus"], "load_bytes", "--grid 'bogus': expected name:lr[:muon_lr]"),
    ("scaling_coverage", ["--level", "2"], "synthetic_rows", "--level must be in (0, 1), got 2.0"),
    ("scaling_coverage", ["--resamples", "0"], "synthetic_rows", "argument --resamples: expected an integer >= 1"),
    ("kernel_cache_attacks", ["--rebuilds", "bogus"], "kill_a_lock_holder", "--rebuilds: unknown bogus"),
    ("train_throughput", ["--threads", "0"], "keep_freed_memory", "--threads must be at least 1, got 0"),
])
def test_checks_after_parsing_come_before_the_work(capsys, monkeypatch, module, argv, first_work, expected):
    # before: a malformed --grid entry failed when its turn came, --level after a first draw, --resamples 0 as a
    # KeyError, an unknown rebuild was taken for "garbage" after two real builds, --threads 0 meant torch's default
    bench = importlib.import_module(module)

    def started(*a, **kw):
        raise AssertionError("the arguments were accepted")

    monkeypatch.setattr(bench, first_work, started)
    monkeypatch.setattr(sys, "argv", [f"{module}.py", *argv])
    with pytest.raises(SystemExit) as excinfo:
        bench.main(argv) if module == "train_throughput" else bench.main()
    assert expected in _one_line_error(capsys, excinfo)


def test_generation_takes_a_model_directory_without_a_tokenizer(tmp_path, capsys):
    """Its prompts are random ids then, as the random model's (was: a traceback from load_tokenizer); a prompts file
    needs the tokenizer (one line)."""
    from tests.test_hf import make_model_dir

    generation = importlib.import_module("generation")
    make_model_dir(tmp_path / "m", with_tokenizer=False)
    (tmp_path / "p.txt").write_text("hello\n")
    with pytest.raises(SystemExit):
        generation.parse_args(["--model", str(tmp_path / "m"), "--prompts-file", str(tmp_path / "p.txt")])
    assert "--prompts-file needs a tokenizer.json in --model" in capsys.readouterr().err
    assert generation.main(["--model", str(tmp_path / "m"), "--quick", "--no-baselines", "--threads", "1"]) == 0
    assert '"benchmark": "generation"' in capsys.readouterr().out
