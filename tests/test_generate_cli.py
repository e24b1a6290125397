"""`rdepth generate` and the tokenizer-facing parts of generation (stop strings, streaming text)."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.inference import generate

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i)\n",
    "class Stack:\n    def push(self, x):\n        self.items.append(x)\n",
]


# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model with its own byte-level BPE tokenizer (trained on a few strings)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|end|>"], show_progress=False)
    tok.train_from_iterator(TEXTS, trainer)
    cfg = rd.ModelConfig.from_preset("tiny")
    cfg.vocab_size = 320
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(cfg)
    path = tmp_path_factory.mktemp("model")
    model.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def loaded(model_dir):
    return rd.RecurrentDepthLM.from_pretrained(model_dir).eval(), Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def api_text(loaded, prompt: str, **kw) -> str:
    model, tok = loaded
    out = generate(model, tok.encode(prompt).ids, tokenizer=tok, **kw)
    return tok.decode(out.token_lists()[0])


def test_cli_streams_the_same_text_as_the_api(model_dir, loaded, capsys):
    code = main(["generate", "--model", str(model_dir), "--prompt", "def add", "--max-new-tokens", "8",
                 "--num-steps", "3", "--init-scale", "0"])
    assert code == 0
    captured = capsys.readouterr()
    expected = api_text(loaded, "def add", max_new_tokens=8, num_steps=3, init_scale=0.0)
    assert captured.out == "def add" + expected + "\n"
    assert "tokens=8" in captured.err and "mean_steps=3.0" in captured.err
    assert "exits: fixed 7, prefill 1" in captured.err


def test_cli_json_batch_with_adaptive_exit(model_dir, loaded, capsys):
    code = main(["generate", "--model", str(model_dir), "--prompt", "for i", "--prompt", "The quick brown",
                 "--max-new-tokens", "5", "--num-steps", "6", "--exit-criterion", "kl", "--exit-threshold", "0.01",
                 "--init-scale", "0", "--json"])
    assert code == 0
    record = json.loads(capsys.readouterr().out)
    for prompt, completion, steps in zip(record["prompts"], record["completions"], record["steps"]):
        assert completion == api_text(loaded, prompt, max_new_tokens=5, num_steps=6, exit_criterion="kl",
                                      exit_threshold=0.01, init_scale=0.0)
        assert steps[0] == 6 and all(1 <= s <= 6 for s in steps)
    assert record["stats"]["mode"] == "autoregressive"


@pytest.mark.parametrize("flags", [
    ["--draft-steps", "1", "--lookahead", "3"],
    ["--parallel", "--inner-steps", "3"],
    ["--parallel", "--inner-steps", "2", "--wavefront", "2", "--exit-criterion", "latent-diff"],
    ["--kv-budget", "2", "--warm-start"],
    ["--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.05", "--seed", "3"],
    ["--kv-policy", "shared-2+skip", "--exit-criterion", "kl"],
], ids=["speculative", "parallel", "parallel-wavefront", "budget+warm", "sampling", "kv-policy"])
def test_cli_modes_run(model_dir, capsys, flags):
    code = main(["generate", "--model", str(model_dir), "--prompt", "class", "--max-new-tokens", "4",
                 "--num-steps", "3", "--no-stream", *flags])
    assert code == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("class") and "tokens=4" in captured.err


def test_cli_bad_arguments_exit_with_a_message(model_dir, capsys):
    assert main(["generate", "--model", str(model_dir), "--prompt", "x", "--kv-budget", "0"]) == 2
    assert main(["generate", "--model", str(model_dir), "--prompt", "x", "--kv-policy", "shared-0"]) == 2
    assert "--kv-budget=0" in capsys.readouterr().err  # the flag, in the caller's terms (issue 17)
    assert main(["generate", "--model", str(model_dir / "missing"), "--prompt", "x"]) == 2
    assert "no such directory" in capsys.readouterr().err  # not "has no tokenizer.json"


def test_cli_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    assert "--exit-criterion" in text and "(default: 64)" in text and "--draft-steps" in text


def test_stop_strings_end_a_row(loaded):
    model, tok = loaded
    kw = dict(max_new_tokens=12, num_steps=3, init_scale=0.0)
    ids = tok.encode("def add").ids
    free = generate(model, ids, **kw).token_lists()[0]
    text = tok.decode(free)
    target = text[len(text) // 2 : len(text) // 2 + 2]
    out = generate(model, ids, stop=[target], tokenizer=tok, **kw)
    tokens = out.token_lists()[0]
    assert tokens == free[: len(tokens)] and out.finish_reasons == ["stop"]
    assert target in tok.decode(tokens) and target not in tok.decode(tokens[:-1])


def test_cli_stop_takes_text_and_stop_id_takes_token_ids(model_dir, loaded, capsys):
    """--stop is text (its help used to promise token ids too); --stop-id N stops at a token id, as stop=[N]."""
    model, tok = loaded
    kw = dict(max_new_tokens=8, num_steps=3, init_scale=0.0)
    free = generate(model, tok.encode("def add").ids, **kw).token_lists()[0]
    target = free[3]
    base = ["generate", "--model", str(model_dir), "--prompt", "def add", "--max-new-tokens", "8", "--num-steps", "3",
            "--init-scale", "0", "--json"]
    assert main([*base, "--stop-id", str(target), "--stop", "@@never@@"]) == 0
    record = json.loads(capsys.readouterr().out)
    api = generate(model, tok.encode("def add").ids, stop=[target], **kw)
    assert record["tokens"] == api.token_lists() and record["tokens"][0][-1] == target
    assert record["finish_reasons"] == ["stop"]
    assert main([*base, "--stop", str(target)]) == 0  # the digits as text, not the id
    assert json.loads(capsys.readouterr().out)["tokens"] == [free]


def test_stream_events_carry_text(loaded):
    from recurrent_depth.inference import stream_generate

    model, tok = loaded
    stream = stream_generate(model, tok.encode("for").ids, max_new_tokens=5, num_steps=2, tokenizer=tok)
    events = list(stream)
    assert [e.text for e in events] == [tok.decode([t]) for t in stream.output.token_lists()[0]]


@pytest.mark.parametrize("strategy", ["full", "latest-m4-compress-s4", "always-last-m4"])
def test_cli_takes_official_lookup_strategies(model_dir, loaded, capsys, strategy):
    code = main(["generate", "--model", str(model_dir), "--prompt", "for i", "--max-new-tokens", "5",
                 "--num-steps", "6", "--exit-criterion", "kl", "--exit-threshold", "0.01", "--init-scale", "0",
                 "--kv-policy", strategy, "--json"])
    assert code == 0
    record = json.loads(capsys.readouterr().out)
    assert record["completions"][0] == api_text(loaded, "for i", max_new_tokens=5, num_steps=6, exit_criterion="kl",
                                                exit_threshold=0.01, init_scale=0.0, kv_policy=strategy)
    assert main(["generate", "--model", str(model_dir), "--prompt", "x", "--kv-policy", "compress-s3"]) == 2
    assert "compress-s3" in capsys.readouterr().err  # tiny has 2 core layers: s3 would mix them


def test_cli_json_refuses_stream_and_names_a_bad_threshold(model_dir, capsys):
    # --stream --json used to print the streamed text and then the JSON object on stdout (not JSON)
    assert main(["generate", "--model", str(model_dir), "--prompt", "x", "--max-new-tokens", "2",
                 "--num-steps", "1", "--stream", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--json" in captured.err and "--stream" in captured.err
    # a threshold that is not a number named argparse's type function ("invalid _threshold value")
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(model_dir), "--prompt", "x", "--exit-criterion", "kl",
              "--exit-threshold", "foo"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--exit-threshold" in err and "'auto'" in err and "_threshold" not in err


@pytest.mark.parametrize("flags,words", [
    (["--draft-steps", "1"], "self-speculative decoding (--draft-steps=1) re-runs positions"),
    (["--sampler", "parallel"], "the parallel sampler (--sampler='parallel') re-runs positions"),
    (["--kv-quant", "k=mse:4,v=mse:4"], "--kv-quant="),  # (the library's kv_quant= was shown in place of the flag)
    (["--exit-criterion", "gate"], "--exit-criterion='gate' reads the model's learned exit gate"),
], ids=["speculative", "parallel", "kv-quant", "gate"])
def test_cli_refuses_a_mode_the_model_cannot_run_before_printing_the_prompt(model_dir, tmp_path, capsys, flags,
                                                                           words):
    # the streamed prompt used to reach stdout first: "def add" and the error on one terminal line
    cfg = rd.ModelConfig.from_preset("tiny")
    cfg.vocab_size, cfg.mixer = 320, {"core": "gated_deltanet"}
    torch.manual_seed(0)
    rd.RecurrentDepthLM(cfg).save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    assert main(["generate", "--model", str(tmp_path), "--prompt", "def add", "--max-new-tokens", "2",
                 "--num-steps", "2", "--stream", *flags]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and words in captured.err


def test_cli_default_depth_keeps_the_depth_ceiling(model_dir, capsys):
    # `--max-depth 2` on a model of mean_recurrence 4 ran every token at depth 4 when --num-steps was left out
    assert rd.ModelConfig.from_preset("tiny").mean_recurrence == 4
    assert main(["generate", "--model", str(model_dir), "--prompt", "x", "--max-new-tokens", "2",
                 "--max-depth", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "mean_recurrence=4" in err and "--num-steps" in err and "--max-depth" in err
    assert main(["generate", "--model", str(model_dir), "--prompt", "x", "--max-new-tokens", "2",
                 "--max-depth", "2", "--num-steps", "2", "--no-stream"]) == 0
    assert "mean_steps=2.0" in capsys.readouterr().err


def test_a_flag_the_mode_ignores_is_one_warning_line_in_flag_spelling(model_dir, capsys):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        code = main(["generate", "--model", str(model_dir), "--prompt", "def add", "--max-new-tokens", "2",
                     "--num-steps", "2", "--init-scale", "0", "--lookahead", "3", "--no-stream"])
    assert code == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert notes == ["rdepth generate: warning: --lookahead=3 has no effect without speculative decoding "
                     "(set --draft-steps)"]


def test_the_generation_config_files_seed_is_used_unless_seed_is_given(model_dir, tmp_path, capsys):
    """The flag --seed defaulted to 0, so the file's seed never applied (the docs list it among the fields read)."""
    import shutil

    with_file = tmp_path / "model"
    shutil.copytree(model_dir, with_file)
    (with_file / "generation_config.json").write_text(json.dumps({"do_sample": True, "seed": 11}))

    def tokens(model, *flags: str) -> list:
        argv = ["generate", "--model", str(model), "--prompt", "def add", "--max-new-tokens", "8",
                "--num-steps", "2", "--json", *flags]
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)["tokens"]

    seeded = tokens(model_dir, "--do-sample", "--seed", "11")
    assert tokens(with_file) == seeded
    assert tokens(with_file, "--seed", "0") == tokens(model_dir, "--do-sample")  # the flag wins; 0 stays the default
    assert seeded != tokens(model_dir, "--do-sample")  # (the seed matters here)
