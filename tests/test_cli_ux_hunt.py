"""Everyday CLI mistakes get one line that names the mistake and what to pass instead, the same in
every command that takes a model: a model's own file for its directory, a run's checkpoints/ directory,
a LoRA run directory; short dtype names as `rdepth train` takes them; a mistyped command."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from recurrent_depth.cli import build_parser, main


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def model_argv(command: str, model: Path, tmp_path: Path) -> list[str]:
    """`command` given `model`, with what else it needs to get as far as the model check."""
    extra = {"info": [], "generate": ["--prompt", "a"], "eval": ["--out", str(tmp_path / "ev")],
             "export": ["--out", str(tmp_path / "ex")], "serve": ["--port", str(free_port())]}[command]
    threads = [] if command in ("info", "export") else ["--threads", "1"]
    return [command, "--model", str(model), *extra, *threads]


def last_error(capsys: pytest.CaptureFixture[str]) -> str:
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if "error" in line]
    assert len(lines) == 1, lines
    return lines[0]


COMMANDS = ("info", "generate", "eval", "export", "serve")


@pytest.mark.parametrize("command", COMMANDS)
def test_a_models_own_file_given_as_the_model_names_its_directory(command, tmp_path, capsys):
    """`--model run/model/config.json` was "no such directory" (generate), "model directory X does not exist"
    (eval, export) or "is not a directory" (info, serve): the file exists, and its directory was meant."""
    (tmp_path / "model").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "model" / name).write_text("{}")
        given = tmp_path / "model" / name
        assert main(model_argv(command, given, tmp_path)) == 2
        assert last_error(capsys) == (f"rdepth {command}: error: --model {given} is not a directory but a file: "
                                      f"pass the directory holding it, --model {tmp_path / 'model'}")


@pytest.mark.parametrize("command", COMMANDS)
def test_a_missing_model_directory_reads_the_same_in_every_command(command, tmp_path, capsys):
    absent = tmp_path / "absent"
    assert main(model_argv(command, absent, tmp_path)) == 2
    assert last_error(capsys) == (f"rdepth {command}: error: --model {absent}: no such directory (expected a saved "
                                  f"model directory)")


@pytest.mark.parametrize("where", ["checkpoints", "run"])
def test_a_run_without_model_names_its_newest_checkpoint(where, tmp_path, capsys):
    """A run's checkpoints/ directory, or a run stopped before it saved model/, holds step-N model directories:
    the error said only "has no config.json"."""
    run = tmp_path / "run"
    for step in ("step-00000010", "step-00000020"):
        (run / "checkpoints" / step).mkdir(parents=True)
        (run / "checkpoints" / step / "config.json").write_text("{}")
    given = run / "checkpoints" if where == "checkpoints" else run
    for command in ("info", "eval"):
        assert main(model_argv(command, given, tmp_path)) == 2
        assert last_error(capsys).endswith(f"; it holds training checkpoints: pass one, e.g. the newest, --model "
                                           f"{run / 'checkpoints' / 'step-00000020'}")


def test_a_lora_run_directory_names_its_adapter_and_base(tmp_path, capsys):
    """Given the run (not its model/), the hint said "it is a LoRA adapter" without the path --lora takes."""
    run = tmp_path / "lora-run"
    (run / "model").mkdir(parents=True)
    base = str(tmp_path / "base" / "model")
    (run / "model" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
    assert main(model_argv("generate", run, tmp_path)) == 2
    err = last_error(capsys)
    assert "it is a LoRA adapter (adapter_config.json)" in err
    assert err.endswith(f" (the adapter: {run / 'model'}; its base: {base})")
    (run / "model" / "adapter_config.json").write_text("[not json")  # the adapter's path alone still helps
    assert main(model_argv("info", run, tmp_path)) == 2
    assert last_error(capsys).endswith(f" (the adapter: {run / 'model'})")


def test_eval_baseline_takes_a_run_directory_and_is_checked_first(tmp_path, capsys):
    """--model took a run directory and --baseline did not ("run has no config.json" after the model loaded)."""
    run = tmp_path / "base-run"
    (run / "model").mkdir(parents=True)
    (run / "model" / "config.json").write_text("{}")
    args = build_parser("eval").parse_args(["eval", "--model", str(run), "--baseline", str(run)])
    assert args.baseline == str(run / "model") and args.model == str(run / "model")
    assert main(["eval", "--model", str(run), "--baseline", str(tmp_path / "nope"), "--threads", "1"]) == 2
    assert last_error(capsys) == (f"rdepth eval: error: --baseline {tmp_path / 'nope'}: no such directory "
                                  f"(expected a saved model directory)")


@pytest.mark.parametrize("command,rest", [("generate", ["--model", "m", "--prompt", "a"]),
                                          ("export", ["--model", "m"]), ("serve", ["--model", "m"]),
                                          ("retrofit", ["--model", "m", "--prelude", "1", "--core", "1:2",
                                                        "--coda", "1", "--out", "o"])])
def test_dtype_takes_the_short_names_train_takes(command, rest):
    """`rdepth train --dtype bf16` works; `rdepth generate --dtype bf16` was "invalid choice"."""
    parser = build_parser(command)
    for given, meant in (("bf16", "bfloat16"), ("fp16", "float16"), ("FP32", "float32"), ("bfloat16", "bfloat16")):
        assert parser.parse_args([command, *rest, "--dtype", given]).dtype == meant


def test_a_mistyped_command_suggests_the_one_meant(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["infoo", "--preset", "tiny"])
    assert exit_info.value.code == 2
    assert "rdepth: error: unknown command 'infoo': did you mean info?" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["xyzzy"])
    assert "unknown command 'xyzzy': choose one of quickstart, train," in capsys.readouterr().err
