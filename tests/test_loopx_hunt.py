"""Bugs found by review of `rdepth loop` scoring and the experiments' configs: `eval --help` named the wrong
default K values, bad --val-fraction / --beta / --iterations were refused only after the model loaded, the
default held-out split ignored the demo model's own `pretrain --seed` (scoring its training documents), and
the experiments accepted a NaN saturation / tau or recurrence 0 (meaningless results, or a late error naming
another config's field)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from recurrent_depth.cli import main
from recurrent_depth.data import save_tokenizer, special_token_ids, train_tokenizer
from recurrent_depth.experiments.logit_growth import LogitGrowthConfig
from recurrent_depth.experiments.mup import MupConfig

TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n" * 4


def test_eval_help_names_the_k_values_eval_scores(capsys):
    with pytest.raises(SystemExit):
        main(["loop", "eval", "--help"])
    helptext = " ".join(capsys.readouterr().out.split())
    assert "(default: 1,2,3,4)" in helptext and "(default: 2,3)" not in helptext  # it said 2,3, and scored 1..4


@pytest.mark.parametrize(("flags", "message"), [
    (["--val-fraction", "0"], "--val-fraction must be in (0, 1), got 0.0"),  # was "no held-out text to score"
    (["--beta", "2"], "--beta must be in [0, 1], got 2.0"),
    (["--iterations", "2,0"], "--iterations must each be in 1..256, got 0"),
])
def test_bad_scoring_values_are_refused_before_the_model_loads(flags, message, tmp_path, capsys):
    # tmp_path holds no model: the old code reached the model load and said "is not a model directory"
    assert main(["loop", "eval", "--model", str(tmp_path), "--windows", "1", *flags,
                 "--out", str(tmp_path / "o")]) == 2
    assert message in capsys.readouterr().err


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """A run directory as `rdepth loop pretrain --seed 1` leaves it: model/ and pretrain.json."""
    run = tmp_path_factory.mktemp("run")
    tok = train_tokenizer([TEXT], vocab_size=300)
    specials = special_token_ids(tok)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, bos_token_id=specials["begin_text"],
        eos_token_id=specials["end_text"], pad_token_id=specials["pad"]))
    model.save_pretrained(run / "model")
    save_tokenizer(tok, run / "model")
    (run / "pretrain.json").write_text(json.dumps({"recipe": {"val_fraction": 0.05, "seed": 1}}))
    return run


def _scored_split(monkeypatch, argv: list[str]) -> tuple:
    import recurrent_depth.looping.evaluate as evaluate

    seen = []
    original = evaluate.held_out_texts

    def spy(data, val_fraction=0.02, seed=0, max_docs=None):
        seen.append((data, val_fraction, seed))
        return original(data, val_fraction, seed, max_docs)

    monkeypatch.setattr(evaluate, "held_out_texts", spy)
    assert main(argv) == 0
    return seen[0]


def test_stdlib_scoring_defaults_to_the_demo_models_own_split(demo_run, tmp_path, monkeypatch):
    """`pretrain --seed 1` splits the documents with seed 1; seed 0's validation documents are all in its training
    split, and `search` / `eval` scored them by default."""
    common = ["--data", "stdlib", "--windows", "0", "--iterations", "2", "--max-tokens", "24", "--seq-len", "12"]
    out = tmp_path / "o"
    assert _scored_split(monkeypatch, ["loop", "eval", "--model", str(demo_run), *common, "--out", str(out)]) == \
        ("stdlib", 0.05, 1)
    results = json.loads((out / "results.json").read_text())
    assert (results["val_fraction"], results["split_seed"]) == (0.05, 1)
    # the flags still win; a model without a pretrain.json beside it keeps 0.02 and seed 0
    assert _scored_split(monkeypatch, ["loop", "eval", "--model", str(demo_run), *common, "--split-seed", "3",
                                       "--out", str(out)]) == ("stdlib", 0.05, 3)
    alone = tmp_path / "alone"
    shutil.copytree(demo_run / "model", alone)
    assert _scored_split(monkeypatch, ["loop", "eval", "--model", str(alone), *common, "--out", str(out)]) == \
        ("stdlib", 0.02, 0)


@pytest.mark.parametrize(("field", "value"), [
    ("saturation", float("nan")),  # never saturated: T_sat None everywhere, after the whole run
    ("qk_clip_tau", float("nan")),  # refused by TrainConfig only when the first qk-clip run started
    ("aux_lr", -1.0),
    ("recurrence", 0),  # was "TrainConfig.backprop_depth=0 is invalid"
    ("batch_size", 0),
    ("hidden_size", 0),
])
def test_logit_growth_refuses_bad_values_up_front(field, value):
    with pytest.raises(ValueError, match=f"^{field}="):
        LogitGrowthConfig(**{field: value})


@pytest.mark.parametrize("field", ["recurrence", "batch_size", "seq_len"])
def test_mup_config_refuses_a_zero_depth_batch_or_window(field):
    with pytest.raises(ValueError, match=f"^{field}=0 is invalid"):
        MupConfig(**{field: 0})


@pytest.mark.parametrize("command", ["logit-growth", "coord-check"])
def test_a_bad_corpus_leaves_no_empty_out(tmp_path, capsys, command):
    """The experiments made --out before loading the corpus: a typo in --corpus left an empty folder behind."""
    out = tmp_path / "run"
    assert main(["experiment", command, "--corpus", str(tmp_path / "missing"), "--out", str(out)]) != 0
    assert "missing" in capsys.readouterr().err and not out.exists()
