"""`rdepth eval` inputs that were accepted and ignored, or refused only after the text had been scored."""

from __future__ import annotations

import json

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.evaluation.quality import PlainTokenizer, text_quality
from tests.test_hf import make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")


def test_text_quality_refuses_a_zero_window_instead_of_scoring_whole_ones():
    # seq_len=0 was read as "none" (`seq_len or max_seq_len`) and scored with the model's window
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=288, max_seq_len=16)).eval()
    codec = PlainTokenizer(type("Bytes", (), {"encode": lambda self, t, **_: list(t.encode())})())
    with pytest.raises(ValueError, match=r"seq_len=0 is invalid: expected an integer >= 2"):
        text_quality(model, ["abc" * 10], codec, [1], bos_token_id=256, pad_token_id=0, seq_len=0)


@pytest.mark.parametrize(
    "argv, message",
    [(["--seq-len", "0"], "seq_len=0 is invalid: expected an integer >= 2"),
     (["--seq-len", "1"], "seq_len=1 is invalid: expected an integer >= 2"),
     (["--baseline-depth", "3"], "baseline_depth=3 applies to baseline (--baseline), and none is given"),
     (["--difficulties", "2"], "difficulties=[2] applies to reasoning_tasks (--reasoning), and none is given"),
     (["--limit", "5"], "limit=5 applies to lm_eval_tasks (--lm-eval-tasks), and none is given"),
     (["--reasoning", "chains", "--difficulties", "0,99"], "chains: hops=99 is invalid: expected an integer in")],
    ids=["seq-len-0", "seq-len-1", "baseline-depth-alone", "difficulties-alone", "limit-alone",
         "difficulty-out-of-range"],
)
def test_rdepth_eval_refuses_before_scoring_any_text(tmp_path, capsys, argv, message):
    # each was ignored (seq-len 0, the options without their measurement) or named only after the text scoring
    make_model_dir(tmp_path / "model", max_seq_len=32)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "def f(x):\n    return x\n" * 4}) + "\n")
    assert main(["eval", "--model", str(tmp_path / "model"), "--depths", "1", "--data", str(data),
                 "--val-fraction", "1", "--out", str(tmp_path / "o"), *argv]) == 2
    captured = capsys.readouterr()
    assert "text:" not in captured.out and message in captured.err


def test_rdepth_eval_names_a_model_reasoning_tasks_cannot_use_before_scoring_text(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    # a character tokenizer of 98 tokens, and a model of that vocabulary: text scores, reasoning tasks cannot
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)} | {"[UNK]": len(chars)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(["<|begin_text|>"])
    config = rd.ModelConfig.from_preset("tiny", vocab_size=tok.get_vocab_size(), max_seq_len=32,
                                        bos_token_id=tok.token_to_id("<|begin_text|>"), eos_token_id=None,
                                        pad_token_id=None)
    torch.manual_seed(0)
    rd.RecurrentDepthLM(config).save_pretrained(tmp_path / "model", tokenizer=tok)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": "def f(x):\n    return x\n" * 4}) + "\n")
    assert main(["eval", "--model", str(tmp_path / "model"), "--depths", "1", "--data", str(data),
                 "--val-fraction", "1", "--reasoning", "chains", "--out", str(tmp_path / "o")]) == 2
    captured = capsys.readouterr()
    assert "text:" not in captured.out and "vocabulary >= 288" in captured.err
    assert not (tmp_path / "o").exists()  # (refused after the model loaded: --out was made empty before it)
