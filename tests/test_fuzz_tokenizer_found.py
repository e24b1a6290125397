"""What a seeded fuzzer over `rdepth tokenizer` and data/tokenizer.py found (random corpora, settings and edited
tokenizer directories), each minimised to a test."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import recurrent_depth.data.tokenizer as tokenizer_module
from recurrent_depth.cli import main as cli_main
from recurrent_depth.data.packing import tokenize_documents
from recurrent_depth.data.tokenizer import (
    MAX_TRAINED_VOCAB_SIZE,
    build_tokenizer,
    load_tokenizer,
    save_tokenizer,
    slot_tokens,
    train_tokenizer,
)

CORPUS = ["hello world foo bar baz\n" * 20, "def f(x):\n    return x + 1\n" * 20, "naïve café 日本語\r\n" * 10]
TEXT = "hello world foo bar baz def f(x): naïve café"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(CORPUS, 320), out)
    return out


def _edited(saved: Path, tmp_path: Path, edit: object) -> Path:
    """A copy of the saved tokenizer directory with `edit(tokenizer.json as a dict)` applied."""
    out = tmp_path / "edited"
    shutil.copytree(saved, out)
    data = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    edit(data)  # type: ignore[operator]
    (out / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    return out


def test_a_tokenizer_file_s_truncation_and_padding_cut_and_pad_nothing(saved: Path, tmp_path: Path) -> None:
    """A tokenizer.json with its own truncation and padding (hub files carry them) was loaded with both on: every
    training document was cut to max_length ids and padded with pad ids, every prompt too (transformers'
    AutoTokenizer encodes the whole text); a padding of 2**40 ids aborted the process."""
    from transformers import AutoTokenizer

    def edit(data: dict) -> None:
        data["truncation"] = {"max_length": 3, "stride": 0, "strategy": "LongestFirst", "direction": "Right"}
        data["padding"] = {"strategy": {"Fixed": 40}, "direction": "Right", "pad_to_multiple_of": None,
                           "pad_id": 0, "pad_type_id": 0, "pad_token": "!"}

    edited = _edited(saved, tmp_path, edit)
    whole = load_tokenizer(saved).encode(TEXT).ids
    assert 3 < len(whole) < 40
    tok = load_tokenizer(edited)
    assert tok.encode(TEXT).ids == whole == AutoTokenizer.from_pretrained(edited)(TEXT)["input_ids"]
    assert [ids.tolist() for ids in tokenize_documents([TEXT, "hi"], tok)] == \
        [whole[1:], load_tokenizer(saved).encode("hi", add_special_tokens=False).ids]


def test_encode_with_a_tokenizer_whose_regex_gives_up_is_one_error_line(
        saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A tokenizer.json whose pre-tokenizer regex backtracks exponentially panics in Rust on some texts: `rdepth
    tokenizer encode` ended in a traceback (pyo3's PanicException) where `rdepth generate` and the server answer
    one line."""
    def edit(data: dict) -> None:
        data["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"(\w+\s?)*$"

    edited = _edited(saved, tmp_path, edit)
    assert cli_main(["tokenizer", "encode", "--model", str(edited), "hello"]) == 0
    capsys.readouterr()
    assert cli_main(["tokenizer", "encode", "--model", str(edited), "a" * 30 + "!"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(
        "rdepth tokenizer: error: the tokenizer failed on this text: Onig: Regex search error")


def test_a_vocab_size_past_the_trainer_s_reach_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--vocab-size 2147483647` (in the documented range) made the BPE trainer reserve 141 GB for its tables: the
    process aborted ("memory allocation ... failed"), no error line."""
    def no_trainer(*args: object, **kwargs: object) -> None:
        raise AssertionError("built the BPE trainer")

    monkeypatch.setattr(tokenizer_module.trainers, "BpeTrainer", no_trainer)
    for size in (2**31 - 1, MAX_TRAINED_VOCAB_SIZE + 1):
        with pytest.raises(ValueError, match=rf"vocab_size must be at most {MAX_TRAINED_VOCAB_SIZE} .* got {size}$"):
            train_tokenizer(CORPUS, size)


def test_a_bad_vocab_size_fails_before_the_corpus_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """build_tokenizer checked the size only in train_tokenizer, after reading (hashing) the whole corpus."""
    def no_corpus(*args: object, **kwargs: object) -> None:
        raise AssertionError("read the corpus before checking vocab_size")

    monkeypatch.setattr(tokenizer_module, "load_corpus", no_corpus)
    for size in (100, 2**31 - 1):
        with pytest.raises(ValueError, match="vocab_size must be"):
            build_tokenizer(str(tmp_path), size)


def test_a_byte_symbol_as_special_token_fails_before_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A one-character special token of the byte-level alphabet ('é', 'Ġ', 'A') is always a byte symbol's token,
    so it was refused only after the whole training ("already a learned token")."""
    with pytest.raises(ValueError, match="'é' is the spelling of a byte symbol"):
        slot_tokens(["<|tool|>", "é"])
    assert slot_tokens(["日"])[6] == "日"  # (not a byte symbol: three bytes)

    def no_training(*args: object, **kwargs: object) -> None:
        raise AssertionError("trained before checking the special tokens")

    monkeypatch.setattr(tokenizer_module, "train_tokenizer", no_training)
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"text": TEXT}) + "\n", encoding="utf-8")
    assert cli_main(["tokenizer", "train", "--data", str(data), "--vocab-size", "300", "--special-token", "Ġ",
                     "--out", str(tmp_path / "out")]) == 2
    assert "'Ġ' is the spelling of a byte symbol" in capsys.readouterr().err


def test_a_tokenizer_file_with_a_byte_order_mark_is_named(saved: Path, tmp_path: Path) -> None:
    """A tokenizer.json saved with a UTF-8 byte-order mark (Windows editors) was refused as "expected value at
    line 1 column 1", which names nothing that the file shows."""
    out = tmp_path / "bom"
    shutil.copytree(saved, out)
    (out / "tokenizer.json").write_bytes(b"\xef\xbb\xbf" + (saved / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="starts with a UTF-8 byte-order mark, which JSON readers refuse"):
        load_tokenizer(out)
