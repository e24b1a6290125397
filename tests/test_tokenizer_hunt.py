"""`rdepth tokenizer train` and `train_tokenizer` on a user's own corpus: output, early checks, misuse."""

from __future__ import annotations

from pathlib import Path

import pytest

import recurrent_depth.data.tokenizer as tokenizer_module
from recurrent_depth.cli import main as cli_main
from recurrent_depth.data.tokenizer import build_tokenizer, train_tokenizer


def _corpus(tmp_path: Path) -> Path:
    data = tmp_path / "corpus"
    data.mkdir()
    for i in range(4):
        (data / f"d{i}.txt").write_text(f"naïve café {i}\r\n\tdef handler_{i}(path):\n    return path\n",
                                        encoding="utf-8")
    return data


def test_cli_train_prints_no_blank_progress_lines_to_a_pipe(tmp_path: Path,
                                                            capfd: pytest.CaptureFixture[str]) -> None:
    """The `tokenizers` progress bar, always on, wrote three blank lines to a non-terminal stdout (a log
    file, `| tee`) ahead of the summary."""
    out = tmp_path / "tok"
    assert cli_main(["tokenizer", "train", "--data", str(_corpus(tmp_path)), "--vocab-size", "300",
                     "--out", str(out)]) == 0
    lines = capfd.readouterr().out.splitlines()
    assert lines[0].startswith("trained a 300-token byte-level BPE") and "" not in lines


def test_a_bad_assistant_name_fails_before_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The name was only checked when saving, after the whole (at 65536 tokens, hour-long) training."""
    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("trained before checking assistant_name")

    monkeypatch.setattr(tokenizer_module, "train_tokenizer", no_training)
    with pytest.raises(ValueError, match="assistant_name must be"):
        build_tokenizer(str(_corpus(tmp_path)), 300, out_dir=tmp_path / "tok", assistant_name="a{b")
    assert not (tmp_path / "tok").exists()


def test_one_string_as_docs_is_refused_by_name() -> None:
    """A str is iterable: each character became one document, and the error blamed vocab_size
    ("the corpus only supports 0 merges ...; use a smaller vocab_size")."""
    text = "hello world " * 50
    with pytest.raises(ValueError, match="got one string; pass \\[text\\]"):
        train_tokenizer(text, 290)
    tok = train_tokenizer([text], 290)
    assert tok.decode(tok.encode(text).ids) == text


def test_own_special_tokens_take_the_reserved_slots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A user's own special tokens (tool-call markers, ...) had no way in: the CLI and API took none."""
    from transformers import AutoTokenizer

    out = tmp_path / "tok"
    assert cli_main(["tokenizer", "train", "--data", str(_corpus(tmp_path)), "--vocab-size", "300",
                     "--special-token", "<|tool_call|>", "--special-token", "<|tool_result|>",
                     "--out", str(out)]) == 0
    assert 'your special token ids: {"<|tool_call|>": 274, "<|tool_result|>": 275}' in capsys.readouterr().out
    hf = AutoTokenizer.from_pretrained(out)
    ids = hf("a<|tool_call|>b<|tool_result|>", add_special_tokens=False)["input_ids"]
    assert ids[1] == 274 and ids[3] == 275 and len(ids) == 4
    assert hf.decode(ids, skip_special_tokens=True) == "ab"
    assert hf.convert_ids_to_tokens([268, 273, 276]) == ["<|begin_text|>", "<|pad|>", "<|reserved_special_2|>"]
    for bad, reason in [(["<|pad|>"], "built-in special token"), (["x", "x"], "given twice"),
                        ([" x"], "without surrounding whitespace"), (["t"] * 27, "at most 26")]:
        with pytest.raises(ValueError, match=reason):
            train_tokenizer(["ab ab"], 290, extra_special_tokens=bad)
    with pytest.raises(ValueError, match="'ab' is already a learned token"):
        train_tokenizer(["ab ab ab"], 289, extra_special_tokens=["ab"])
