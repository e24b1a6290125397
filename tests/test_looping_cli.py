"""`rdepth loop search|eval|pretrain` on a tiny random Llama with the project's tokenizer (no downloads)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from recurrent_depth.cli import main
from recurrent_depth.data import save_tokenizer, special_token_ids, train_tokenizer
from recurrent_depth.looping import from_pretrained, loop_of
from recurrent_depth.looping.evaluate import candidate_windows, held_out_windows, loop_grid, windows_loss

TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n    y: int = 0\n" * 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    tok = train_tokenizer([TEXT], vocab_size=300)
    specials = special_token_ids(tok)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=specials["begin_text"],
        eos_token_id=specials["end_text"], pad_token_id=specials["pad"],
    ))
    model.save_pretrained(path)
    save_tokenizer(tok, path)
    return path


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "held_out.py"
    path.write_text(TEXT)
    return path


def test_eval_prints_loss_against_k_and_writes_results(model_dir, text_file, tmp_path, capsys):
    out = tmp_path / "eval"
    code = main(["loop", "eval", "--model", str(model_dir), "--data", str(text_file), "--windows", "1-2,3",
                 "--iterations", "1,2,4", "--rules", "naive,damped", "--max-tokens", "60", "--seq-len", "16",
                 "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "K=4" in printed and "[1,2]" in printed and "[3,3]" in printed
    results = json.loads((out / "results.json").read_text())
    assert results["tokens"] == 60
    labels = [r["label"] for r in results["results"]]
    assert labels[0] == "base" and len(labels) == 1 + 2 * 2 * 2  # base + windows x K>1 x rules
    losses = [r["loss"] for r in results["results"]]
    assert len(set(losses)) > 1  # the loops change the model


def test_search_saves_the_best_loop_and_eval_reads_it_back(model_dir, text_file, tmp_path, capsys):
    saved = tmp_path / "looped"
    code = main(["loop", "search", "--model", str(model_dir), "--data", str(text_file), "--widths", "1,2",
                 "--iterations", "2", "--max-tokens", "40", "--seq-len", "16", "--out", str(tmp_path / "s"),
                 "--save", str(saved)])
    assert code == 0
    results = json.loads((tmp_path / "s" / "results.json").read_text())
    best = results["best"]
    assert best["loss"] == min(r["loss"] for r in results["results"][1:])
    assert json.loads((saved / "config.json").read_text())["loop"] == best["config"]
    assert (saved / "tokenizer.json").is_file()
    assert loop_of(from_pretrained(str(saved))).to_dict() == best["config"]
    capsys.readouterr()
    assert main(["loop", "eval", "--model", str(saved), "--data", str(text_file), "--max-tokens", "20",
                 "--seq-len", "16", "--iterations", "1,3", "--out", str(tmp_path / "e")]) == 0
    window = f"[{best['config']['start']},{best['config']['end']}]"
    assert window in capsys.readouterr().out


def test_eval_of_a_stored_loop_scores_its_rule_mode_and_beta(model_dir, text_file, tmp_path):
    """`rdepth loop eval --model LOOPED` scores the stored loop (docs/looping.md): it took the stored window
    only, and scored a damped block loop over it whatever rule, mode and β were stored."""
    saved = tmp_path / "looped"
    assert main(["loop", "search", "--model", str(model_dir), "--data", str(text_file), "--widths", "2",
                 "--iterations", "2", "--rules", "rk", "--modes", "layer", "--beta", "0.3", "--max-tokens", "20",
                 "--seq-len", "16", "--out", str(tmp_path / "s"), "--save", str(saved)]) == 0
    stored = json.loads((saved / "config.json").read_text())["loop"]
    assert (stored["rule"], stored["mode"], stored["beta"]) == ("rk", "layer", 0.3)
    assert main(["loop", "eval", "--model", str(saved), "--data", str(text_file), "--max-tokens", "20",
                 "--seq-len", "16", "--iterations", "2,3", "--out", str(tmp_path / "e")]) == 0
    configs = [r["config"] for r in json.loads((tmp_path / "e" / "results.json").read_text())["results"][1:]]
    assert [(c["start"], c["end"], c["rule"], c["mode"], c["beta"], c["iterations"]) for c in configs] == [
        (stored["start"], stored["end"], "rk", "layer", 0.3, k) for k in (2, 3)]
    # options still override the stored loop
    assert main(["loop", "eval", "--model", str(saved), "--data", str(text_file), "--max-tokens", "20",
                 "--seq-len", "16", "--iterations", "2", "--rules", "naive", "--out", str(tmp_path / "e2")]) == 0
    configs = [r["config"] for r in json.loads((tmp_path / "e2" / "results.json").read_text())["results"][1:]]
    assert [(c["rule"], c["mode"]) for c in configs] == [("naive", "layer")]


def test_search_saves_a_bf16_source_in_bf16(model_dir, text_file, tmp_path):
    """The search scores in float32; --save wrote those float32 weights, so a bf16 source doubled in size
    although looping changes no weight. The saved weights are the source's, bit for bit, in its dtype."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    source = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (model_dir / name).is_file():
            (source / name).write_bytes((model_dir / name).read_bytes())
    saved = tmp_path / "looped"
    assert main(["loop", "search", "--model", str(source), "--data", str(text_file), "--widths", "1",
                 "--iterations", "2", "--max-tokens", "20", "--seq-len", "16", "--out", str(tmp_path / "s"),
                 "--save", str(saved)]) == 0
    assert json.loads((saved / "config.json").read_text())["dtype"] == "bfloat16"
    before, after = load_file(source / "model.safetensors"), load_file(saved / "model.safetensors")
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--windows", "9"], "does not fit a model with 4 decoder layers"),
        ([], "--windows is needed"),
        (["--windows", "1", "--seq-len", "1"], "--seq-len must be an integer >= 2, got 1"),  # (said "positive")
        (["--windows", "1", "--seq-len", "4096"], "--seq-len 4096 is longer than the model's 2048 positions"),
    ],
)
def test_eval_bad_input_is_one_line_error(model_dir, text_file, capsys, argv, message):
    assert main(["loop", "eval", "--model", str(model_dir), "--data", str(text_file), *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        # every K = 1 left nothing to rank: an IndexError at `ranked[0]`
        (["search", "--widths", "1", "--iterations", "1"], "--iterations 1 gives nothing to search"),
        # a device torch cannot parse (or this machine lacks) raised from deep inside `.to(device)`
        (["eval", "--windows", "1", "--device", "nodevice"], "device 'nodevice' is not a torch device"),
    ],
)
def test_search_and_device_bad_input_is_one_line_error(model_dir, text_file, tmp_path, capsys, argv, message):
    assert main(["loop", *argv, "--model", str(model_dir), "--data", str(text_file), "--max-tokens", "20",
                 "--seq-len", "16", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and err[-1].startswith("rdepth loop: error:")


@pytest.mark.parametrize("flag", ["--out", "--save"])
def test_an_output_path_that_is_a_file_is_refused_before_scoring(model_dir, text_file, tmp_path, capsys, flag):
    """--out FILE was mkdir's bare "[Errno 17] File exists" after every loop had been scored; --save FILE printed
    "saved the looped model" while transformers' save_pretrained only logged an error and wrote nothing."""
    taken = tmp_path / "taken"
    taken.write_text("keep")
    outputs = {"--out": str(tmp_path / "out"), "--save": str(tmp_path / "saved"), flag: str(taken)}
    argv = ["loop", "search", "--model", str(model_dir), "--data", str(text_file), "--widths", "1", "--iterations",
            "2", "--max-tokens", "20", "--seq-len", "16", "--out", outputs["--out"], "--save", outputs["--save"]]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert f"{flag} {taken} is an existing file" in captured.err and "scoring" not in captured.out
    assert taken.read_text() == "keep"


@pytest.mark.parametrize("action", [["eval", "--windows", "1"], ["search", "--widths", "1"]])
def test_seq_len_past_a_learned_position_table_is_one_line_error(tmp_path, text_file, capsys, action):
    # GPT-2's position table would raise an IndexError mid-forward
    path = tmp_path / "gpt2"
    tok = train_tokenizer([TEXT], vocab_size=300)
    GPT2LMHeadModel(GPT2Config(vocab_size=tok.get_vocab_size(), n_embd=16, n_layer=2, n_head=2,
                               n_positions=32)).save_pretrained(path)
    save_tokenizer(tok, path)
    argv = ["loop", *action, "--model", str(path), "--data", str(text_file), "--seq-len", "33", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "--seq-len 33 is longer than the model's 32 positions" in capsys.readouterr().err
    model = GPT2LMHeadModel.from_pretrained(path)
    with pytest.raises(ValueError, match="held-out window length 40 is longer than the model's 32 positions"):
        windows_loss(model, [[1] * 40])


def test_missing_model_dir_is_one_line_error(tmp_path, capsys):
    assert main(["loop", "search", "--model", str(tmp_path / "nope")]) == 2
    assert "not a model directory" in capsys.readouterr().err


def test_grid_and_windows():
    assert candidate_windows(4, [1, 3]) == [(0, 0), (1, 1), (2, 2), (3, 3), (0, 2), (1, 3)]
    with pytest.raises(ValueError, match="outside 1..4"):
        candidate_windows(4, [5])
    grid = loop_grid([(1, 1), (1, 2)], [1, 2], ["damped"], ["block", "layer"])
    # K = 1 is the base model; a one-layer window is the same in both modes, scored once
    assert [(c.start, c.end, c.mode) for c in grid] == [(1, 1, "block"), (1, 2, "block"), (1, 2, "layer")]


def test_held_out_windows_cover_max_tokens_targets():
    class Tok:
        def encode(self, text, add_special_tokens=False):
            return list(range(len(text)))

    rows = held_out_windows(Tok(), ["abcdefghij", "klmnop"], seq_len=4, max_tokens=11, bos_token_id=99)
    assert sum(len(r) - 1 for r in rows) == 11
    assert rows[0] == [99, 0, 1, 2] and rows[1][0] == 2  # windows overlap by one token


def test_pretrain_writes_a_transformers_model_directory(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.py").write_text(TEXT * (i + 1))
    out = tmp_path / "run"
    argv = ["loop", "pretrain", "--data", str(corpus), "--out", str(out), "--layers", "2", "--hidden-size", "24",
            "--max-steps", "3", "--seq-len", "16", "--vocab-size", "300"]
    assert main(argv) == 0
    assert main(argv) == 0  # a rerun trains from scratch again (the trainer keeps another run's model/, not its own)
    # its own earlier record is replaced, not set aside as an earlier session's (Trainer._start_from_scratch)
    assert not list(out.glob("previous-*")) and len((out / "metrics.jsonl").read_text().splitlines()) == 3
    from recurrent_depth.files import lock_directory

    lock = lock_directory(out)  # (a run training there now: its directory is not cleared)
    assert main(argv) == 2 and (out / "model").is_dir() and (out / "checkpoints").is_dir()
    assert f"is in use by another run in this process (it holds {out / '.rdepth.lock'})" in capsys.readouterr().err
    lock.close()
    summary = json.loads((out / "pretrain.json").read_text())
    assert summary["steps"] == 3 and summary["validation_loss"] > 0
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == 300
    assert AutoTokenizer.from_pretrained(out / "model").bos_token_id == model.config.bos_token_id


def test_pretrain_with_an_odd_head_dim_is_one_line_error_before_any_work(tmp_path, capsys):
    # hidden 36 / 4 heads = 9: transformers refused it (a multi-line StrictDataclassClassValidationError
    # traceback) only after the tokenizer had been trained and the data prepared
    out = tmp_path / "run"
    assert main(["loop", "pretrain", "--data", str(tmp_path / "missing"), "--out", str(out), "--hidden-size", "36",
                 "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rdepth loop: error: PretrainRecipe: hidden_size / num_heads = 9 must be even")
    assert not out.exists()


def test_pretrain_keeps_another_runs_checkpoints(tmp_path, capsys):
    # `--out` naming an `rdepth train` run: its checkpoints were deleted ("the demo always trains from scratch")
    out = tmp_path / "run"
    kept = out / "checkpoints" / "step_00000010" / "model.safetensors"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"weights")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"doc{i}.py").write_text(TEXT * (i + 1))
    assert main(["loop", "pretrain", "--data", str(corpus), "--out", str(out), "--layers", "1", "--hidden-size", "8",
                 "--max-steps", "1", "--seq-len", "16", "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "holds checkpoints that no finished `rdepth loop pretrain` wrote" in err[-1]
    assert kept.read_bytes() == b"weights"


def test_decode_benchmark_counts_the_stash_pass_of_a_last_stash_prefill(model_dir):
    """benchmarks/looping_decode.py: generate's prefill is a cached forward, so stash="last" runs K + 1 window
    passes there (docs/looping.md, 1 + K·w); the prefill FLOPs were reported as 1 + (K − 1)·w."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import looping_decode

    result = looping_decode.main(["--model", str(model_dir), "--window", "1-2", "--iterations", "3",
                                  "--prompt-len", "4", "--new-tokens", "2", "--repeats", "1", "--threads", "1"])
    ratios = {name: (row["prefill_flops_ratio"], row["decode_flops_ratio"]) for name, row in result["modes"].items()}
    # w = 2 / 4 layers, K = 3
    assert ratios == {"base": (1.0, 1.0), "prefill-only": (2.0, 1.0), "every-token first": (2.0, 2.0),
                      "every-token last": (2.5, 2.5)}


def test_eval_of_a_model_with_a_nan_loss_is_one_line_error(model_dir, text_file, tmp_path, capsys):
    broken = tmp_path / "nan"
    model = LlamaForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = float("nan")
    model.save_pretrained(broken)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir / name).is_file():
            (broken / name).write_bytes((model_dir / name).read_bytes())
    assert main(["loop", "eval", "--model", str(broken), "--data", str(text_file), "--windows", "1",
                 "--max-tokens", "20", "--seq-len", "16", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "the base model's held-out loss is nan" in err[-1] and err[-1].startswith("rdepth loop: error:")
    assert not (tmp_path / "out" / "results.json").exists()


def test_search_ranks_a_diverged_loop_last_and_writes_strict_json(model_dir, text_file, tmp_path, monkeypatch):
    from recurrent_depth.looping import evaluate

    def loss(model, windows, batch_size=8, pad_token_id=0):  # K = 2 diverges, K = 3 does not
        loop = loop_of(model)
        return 3.0 if loop is None else (float("nan") if loop.iterations == 2 else 4.0 + loop.start)

    monkeypatch.setattr(evaluate, "windows_loss", loss)
    out = tmp_path / "s"
    assert main(["loop", "search", "--model", str(model_dir), "--data", str(text_file), "--widths", "1",
                 "--iterations", "2,3", "--max-tokens", "20", "--seq-len", "16", "--out", str(out)]) == 0

    def refuse(constant):
        raise AssertionError(f"results.json holds {constant}")

    results = json.loads((out / "results.json").read_text(), parse_constant=refuse)
    assert results["best"]["loss"] == 4.0 and results["best"]["config"]["iterations"] == 3
    assert [r["loss"] for r in results["results"] if r["config"] and r["config"]["iterations"] == 2] == [None] * 4
