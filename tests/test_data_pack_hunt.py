"""Data preparation as a user with their own files meets it: a plain reference for the rows of an odd directory,
directory symlinks, a single-document corpus, a foreign dataset.json, bad seeds and data states."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from recurrent_depth.data.corpus import Document, DocumentListCorpus, DocumentSplit, load_corpus
from recurrent_depth.data.prepare import prepare_dataset
from recurrent_depth.data.shards import ShardDataset
from recurrent_depth.data.tokenizer import special_token_ids, train_tokenizer

SEQ_LEN = 16


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    texts = ["hello world\r\n", "héllo wörld 日本語 🙂 ", "def f():\n    return 1\n", "document 1 2 3 "]
    return train_tokenizer(DocumentListCorpus([t * 20 for t in texts]), vocab_size=300)


def _odd_directory(root: Path) -> Path:
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("hello world\n" * 20)
    (root / "crlf.txt").write_bytes(b"line one\r\nline two\r\n" * 15)
    (root / "empty.txt").write_text("")
    (root / "uni.md").write_text("héllo wörld 日本語 🙂 " * 20)
    (root / "bin.dat").write_bytes(b"\x00\x01\x02" * 100)  # binary: skipped
    (root / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 10)  # not UTF-8: skipped
    (root / "sub" / "b.py").write_text("def f():\n    return 1\n" * 30)
    for i in range(4):
        (root / f"doc{i}.txt").write_text(f"document {i} " * (5 + 7 * i))
    return root


def _reference_rows(texts: list[str], tok: Tokenizer, order_seed: tuple[int, int], keep_all: bool) -> list[list[int]]:
    """Plain rule: literal encoding, seeded document order, <bos> doc <eos> concatenated, a full row ends the
    document unless keep_all, the unfinished last row dropped."""
    literal = Tokenizer.from_str(tok.to_str())
    literal.encode_special_tokens = True
    ids = special_token_ids(tok)
    encoded = [literal.encode(text, add_special_tokens=False).ids for text in texts]
    rows: list[list[int]] = []
    row: list[int] = []
    for i in np.random.default_rng(order_seed).permutation(len(encoded)):
        if not encoded[i]:
            continue
        for token in [ids["begin_text"], *encoded[i], ids["end_text"]]:
            row.append(token)
            if len(row) == SEQ_LEN + 1:
                rows.append(row)
                row = []
                if not keep_all:
                    break
    return rows


@pytest.mark.parametrize("keep_all", [False, True])
def test_prepared_rows_of_an_odd_directory_match_a_plain_reference(tmp_path: Path, tok, keep_all: bool) -> None:
    root = _odd_directory(tmp_path / "corpus")
    prepared = prepare_dataset(root, tok, SEQ_LEN, tmp_path / "out", val_fraction=0.3, seed=5, keep_all=keep_all)
    docs = list(load_corpus(root))
    assert "bin.dat" not in {d.id for d in docs} and "latin1.txt" not in {d.id for d in docs}
    assert next(d.text for d in docs if d.id == "crlf.txt").count("\r\n") == 30  # line endings kept as written
    split = DocumentSplit.plan((d.id for d in docs), 0.3, 5)
    for k, side in enumerate(("train", "validation")):
        texts = [d.text for d in docs if split.is_validation(d.id) == (side == "validation")]
        want = _reference_rows(texts, tok, (5, k), keep_all if side == "train" else True)
        data = prepared.dataset(side, shuffle=False)
        assert [data[i].tolist() for i in range(len(data))] == want


def test_a_directory_symlink_out_is_refused_or_read_with_the_flag(tmp_path: Path) -> None:
    """A directory symlink out of the corpus was silently left out, even with follow_symlinks=True."""
    root, books = tmp_path / "corpus", tmp_path / "books"
    (root / "real").mkdir(parents=True)
    (books / "deep").mkdir(parents=True)
    (root / "a.txt").write_text("a")
    (root / "real" / "r.txt").write_text("r")
    (books / "b.txt").write_text("b")
    (books / "deep" / "c.txt").write_text("c")
    (root / "books").symlink_to(books)
    (root / "again").symlink_to(root / "real")  # a link inside: its files are read once, at their own path
    (books / "deep" / "loop").symlink_to(books)  # a cycle
    (books / "up").symlink_to(tmp_path)  # an ancestor of the corpus
    with pytest.raises(ValueError, match=r"directory 'books' in .* symlink to .*books, outside .*--follow-symlinks"):
        load_corpus(root)
    docs = [(d.id, d.text) for d in load_corpus(root, follow_symlinks=True)]
    assert docs == [("a.txt", "a"), ("books/b.txt", "b"), ("books/deep/c.txt", "c"), ("real/r.txt", "r")]
    os.unlink(root / "books")
    assert [d.id for d in load_corpus(root)] == ["a.txt", "real/r.txt"]


def test_a_single_document_corpus_is_named_not_blamed_on_seq_len(tmp_path: Path, tok) -> None:
    """One document can never fill both sides of a per-document split; the error said 'a larger val_fraction'."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "shakespeare.txt").write_text("To be or not to be, that is the question.\n" * 200)
    for fraction in (0.05, 0.9):
        with pytest.raises(ValueError, match=r"holds a single document.*split its text into several files"):
            prepare_dataset(tmp_path / "corpus", tok, SEQ_LEN, tmp_path / "out", val_fraction=fraction)
    assert prepare_dataset(tmp_path / "corpus", tok, SEQ_LEN, tmp_path / "out", val_fraction=0).val_index is None


