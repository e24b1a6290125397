"""Regressions found by a seeded fuzzer over `rdepth sweep`, `experiment`, `loop` and `retrofit`."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM

from recurrent_depth.cli import main
from recurrent_depth.scaling.sweep import plan_sweep

BASE = {"preset": "tiny", "data": "stdlib", "seq_len": 32, "batch_size": 4, "max_steps": 2}
TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n" * 8


def last_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    return err[-1]


# ------------------------------------------------------------------------------------------------ sweep
@pytest.mark.parametrize("sweep, message", [
    # both set one token budget: the run's name spelled both, its train.yaml held one of them
    ({"runs": [{"tokens": 1000, "max_tokens": 2000}]}, "tokens and max_tokens set one setting twice"),
    ({"grid": {"tokens": [1000], "max_tokens": [2000]}}, "tokens and max_tokens set one setting twice"),
    # the sweep replaced them with test_depths unseen (a run named eval_depths=_3_ was evaluated at [1])
    ({"grid": {"eval_depths": [[3]]}}, "grid: eval_depths is set by the sweep"),
    ({"base": {**BASE, "eval_depths": [7]}, "grid": {"seed": [0]}}, "base.eval_depths is set by the sweep"),
    # a non-recurrent run is forced to backprop_depth 1: the run named backprop_depth=4 trained with 1
    ({"runs": [{"mean_recurrence": 1, "backprop_depth": 4}]}, "backprop_depth=4 contradicts"),
    # abspath("") is the current directory: the runs trained on whatever files were there
    ({"base": {**BASE, "data": ""}, "grid": {"seed": [0]}}, "TrainConfig.data='' is invalid"),
])
def test_sweep_plans_that_would_run_other_settings_than_recorded_are_refused(sweep, message):
    data = {"base": BASE, "test_depths": [1], **sweep}
    with pytest.raises(ValueError, match=message):
        plan_sweep(data)


@pytest.mark.parametrize("plan", [
    {"runs": [{"name": 5, "overrides": {}, "config": {}}], "test_depths": [1], "threads_per_run": 1},
    {"runs": [{"name": "../../elsewhere", "overrides": {}, "config": {}}], "test_depths": [1], "threads_per_run": 1},
])
@pytest.mark.parametrize("action", ["status", "collect"])
def test_a_damaged_sweep_plan_is_one_line(tmp_path, capsys, plan, action):
    """A run name that is not a directory name: an int was a TypeError traceback, "../x" read outside the sweep."""
    (tmp_path / "sweep.json").write_text(json.dumps(plan))
    assert main(["sweep", action, str(tmp_path)]) == 2
    assert "is damaged: run name" in last_error(capsys)


def test_sweep_run_refuses_threads_per_run_each_run_would_refuse(tmp_path, capsys):
    """threads_per_run above `rdepth train --threads`' ceiling: every run failed at its start (the reason only in
    each sweep.log) after the shared tokenizer and shards had been prepared."""
    config = tmp_path / "s.yaml"
    config.write_text(yaml.safe_dump({"base": BASE, "grid": {"seed": [0]}, "test_depths": [1],
                                      "threads_per_run": 10**6}))
    out = tmp_path / "sweep"
    assert main(["sweep", "run", str(config), "--out", str(out)]) == 2
    assert "threads_per_run 1000000 is more than each run's rdepth train takes here" in last_error(capsys)
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--sbatch", "--time=1:00\n#SBATCH --mem=1"], "holds a line break"),  # (one more line of the script)
    (["--out", "FILE"], "is an existing file, not a directory"),  # (mkdir's bare "[Errno 17] File exists")
])
def test_sweep_emit_refuses_bad_flags_before_any_work(tmp_path, capsys, argv, message):
    config = tmp_path / "s.yaml"
    config.write_text(yaml.safe_dump({"base": BASE, "grid": {"seed": [0]}, "test_depths": [1]}))
    argv = [str(config) if a == "FILE" else a for a in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "sweep")]
    assert main(["sweep", "emit", str(config), "--slurm", *out, *argv]) == 2
    assert message in last_error(capsys)
    assert not (tmp_path / "sweep").exists()


def test_load_corpus_refuses_an_empty_spec(tmp_path, monkeypatch):
    """`--data ""` (an unset shell variable) read the current directory's files as the corpus (loop eval scored
    them as held-out text, loop pretrain and the experiments trained on them)."""
    from recurrent_depth.data import load_corpus

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text(TEXT)
    with pytest.raises(ValueError, match="data: '' is empty"):
        load_corpus("")


# ------------------------------------------------------------------------------------------------ loop
def test_duplicate_iterations_and_widths_are_scored_once():
    """`--iterations 2,2` and `--widths 1,1` scored (and listed in results.json) every configuration twice."""
    from recurrent_depth.looping.evaluate import candidate_windows, loop_grid

    assert candidate_windows(3, [1, 1]) == [(0, 0), (1, 1), (2, 2)]
    grid = loop_grid([(1, 2), (1, 2)], [2, 2, 3], ["naive", "naive"])
    assert [(c.start, c.end, c.iterations) for c in grid] == [(1, 2, 2), (1, 2, 3)]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from recurrent_depth.data import save_tokenizer, special_token_ids, train_tokenizer

    path = tmp_path_factory.mktemp("llama")
    tok = train_tokenizer([TEXT], vocab_size=300)
    specials = special_token_ids(tok)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=specials["begin_text"],
        eos_token_id=specials["end_text"], pad_token_id=specials["pad"],
    )).save_pretrained(path)
    save_tokenizer(tok, path)
    return path


def edited_copy(source, target, change):
    import shutil

    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    change(config)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("change, message", [
    # LlamaConfig's default 32 layers over the 4 stored: 28 random layers scored, exit 0
    (lambda c: c.pop("num_hidden_layers"), "its weights lack"),
    # transformers' validation error (a huggingface_hub exception), a traceback
    (lambda c: c.update(num_attention_heads=3), "cannot load .* as a transformers causal LM: .*attention heads"),
    # the size-mismatch RuntimeError, a traceback
    (lambda c: c.update(num_key_value_heads=4), "cannot load .* as a transformers causal LM"),
])
def test_loop_eval_of_a_config_that_does_not_match_its_weights_is_one_line(llama_dir, tmp_path, capsys, change,
                                                                          message):
    import re

    model = edited_copy(llama_dir, tmp_path / "model", change)
    (tmp_path / "held.py").write_text(TEXT)
    out = tmp_path / "out"
    assert main(["loop", "eval", "--model", str(model), "--data", str(tmp_path / "held.py"), "--windows", "1-2",
                 "--max-tokens", "20", "--seq-len", "8", "--out", str(out)]) == 2
    assert re.search(message, last_error(capsys))
    assert not out.exists()


@pytest.mark.parametrize("argv, message", [
    (["--device", "meta"], "--device meta holds no numbers"),  # (Tensor.item() on a meta tensor: a traceback)
    (["--save", "MODEL"], "is the --model directory"),  # (the source's config.json was replaced by the looped one)
])
def test_loop_search_refuses_before_scoring(llama_dir, tmp_path, capsys, argv, message):
    model = edited_copy(llama_dir, tmp_path / "model", lambda c: None)
    before = (model / "config.json").read_text()
    argv = [str(model) if a == "MODEL" else a for a in argv]
    (tmp_path / "held.py").write_text(TEXT)
    assert main(["loop", "search", "--model", str(model), "--data", str(tmp_path / "held.py"), "--widths", "1",
                 "--max-tokens", "20", "--seq-len", "8", "--out", str(tmp_path / "out"), *argv]) == 2
    assert message in last_error(capsys)
    assert (model / "config.json").read_text() == before


@pytest.mark.parametrize("argv, message", [
    (["--out", "CORPUS/run"], "lies inside --data"),  # (its tokenizer was written into the corpus first)
    (["--vocab-size", "5"], "vocab_size must be in [288"),  # (after --out and its lock file were made)
    (["--hidden-size", "1000000000"], "--hidden-size must be at most"),  # (torch's allocation error, a traceback)
])
def test_loop_pretrain_refuses_before_writing(tmp_path, capsys, argv, message):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"doc{i}.py").write_text(TEXT * (i + 1))
    argv = [a.replace("CORPUS", str(corpus)) for a in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "run")]
    assert main(["loop", "pretrain", "--data", str(corpus), "--layers", "1", "--hidden-size", "8", "--max-steps", "1",
                 "--seq-len", "16", "--vocab-size", "300", *out, *argv]) == 2
    assert message in last_error(capsys)
    assert not (tmp_path / "run").exists() and sorted(p.name for p in corpus.iterdir()) == [
        "doc0.py", "doc1.py", "doc2.py"]


# ------------------------------------------------------------------------------------------------ experiments
@pytest.mark.parametrize("argv, message", [
    # every run of the variant ran twice (the summary keeping one)
    (["logit-growth", "--variants", "plain,plain"], "each once"),
    (["coord-check", "--parametrizations", "mup,mup"], "each once"),
    # refused at the first run's model, after an empty --out had been made
    (["logit-growth", "--num-heads", "3", "--hidden-size", "8"], "ModelConfig.num_heads=3 is invalid"),
    (["logit-growth", "--seq-len", "100000000"], "needs a corpus of at least"),
    (["coord-check", "--seq-len", "100000000"], "needs a corpus of at least"),
])
def test_experiments_refuse_before_making_out(tmp_path, capsys, argv, message):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "doc.py").write_text(TEXT * 20)
    out = tmp_path / "out"
    assert main(["experiment", *argv, "--corpus", str(corpus), "--out", str(out)]) == 2
    assert message in last_error(capsys)
    assert not out.exists()
