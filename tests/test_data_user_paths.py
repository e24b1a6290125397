"""A user's own data: JSONL lines that are not UTF-8 or have no end, corpora without text, big files beside
similarly named ones, and a saved tokenizer that pads batches for generation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import recurrent_depth.data.corpus as corpus_module
from recurrent_depth.data import prepare_dataset
from recurrent_depth.data.corpus import DirectoryCorpus, JsonlCorpus
from recurrent_depth.data.tokenizer import MIN_VOCAB_SIZE, build_tokenizer, save_tokenizer, train_tokenizer


@pytest.mark.parametrize("bad", [b"\xff\xfe{}", b'{"text": "caf\xc3("}'], ids=["utf16-bom-bytes", "bad-continuation"])
def test_a_jsonl_line_that_is_not_utf8_is_named_as_such(tmp_path: Path, bad: bytes) -> None:
    """It said "not valid JSON ('utf-16-le' codec can't decode ...)": json.loads(bytes) guessed the encoding."""
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'{"text": "ok"}\n' + bad + b"\n")
    with pytest.raises(ValueError, match=r"data\.jsonl:2: not valid UTF-8 \(byte 0x"):
        list(JsonlCorpus(path))


def test_a_bad_byte_after_a_bom_is_named_at_its_own_place(tmp_path: Path) -> None:
    """The first line's BOM is stripped before decoding: the byte and place named were the BOM's (0xbf at 3)."""
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"a\xff": 1}\n')
    with pytest.raises(ValueError, match=r"data\.jsonl:1: not valid UTF-8 \(byte 0xff at byte 7 of the line\)$"):
        list(JsonlCorpus(path))


def test_a_jsonl_file_may_start_with_a_utf8_bom(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "first"}\r\n{"text": "second"}\r\n')
    assert [d.text for d in JsonlCorpus(path)] == ["first", "second"]


def test_a_jsonl_line_past_the_bound_is_refused(tmp_path: Path, monkeypatch) -> None:
    """A JSONL file with no newline (a 10 GB JSON array) was read as one line, whole, into memory."""
    monkeypatch.setattr(corpus_module, "JSONL_MAX_LINE_BYTES", 40)
    path = tmp_path / "data.jsonl"
    fits = json.dumps({"text": "x" * 28})  # 40 bytes: exactly the bound
    assert len(fits) == 40
    path.write_text(fits + "\n" + json.dumps({"text": "y" * 29}) + "\n")
    with pytest.raises(ValueError, match=r"data\.jsonl:2: line longer than 40 bytes"):
        list(JsonlCorpus(path))


def test_a_corpus_without_text_is_named_by_build_tokenizer_and_prepare_dataset(tmp_path: Path) -> None:
    """prepare_dataset left out the skipped-file count the docs promise; an all-empty corpus was blamed on
    vocab_size ("supports 0 merges")."""
    tok = train_tokenizer(["hello world " * 20], MIN_VOCAB_SIZE)
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "a.txt").write_bytes(b"\xff\xfe not UTF-8")
    with pytest.raises(ValueError, match=r"has no documents \(1 file\(s\) skipped: binary or not UTF-8\)"):
        prepare_dataset(str(binary), tok, 8, tmp_path / "out1")
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n{"text": ""}\n')
    message = r"empty\.jsonl' has 2 document\(s\), all of them empty"
    with pytest.raises(ValueError, match=message):
        build_tokenizer(str(empty), 300)
    with pytest.raises(ValueError, match=message):
        prepare_dataset(str(empty), tok, 8, tmp_path / "out2")


def test_a_file_read_in_parts_keeps_documents_sorted_beside_a_similar_name(tmp_path: Path, monkeypatch) -> None:
    """`big.txt` (read in parts: `big.txt#part-...`) beside `big.txt copy`: the ids came out of order and
    `info()` failed with an AssertionError (a traceback)."""
    monkeypatch.setattr(corpus_module, "PART_BYTES", 100)
    (tmp_path / "big.txt").write_text("line\n" * 50)
    (tmp_path / "big.txt copy").write_text("small")
    corpus = DirectoryCorpus(tmp_path)
    ids = [d.id for d in corpus]
    assert ids == sorted(ids) and ids[0] == "big.txt copy" and len(ids) == 4
    assert corpus.info().num_documents == 4


def test_a_saved_tokenizer_pads_batches_on_the_left_for_generation(tmp_path: Path) -> None:
    """`model.generate(**tok(batch, padding=True))` on a decoder-only model needs left padding; the config said
    "right" (transformers only warns, and the short rows' continuations come after their padding)."""
    from transformers import AutoTokenizer

    tok = train_tokenizer(["hello world, a longer text " * 20], MIN_VOCAB_SIZE)
    hf = AutoTokenizer.from_pretrained(save_tokenizer(tok, tmp_path / "tok"))
    assert hf.padding_side == "left"
    batch = hf(["hello", "hello world, a longer text"], padding=True)
    short, long = batch["input_ids"]
    assert batch["attention_mask"][0][0] == 0 and batch["attention_mask"][0][-1] == 1
    assert short[0] == hf.pad_token_id  # the padding first, then the prompt, ending in the last column
    assert short[-len(tok.encode("hello").ids):] == tok.encode("hello").ids and len(short) == len(long)