@pytest.mark.parametrize("text", ["[1, 2]", '"x"', '{"key": "k", "splits": 3}'])
def test_a_foreign_dataset_json_in_the_output_is_rebuilt(tmp_path: Path, tok, text: str) -> None:
    corpus = DocumentListCorpus([Document(f"d{i}", f"document {i} " * 30) for i in range(6)])
    first = prepare_dataset(corpus, tok, SEQ_LEN, tmp_path, val_fraction=0.3, seed=1)
    (first.out_dir / "dataset.json").write_text(text.replace('"k"', f'"{first.metadata["key"]}"'))  # (the key's own)
    again = prepare_dataset(corpus, tok, SEQ_LEN, tmp_path, val_fraction=0.3, seed=1)
    assert not again.metadata["reused"] and again.metadata["splits"] == first.metadata["splits"]


def test_a_negative_seed_is_refused_up_front(tmp_path: Path, tok) -> None:
    corpus = DocumentListCorpus([f"document {i} " * 30 for i in range(6)])
    with pytest.raises(ValueError, match=r"seed must be an int >= 0, got -1"):
        prepare_dataset(corpus, tok, SEQ_LEN, tmp_path, val_fraction=0.3, seed=-1)
    assert not (tmp_path / "train.json").exists()
    prepared = prepare_dataset(corpus, tok, SEQ_LEN, tmp_path, val_fraction=0.3, seed=0)
    with pytest.raises(ValueError, match=r"seed must be an int >= 0, got -1"):
        ShardDataset(prepared.train_index, seed=-1)


@pytest.mark.parametrize("change", [{"epoch": -1}, {"position": 1.5}, {"seed": None}])
def test_a_damaged_data_state_is_named(tmp_path: Path, tok, change: dict) -> None:
    corpus = DocumentListCorpus([f"document {i} " * 30 for i in range(6)])
    data = prepare_dataset(corpus, tok, SEQ_LEN, tmp_path, val_fraction=0.3).dataset("train", seed=3)
    state = {**data.state_dict(), **change}
    state = {k: v for k, v in state.items() if v is not None}
    key = next(iter(change))
    with pytest.raises(ValueError, match=rf"data state: '{key}' must be an int >= 0"):
        data.load_state_dict(state)


def test_a_text_files_bom_is_not_text(tmp_path: Path) -> None:
    """A UTF-8 BOM starting a text file (Windows editors write one) stayed in the document as U+FEFF, which the
    JSONL reader drops: the same text trained differently by the file it came in. A BOM inside the text stays."""
    (tmp_path / "a.txt").write_bytes(b"\xef\xbb\xbfdef f():\n    return '\xef\xbb\xbf'\n")
    [doc] = list(load_corpus(str(tmp_path)))
    assert doc.text == "def f():\n    return '\ufeff'\n"


def test_a_large_files_parts_fall_on_one_side_of_the_split(tmp_path: Path, monkeypatch) -> None:
    """A file over PART_BYTES is read as parts; each part was split on its own, so one text could be both trained
    on and validated on. Now the parts share their file's key."""
    from recurrent_depth.data import corpus as corpus_module

    monkeypatch.setattr(corpus_module, "PART_BYTES", 100)
    for name in "abcdef":
        (tmp_path / f"{name}.txt").write_text("".join(f"{name} line {i}\n" for i in range(60)))
    docs = list(load_corpus(str(tmp_path)))
    assert len(docs) > 30
    split = DocumentSplit.plan((d.id for d in docs), 0.5, seed=3)
    sides: dict[str, set[bool]] = {}
    for doc in docs:
        sides.setdefault(doc.id.split("#")[0], set()).add(split.is_validation(doc.id))
    assert all(len(s) == 1 for s in sides.values()) and {True, False} == set().union(*sides.values())
