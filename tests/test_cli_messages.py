"""Issue 33 items 6 and 7: CLI messages that send users the right way."""

from __future__ import annotations

import pytest

from recurrent_depth.cli import main
from tests.test_hf import make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run directory as `rdepth train` / `quickstart` leave it: the model in model/."""
    run = tmp_path_factory.mktemp("run")
    make_model_dir(run / "model")
    return run


GENERATE = ["generate", "--prompt", "a", "--max-new-tokens", "2", "--num-steps", "2", "--threads", "1"]
NO_PROMPT = [a for a in GENERATE if a not in ("--prompt", "a")]


def test_a_run_directory_means_its_model(run_dir, capsys):
    assert main([*GENERATE, "--model", str(run_dir)]) == 0
    assert f"--model {run_dir} is a run directory; using its model {run_dir / 'model'}" in capsys.readouterr().err


def test_a_directory_without_a_model_says_what_to_pass(tmp_path, capsys):
    assert main([*GENERATE, "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == (f"rdepth generate: error: --model {tmp_path} has no config.json: expected a saved model directory "
                   f"(config.json, model.safetensors, tokenizer.json) or a run directory holding one in model/")
    assert "--tokenizer" not in err


def test_a_lora_adapter_given_as_the_model_says_how_to_use_it(tmp_path, capsys):
    """An `rdepth sft --lora` run's model/ is an adapter: "has no config.json" alone sent users looking
    for a missing file."""
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    for argv in ([*GENERATE, "--model", str(tmp_path)], ["export", "--model", str(tmp_path), "--out",
                                                          str(tmp_path / "o")]):
        assert main(argv) == 2
        err = [line for line in capsys.readouterr().err.strip().splitlines() if "error" in line]
        assert len(err) == 1 and "it is a LoRA adapter (adapter_config.json): load its base model with it (--lora " \
            "on the command line of rdepth generate, serve, eval and analyze, peft=ADAPTER in rdepth lm-eval's" \
            in err[0], err
    assert main(["analyze", "--model", str(tmp_path), "--prompt", "a"]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "error" in line]
    assert len(err) == 1 and "--lora on the command line of rdepth generate, serve, eval and analyze" in err[0], err
    data = tmp_path / "chats.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    assert main(["sft", "--init-from", str(tmp_path), "--data", str(data), "--out", str(tmp_path / "r")]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "error" in line]
    assert len(err) == 1 and "it is a LoRA adapter (adapter_config.json): merge it" in err[0], err


@pytest.mark.parametrize("argv, usage, hint", [
    (["generate", "--model", "m", "--prompt", "a", "--num", "16"], "usage: rdepth generate",
     "unrecognized arguments: --num 16 (--num: did you mean --num-steps?)"),  # a prefix is no longer taken
    (["tokenizer", "train", "--vocab", "300"], "usage: rdepth tokenizer train",
     "(--vocab: did you mean --vocab-size?)"),
    (["average", "--out", "x", "--checkpoints", "a", "--lats", "2"], "usage: rdepth average",
     "(--lats: did you mean --last"),
])
def test_a_mistyped_flag_gets_the_commands_usage_and_the_closest_flag(argv, usage, hint, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.startswith(usage) and hint in err and "usage: rdepth [-h]" not in err


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("command", ["generate", "eval", "eval-baseline"])
def test_a_plain_transformers_directory_points_to_retrofit_and_loop(run_dir, tmp_path, capsys, family, command):
    # GPT-2's n_embd used to pass for an official Huginn config; Llama's keys were listed as unknown ones
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from recurrent_depth.data.tokenizer import save_tokenizer, train_tokenizer

    plain = tmp_path / family
    if family == "llama":
        LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2)).save_pretrained(plain)
    else:
        GPT2LMHeadModel(GPT2Config(vocab_size=300, n_embd=16, n_layer=2, n_head=2)).save_pretrained(plain)
    save_tokenizer(train_tokenizer(["def f(x):\n    return x\n"], vocab_size=300), plain)
    argv = {
        "generate": [*GENERATE, "--model", str(plain)],
        "eval": ["eval", "--model", str(plain), "--out", str(tmp_path / "o")],
        "eval-baseline": ["eval", "--model", str(run_dir / "model"), "--baseline", str(plain),
                          "--out", str(tmp_path / "o")],
    }[command]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: config.json is a transformers '{family}' checkpoint, not a recurrent-depth one: convert it " \
           "with `rdepth retrofit` (Llama, Mistral, Phi-3, Qwen2, Qwen3, OLMo-2, Gemma 1 / 2 / 3) or loop its middle " \
           "layers with " \
           "`rdepth loop`" in err


def test_a_mistyped_yaml_key_gets_the_closest_key(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("max_step: 3\n")
    assert main(["train", "--config", str(tmp_path / "run.yaml"), "--threads", "1"]) == 2
    assert "unknown training config key(s) ['max_step'] ('max_step': did you mean 'max_steps'" in \
        capsys.readouterr().err


def test_no_parser_takes_abbreviations():
    import argparse

    from recurrent_depth.cli import build_parser

    def parsers(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    yield from parsers(child)

    found = list(parsers(build_parser()))
    assert len(found) > 15 and not [p.prog for p in found if p.allow_abbrev]


def test_prompt_file_and_stdin(tmp_path, monkeypatch, capsys, run_dir):
    import io
    import json

    base = [*NO_PROMPT, "--model", str(run_dir / "model"), "--json", "--init-scale", "0"]
    assert main([*base, "--prompt", "a=1"]) == 0
    want = json.loads(capsys.readouterr().out)["completions"]
    (tmp_path / "p.txt").write_text("a=1")
    assert main([*base, "--prompt-file", str(tmp_path / "p.txt")]) == 0
    assert json.loads(capsys.readouterr().out)["completions"] == want
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"a=1")))
    assert main([*base, "--prompt-file", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["prompts"] == ["a=1"]
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    assert main([*base, "--prompt-file", str(tmp_path / "bad.txt")]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err
    assert main(base) == 2
    assert "give a prompt: --prompt TEXT or --prompt-file FILE" in capsys.readouterr().err


def test_a_closed_pipe_ends_quietly(monkeypatch, capsys):
    class ClosedPipe:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    assert main(["info", "--preset", "tiny"]) == 0  # was: "error: [Errno 32] Broken pipe", exit 2
    assert capsys.readouterr().err == ""


def test_progress_bars_only_on_a_terminal(tmp_path, capsys):
    from recurrent_depth.data.prepare import _progress

    list(_progress(iter(range(3)), 3, "train", enabled=True))  # stderr here is not a terminal
    assert "tokenising" not in capsys.readouterr().err


def test_time_limits_one_spelling_each_old_names_kept():
    """Wall clock: --max-minutes (train, quickstart; quickstart's --minutes kept); CPU time: --max-cpu-minutes."""
    from recurrent_depth.cli import build_parser

    assert build_parser("quickstart").parse_args(["quickstart", "--max-minutes", "3"]).minutes == 3
    assert build_parser("quickstart").parse_args(["quickstart", "--minutes", "3"]).minutes == 3
    assert build_parser("train").parse_args(["train", "--max-minutes", "3"]).max_minutes == 3
    assert build_parser("loop").parse_args(["loop", "pretrain", "--max-cpu-minutes", "3"]).max_cpu_minutes == 3


def test_serve_finds_a_port_in_use_before_loading_the_model(tmp_path, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the model directory does not exist: the port is checked first, so that is not what is reported
        assert main(["serve", "--model", str(tmp_path / "absent"), "--port", str(port), "--threads", "1"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"rdepth serve: error: cannot listen on 127.0.0.1:{port}: ") and "pick another --port" in err


def test_the_servers_step_cap_names_its_flag():
    from recurrent_depth.serving.protocol import APIError, Limits, parse_completion

    limits = Limits(max_seq_len=96, mean_recurrence=4, vocab_size=256, max_num_steps=16)
    with pytest.raises(APIError, match=r"at most 16 \(set by rdepth serve --max-num-steps\)"):
        parse_completion({"prompt": "x", "num_steps": 17}, limits, {"m"})


def test_the_librarys_own_warnings_print_as_one_line_of_the_command(monkeypatch, capsys, recwarn):
    """A library warning (QK-clip's shared-gain rule, ignored config keys) printed Python's two-line
    `path:line: UserWarning: ...` form with the source line under it; another package's keeps that form."""
    import warnings

    import recurrent_depth.cli.info as info
    from recurrent_depth.train import qk_clip

    def run(args):
        warnings.warn_explicit("gamma is shared", UserWarning, qk_clip.__file__, 61)
        warnings.warn_explicit("from elsewhere", UserWarning, "/elsewhere/module.py", 7)
        return 0

    monkeypatch.setattr(info, "run", run)
    shown = warnings.showwarning
    assert main(["info", "--preset", "tiny"]) == 0
    assert warnings.showwarning is shown  # put back after the command
    err = capsys.readouterr().err.splitlines()
    assert "rdepth info: warning: gamma is shared" in err
    assert not any("UserWarning: gamma" in line for line in err)
    assert not any("from elsewhere" in line for line in err)  # handed on to the warnings machinery
    assert [str(w.message) for w in recwarn] == ["from elsewhere"]


@pytest.mark.parametrize("argv", [
    ["train", "--max-steps", "1", "--out", "{file}"],
    ["train", "--max-steps", "1", "--out", "{dir}/run", "--data-dir", "{file}"],
    ["tokenizer", "train", "--vocab-size", "300", "--out", "{file}"],
    ["average", "--checkpoints", "{dir}/ckpt", "--out", "{file}"],
], ids=["train-out", "train-data-dir", "tokenizer-out", "average-out"])
def test_an_output_path_that_is_a_file_is_named_before_any_work(argv, tmp_path, capsys):
    """These said only "[Errno 17] File exists: 'afile'", `train --data-dir` after training a tokenizer and
    `tokenizer train` after its whole training."""
    (tmp_path / "afile").write_text("keep")
    args = [a.format(file=tmp_path / "afile", dir=tmp_path) for a in argv]
    assert main(args) == 2
    flag = args[args.index(str(tmp_path / "afile")) - 1]
    assert capsys.readouterr().err.strip().endswith(f"{flag} {tmp_path / 'afile'} is an existing file, not a "
                                                    "directory; choose another path")
    assert (tmp_path / "afile").read_text() == "keep" and not (tmp_path / "run").exists()
