"""Bugs a seeded fuzzer of every `rdepth` command's flags found (bad values on tiny fixtures): each is now a usage
error or one `rdepth CMD: error:` line naming the flag, with nothing left in --out, never a traceback."""

from __future__ import annotations

import json

import pytest
import yaml

from recurrent_depth.cli import main
from tests.test_hf import make_model_dir
from tests.train_support import write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    make_model_dir(path)
    return path


def error_line(capsys) -> str:
    """The command's one error line (stderr may also hold the thread-count note); no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith("rdepth "), err
    return errors[0]


def usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return error_line(capsys)


@pytest.mark.parametrize("value", ["100000", str(10**23)])
def test_threads_beyond_the_cores_is_a_usage_error(value, capsys):
    # 100000 threads: OpenMP's thread creation failed, a segfault at the first matmul; 1e23: "Overflow when
    # unpacking long long", naming no flag
    line = usage_error(["info", "--preset", "tiny", "--threads", value], capsys)
    assert "argument --threads: expected an integer <=" in line and "per CPU core" in line


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_eval_init_scale_inf_or_nan_is_refused_before_anything_loads(model_dir, tmp_path, capsys, value):
    # inf reached trunc_normal_ after the model loaded: RuntimeError "from is out of bounds for float"
    out = tmp_path / "out"
    assert main(["eval", "--model", str(model_dir), "--data", "none", "--reasoning", "chains", "--init-scale", value,
                 "--out", str(out)]) == 2
    assert "init_scale=" in error_line(capsys) and not out.exists()


def test_eval_bad_text_field_leaves_no_empty_out(model_dir, tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus", num_docs=3)
    out = tmp_path / "out"
    assert main(["eval", "--model", str(model_dir), "--data", str(corpus), "--text-field", "body", "--depths", "1",
                 "--out", str(out)]) == 2
    assert "--text-field" in error_line(capsys) and not out.exists()


@pytest.mark.parametrize("extra, flag", [(["--count", "5"], "--count"), (["--fewshot", "1"], "--fewshot")])
def test_eval_options_of_an_absent_measurement_are_refused(model_dir, tmp_path, capsys, extra, flag):
    # --count without --reasoning and --fewshot without --lm-eval-tasks were ignored, exit 0
    out = tmp_path / "out"
    assert main(["eval", "--model", str(model_dir), "--data", "none", "--reasoning", "none", *extra,
                 "--out", str(out)]) == 2
    assert flag in error_line(capsys) and not out.exists()


def test_export_max_shard_mb_overflowing_to_inf_bytes_is_one_line(model_dir, tmp_path, capsys):
    # 1e308 passed `0 < x < inf`; int(x * 2**20) was OverflowError "cannot convert float infinity to integer"
    out = tmp_path / "out"
    assert main(["export", "--model", str(model_dir), "--max-shard-mb", "1e308", "--out", str(out)]) == 2
    assert "--max-shard-mb" in error_line(capsys) and not out.exists()


def test_rl_unknown_device_is_one_line_before_the_model_loads(model_dir, tmp_path, capsys):
    # was a RuntimeError traceback from model.to("nan")
    out = tmp_path / "out"
    assert main(["rl", "--init-from", str(model_dir), "--out", str(out), "--device", "nan"]) == 2
    assert "device 'nan'" in error_line(capsys) and not out.exists()


def test_sft_teacher_that_is_a_file_leaves_no_out(model_dir, tmp_path, capsys):
    # the teacher path was checked after `out` held run.json, metrics.jsonl, eval.jsonl and the lock
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"a={i};?a=", "completion": f"{i}\n"}) + "\n" for i in range(8)))
    teacher, out = tmp_path / "teacher.yaml", tmp_path / "out"
    teacher.write_text("x: 1\n")
    assert main(["sft", "--init-from", str(model_dir), "--data", str(data), "--teacher", str(teacher),
                 "--seq-len", "32", "--batch-size", "2", "--max-steps", "1", "--no-progress", "--no-tensorboard",
                 "--out", str(out)]) == 2
    assert "teacher=" in error_line(capsys) and not out.exists()


def test_sweep_run_jobs_zero_writes_nothing(tmp_path, capsys):
    # --jobs 0 was refused after the plan, the shared tokenizer and the shards were written into --out
    corpus = write_corpus(tmp_path / "corpus", num_docs=4)
    base = {"preset": "tiny", "data": str(corpus), "vocab_size": 300, "val_fraction": 0.25, "keep_all": True,
            "seq_len": 16, "batch_size": 2, "max_steps": 1, "eval_batches": 1}
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump({"base": base, "grid": {"hidden_size": [32]}, "test_depths": [1]}))
    out = tmp_path / "sweep"
    assert main(["sweep", "run", str(config), "--out", str(out), "--jobs", "0"]) == 2
    assert "--jobs must be an integer >= 1" in error_line(capsys) and not out.exists()


@pytest.mark.parametrize("argv, flag", [(["--seed", str(10**23)], "--seed"), (["--layers", "0"], "--layers")])
def test_loop_pretrain_bad_recipe_names_the_flag_and_writes_nothing(tmp_path, capsys, argv, flag):
    # a 1e23 seed overflowed torch.manual_seed after the tokenizer and shards were written ("Overflow when
    # unpacking long long"); the recipe's errors named its fields (PretrainRecipe.num_layers), not the flags
    out = tmp_path / "out"
    assert main(["loop", "pretrain", "--out", str(out), *argv]) == 2
    line = error_line(capsys)
    assert f"rdepth loop: error: {flag} must be" in line and "PretrainRecipe" not in line and not out.exists()


@pytest.mark.parametrize("argv", [
    ["export", "--model", "{model}", "--out", ""],
    ["quickstart", "--out", ""],
    ["scaling", "fit", "{model}/results.csv", "--out", ""],
    ["loop", "search", "--model", "{model}", "--save", ""],
])
def test_an_empty_output_directory_is_a_usage_error(model_dir, tmp_path, monkeypatch, capsys, argv):
    # `--out ''` (an unset $OUT) wrote into the current directory (quickstart and scaling fit: their default one)
    monkeypatch.chdir(tmp_path)
    flag = "--save" if "--save" in argv else "--out"
    line = usage_error([a.replace("{model}", str(model_dir)) for a in argv], capsys)
    assert f"argument {flag}: expected a directory path, got ''" in line
    assert list(tmp_path.iterdir()) == []


def test_a_model_path_too_long_for_the_file_system_is_one_line(capsys):
    # --model's argparse type looked for a run directory's model/: OSError "File name too long", a traceback
    assert main(["info", "--model", "a" * 5000]) == 2
    assert "File name too long" in error_line(capsys)


def test_loop_pretrain_missing_data_leaves_no_out(tmp_path, capsys):
    out = tmp_path / "out"  # (--out was made before the corpus was looked for)
    assert main(["loop", "pretrain", "--out", str(out), "--data", str(tmp_path / "missing")]) == 2
    assert "does not exist" in error_line(capsys) and not out.exists()


def test_serve_ttt_max_copy_mb_overflowing_to_inf_bytes_is_one_line(model_dir, capsys):
    # 1e308 MiB passed `>= 0`; int(x * 2**20) was OverflowError "cannot convert float infinity to integer"
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["serve", "--model", str(model_dir), "--port", str(port), "--ttt-max-copy-mb", "1e308"]) == 2
    assert "--ttt-max-copy-mb 1e+308 is invalid" in error_line(capsys)
