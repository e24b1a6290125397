"""Data pipeline bugs a seeded fuzzer found (random text / JSONL / Parquet corpora, random prepare settings): each
test fails on the code before its fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from recurrent_depth.data import corpus as corpus_module
from recurrent_depth.data.corpus import DirectoryCorpus, load_corpus
from recurrent_depth.data.prepare import prepare_dataset
from recurrent_depth.data.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["def f(x):\n    return x + 1\n" * 20, "hello world, a text file\n" * 20], vocab_size=300)


@pytest.mark.parametrize("chunk", [None, 1])
def test_a_file_holding_a_cut_bom_is_not_utf8(tmp_path: Path, monkeypatch, chunk: int | None) -> None:
    """The "utf-8-sig" incremental decoder read a file of b"\\xef" or b"\\xef\\xbb" (a BOM cut short: not UTF-8) as
    an empty document instead of skipping it, as the one-shot decoder and the JSONL reader refuse it. A whole BOM
    is still dropped, also when it arrives a byte at a time."""
    if chunk is not None:
        monkeypatch.setattr(corpus_module, "_BINARY_SNIFF_BYTES", chunk)
        monkeypatch.setattr(corpus_module, "_READ_CHUNK_BYTES", chunk)
    (tmp_path / "cut1").write_bytes(b"\xef")
    (tmp_path / "cut2").write_bytes(b"\xef\xbb")
    (tmp_path / "whole").write_bytes(b"\xef\xbb\xbf")
    (tmp_path / "text").write_bytes(b"\xef\xbb\xbfh\xc3\xa9 \xef\xbb\xbf")
    corpus = DirectoryCorpus(tmp_path)
    assert [(d.id, d.text) for d in corpus] == [("text", "hé \ufeff"), ("whole", "")]
    assert corpus.num_skipped == 2


def test_a_file_named_like_a_part_of_a_large_file_is_one_line(tmp_path: Path, monkeypatch) -> None:
    """A file over PART_BYTES is read as documents "<path>#part-00001", ...; a file actually named "a#part-00001"
    beside it gave two documents one id, and Corpus.info() raised a bare AssertionError (a traceback from
    prepare_dataset and rdepth tokenizer train)."""
    monkeypatch.setattr(corpus_module, "PART_BYTES", 10)
    (tmp_path / "a").write_text("line one\nline two\nline three\n")
    (tmp_path / "a#part-00001").write_text("x")
    with pytest.raises(ValueError, match=r"'a#part-00001' in .* is named like a part of the large file 'a'"):
        load_corpus(str(tmp_path)).info()
    (tmp_path / "a#part-00001").write_text("a large one too\n" * 2)  # ("a#part-00001#part-00001": out of order)
    with pytest.raises(ValueError, match=r"'a#part-00001' in .* is named like a part of the large file 'a'"):
        load_corpus(str(tmp_path)).info()
    (tmp_path / "a#part-00001").write_text("x")
    (tmp_path / "a#part-00001").rename(tmp_path / "b#part-00001")  # (no large file "b": an ordinary name)
    docs = list(load_corpus(str(tmp_path)))
    assert [d.id for d in docs] == [f"a#part-{k:05d}" for k in range(1, 5)] + ["b#part-00001"]
    assert "".join(d.text for d in docs[:4]) == "line one\nline two\nline three\n" and docs[4].text == "x"


def test_an_out_dir_inside_a_directory_corpus_is_refused(tmp_path: Path, tok) -> None:
    """Shards written inside the directory being read became documents: the validation pass read train.json written
    moments before, the data key described other documents than those packed, and every later run saw a new corpus
    (its own dataset.json and indexes), so the cache was never reused."""
    for i in range(6):
        (tmp_path / f"f{i}.txt").write_text(f"doc {i} hello world\n" * 3)
    with pytest.raises(ValueError, match=r"lies inside the corpus directory .*--data-dir"):
        prepare_dataset(str(tmp_path), tok, 4, tmp_path / "prepared", val_fraction=0.5, seed=0)
    assert not (tmp_path / "prepared").exists()
    hidden = tmp_path / ".cache" / "data"  # (a hidden directory is not read: allowed, and cached)
    first = prepare_dataset(str(tmp_path), tok, 4, hidden, val_fraction=0.5, seed=0)
    again = prepare_dataset(str(tmp_path), tok, 4, hidden, val_fraction=0.5, seed=0)
    assert first.metadata["corpus"]["num_documents"] == 6 and again.metadata["reused"]
    assert prepare_dataset(DirectoryCorpus(tmp_path, suffixes=[".txt"]), tok, 4, tmp_path / "p", val_fraction=0.5)


def test_a_saved_dataset_of_no_rows_is_named_as_empty(tmp_path: Path) -> None:
    """save_to_disk of a dataset with no rows writes a state.json whose '_data_files' is []: the error said state.json
    "must list the .arrow files", as if the file were damaged; it is an empty dataset."""
    pytest.importorskip("datasets")
    (tmp_path / "state.json").write_text('{"_data_files": [], "_fingerprint": "x", "_split": null}')
    (tmp_path / "dataset_info.json").write_text('{"features": {"text": {"dtype": "string", "_type": "Value"}}}')
    with pytest.raises(ValueError, match=r"is a saved dataset of no rows \(state.json lists no .arrow file\)"):
        load_corpus(str(tmp_path))
