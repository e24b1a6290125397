"""Pretraining data in the formats users hold: Parquet files (one, or a directory of shards) and Hugging Face
datasets saved with `save_to_disk`, read as JSONL is: the same ids, rules, token stream and data key."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from recurrent_depth.cli import main as cli_main  # noqa: E402
from recurrent_depth.data import corpus as corpus_module  # noqa: E402
from recurrent_depth.data.corpus import ParquetCorpus, SavedDatasetCorpus, load_corpus  # noqa: E402
from recurrent_depth.data.prepare import prepare_dataset  # noqa: E402
from recurrent_depth.data.tokenizer import train_tokenizer  # noqa: E402

TEXTS = [f"def f_{i}(x):\n    return x * {i} + {i * i}\n" * (1 + i % 3) for i in range(24)] + [""]


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


def write_parquet(path: Path, columns: dict[str, list], row_group_size: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)
    return path


def save_to_disk(path: Path, columns: dict[str, list], splits: tuple[str, ...] = ()) -> Path:
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict(columns)
    saved = datasets.DatasetDict({split: table for split in splits}) if splits else table
    saved.save_to_disk(str(path))
    return path


def split_rows(prepared, split: str) -> np.ndarray:
    return np.concatenate([b.numpy() for b in prepared.dataset(split, shuffle=False).iter_batches(64)])


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(TEXTS, 300)


@pytest.mark.parametrize("fmt", ["parquet", "saved"])
def test_the_same_texts_give_the_token_stream_and_key_of_a_jsonl_file(tmp_path: Path, tok, fmt: str) -> None:
    """Ids are the record numbers JSONL gives its lines, so the validation documents, the packed rows (both
    splits, shuffled) and the data key are those of the JSONL file: converting a corpus changes nothing."""
    jsonl = write_jsonl(tmp_path / "docs.jsonl", TEXTS)
    if fmt == "parquet":  # row groups of 5 and batches of 4: boundaries must not show in the stream
        other = write_parquet(tmp_path / "docs.parquet", {"text": TEXTS, "n": list(range(len(TEXTS)))}, 5)
    else:
        other = save_to_disk(tmp_path / "saved", {"text": TEXTS})
    corpus_module.TABLE_BATCH_ROWS, saved_rows = 4, corpus_module.TABLE_BATCH_ROWS
    try:
        want = prepare_dataset(str(jsonl), tok, 12, tmp_path / "a", val_fraction=0.25, seed=3)
        got = prepare_dataset(str(other), tok, 12, tmp_path / "b", val_fraction=0.25, seed=3)
    finally:
        corpus_module.TABLE_BATCH_ROWS = saved_rows
    assert got.metadata["corpus"]["kind"] == ("parquet" if fmt == "parquet" else "datasets")
    assert got.metadata["corpus"]["sha256"] == want.metadata["corpus"]["sha256"]
    assert got.metadata["key"] == want.metadata["key"]
    for split in ("train", "validation"):
        assert got.metadata["splits"][split]["documents"] == want.metadata["splits"][split]["documents"] > 0
        np.testing.assert_array_equal(split_rows(got, split), split_rows(want, split))


def test_a_directory_of_parquet_files_is_read_in_path_order_with_cheap_ids(tmp_path: Path) -> None:
    root = tmp_path / "shards"
    write_parquet(root / "b" / "000.parquet", {"text": ["b0", "b1"]})
    write_parquet(root / "a.parquet", {"text": ["a0"]})
    write_parquet(root / "a.parquet x.parquet", {"text": ["ax"]})  # sorts before "a.parquet/..." as an id
    (root / "_SUCCESS").write_text("")  # Spark's marker, not data
    write_parquet(root / "_temporary" / "0.parquet", {"text": ["half-written"]})
    corpus = load_corpus(str(root))
    assert isinstance(corpus, ParquetCorpus)
    docs = list(corpus)
    assert [d.text for d in docs] == ["ax", "a0", "b0", "b1"]
    assert [d.id for d in docs] == ["a.parquet x.parquet/line-0000000001", "a.parquet/line-0000000001",
                                    "b/000.parquet/line-0000000001", "b/000.parquet/line-0000000002"]
    assert list(corpus.ids()) == [d.id for d in docs]  # (from the row counts: no text read)
    assert corpus.info().num_documents == 4  # (info() checks the ids are sorted)
    (root / "README.md").write_text("# shards\n")
    with pytest.raises(ValueError, match=r"holds \.parquet files and other files \('README\.md'\)"):
        load_corpus(str(root))


def test_bad_records_are_one_line_errors_naming_the_file_and_row(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "d.parquet", {"text": ["a", "b", "c", "d", None], "n": [1, 2, 3, 4, 5]}, 2)
    corpus_module.TABLE_BATCH_ROWS, saved_rows = 2, corpus_module.TABLE_BATCH_ROWS
    try:  # row 5 is in the third batch: rows are numbered across batches
        with pytest.raises(ValueError, match=rf"^{path.resolve()}:row 5: field 'text' is null;"):
            list(load_corpus(str(path)))
    finally:
        corpus_module.TABLE_BATCH_ROWS = saved_rows
    with pytest.raises(ValueError, match=rf"^{path.resolve()}: missing column 'body' \(columns: \['text', 'n'\]\)"):
        load_corpus(str(path), text_field="body").info()
    with pytest.raises(ValueError, match=rf"^{path.resolve()}: column 'n' must hold strings, got int64$"):
        load_corpus(str(path), text_field="n").info()
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="x.parquet: not a readable Parquet file"):
        list(load_corpus(str(tmp_path / "x.parquet")))
    saved = save_to_disk(tmp_path / "saved", {"body": ["a", None]})
    with pytest.raises(ValueError, match=rf"^{saved.resolve()}:row 2: field 'body' is null;"):
        list(load_corpus(str(saved), text_field="body"))


def test_a_saved_dataset_dict_gives_its_train_split(tmp_path: Path) -> None:
    saved = save_to_disk(tmp_path / "dd", {"body": ["one", "two"]}, splits=("train", "test"))
    corpus = load_corpus(str(saved), text_field="body")
    assert isinstance(corpus, SavedDatasetCorpus)
    assert [(d.id, d.text) for d in corpus] == [("line-0000000001", "one"), ("line-0000000002", "two")]
    no_train = save_to_disk(tmp_path / "nt", {"body": ["x"]}, splits=("test",))
    with pytest.raises(ValueError, match=r"splits \['test'\] and no 'train'"):
        load_corpus(str(no_train), text_field="body")


def test_a_text_field_for_whole_text_files_is_an_error_not_ignored(tmp_path: Path) -> None:
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("hello\n")
    with pytest.raises(ValueError, match=r"text_field \(--text-field\) 'body' .* 'stdlib' is read as whole"):
        load_corpus("stdlib", text_field="body")
    with pytest.raises(ValueError, match=r"^data: text_field \(--text-field\) 'body' picks a field of"):
        load_corpus(str(texts), text_field="body")
    assert [d.text for d in load_corpus(str(texts), text_field="text")] == ["hello\n"]  # the default: harmless


def test_the_data_key_changes_when_a_parquet_file_changes(tmp_path: Path, tok) -> None:
    path = write_parquet(tmp_path / "docs.parquet", {"text": TEXTS})
    first = prepare_dataset(str(path), tok, 12, tmp_path / "data", val_fraction=0.2)
    assert prepare_dataset(str(path), tok, 12, tmp_path / "data", val_fraction=0.2).metadata["reused"]
    write_parquet(path, {"text": [*TEXTS[:-2], TEXTS[-2] + "# edited\n", TEXTS[-1]]})
    again = prepare_dataset(str(path), tok, 12, tmp_path / "data", val_fraction=0.2)
    assert not again.metadata["reused"] and again.metadata["key"] != first.metadata["key"]


def test_rdepth_tokenizer_train_reads_parquet_and_refuses_a_text_field_for_text_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_parquet(tmp_path / "docs.parquet", {"body": TEXTS})
    out = tmp_path / "tok"
    assert cli_main(["tokenizer", "train", "--data", str(path), "--text-field", "body", "--vocab-size", "290",
                     "--out", str(out)]) == 0
    assert json.loads((out / "tokenizer_training.json").read_text())["corpus"]["kind"] == "parquet"
    capsys.readouterr()
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.py").write_text("import os\n")
    assert cli_main(["tokenizer", "train", "--data", str(texts), "--text-field", "body", "--out", str(out),
                     "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    assert "leave --text-field out" in err and len(err.splitlines()) == 1


def test_untrusted_parquet_files_are_bounded_one_line_errors_naming_the_file_and_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value over the bound of a JSONL line (refused from the footer's claim when a row group is one huge row,
    before it is read), bytes that are not UTF-8, a text column named twice and a damaged page: one line each."""
    monkeypatch.setattr(corpus_module, "TABLE_MAX_VALUE_BYTES", 200)
    huge = write_parquet(tmp_path / "huge.parquet", {"text": ["ok", "x" * 1000]}, row_group_size=1)
    with pytest.raises(ValueError, match=rf"^{huge.resolve()}:row 2: field 'text' takes [\d,]+ bytes, more than "
                                         r"200 a row; split the documents"):
        list(load_corpus(str(huge)))
    texts = ["a" * 50] * 3 + ["y" * 500] + ["b" * 50] * 30  # short on average: only the value is too long
    long = write_parquet(tmp_path / "long.parquet", {"text": texts})
    # (refused from its page's header, before the page is decoded: the page's rows are named)
    with pytest.raises(ValueError, match=rf"^{long.resolve()}:rows 1-34: field 'text' has a page of [\d,]+ bytes, "
                                         r"more than 200"):
        list(load_corpus(str(long)))
    not_utf8 = pa.array([b"fine", b"\xed\xa0\x80 a lone surrogate"]).view(pa.string())  # (pyarrow writes it as is)
    bad = write_parquet(tmp_path / "bad.parquet", {"text": not_utf8})
    with pytest.raises(ValueError, match=rf"^{bad.resolve()}:row 2: field 'text' is not valid UTF-8$"):
        list(load_corpus(str(bad)))
    twice = tmp_path / "twice.parquet"
    pq.write_table(pa.Table.from_arrays([pa.array(["a"]), pa.array(["b"])], names=["text", "text"]), twice)
    with pytest.raises(ValueError, match=r"twice.parquet: 2 columns are named 'text'; the text column must be named"):
        load_corpus(str(twice)).info()
    monkeypatch.undo()  # (at 200 bytes, its page would be refused for its size before it is read)
    damaged = bytearray(write_parquet(tmp_path / "damaged.parquet", {"text": ["z" * 1000] * 50}).read_bytes())
    damaged[25:70] = bytes(45)  # the first (dictionary) page's snappy data zeroed; its header and the footer intact
    (tmp_path / "damaged.parquet").write_bytes(damaged)
    with pytest.raises(ValueError, match=r"damaged.parquet: cannot be read \(Corrupt snappy compressed data"):
        list(load_corpus(str(tmp_path / "damaged.parquet")))


def test_a_fifo_named_parquet_is_never_opened_nor_decides_the_format(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.parquet"
    os.mkfifo(fifo)  # (opening it would block until a writer came)
    with pytest.raises(ValueError, match=r"^data: '.*pipe\.parquet' is not a regular file or a directory;"):
        load_corpus(str(fifo))
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("hello\n")
    os.mkfifo(texts / "b.parquet")
    corpus = load_corpus(str(texts))  # a directory of text files: the FIFO is skipped, as any special file
    assert corpus.kind == "directory" and [d.text for d in corpus] == ["hello\n"]


def test_a_saved_dataset_reads_no_file_outside_its_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    outside = save_to_disk(tmp_path / "outside", {"text": ["secret"]})
    saved = save_to_disk(tmp_path / "saved", {"text": ["mine"]})
    arrow = next(saved.glob("*.arrow")).name
    state = json.loads((saved / "state.json").read_text())
    state["_data_files"] = [{"filename": f"../outside/{arrow}"}]
    (saved / "state.json").write_text(json.dumps(state))
    with pytest.raises(ValueError, match=r"state.json names '\.\./outside/.*' as a data file; expected the name of"):
        load_corpus(str(saved))
    state["_data_files"] = [{"filename": arrow}]
    (saved / "state.json").write_text(json.dumps(state))
    (saved / arrow).unlink()
    (saved / arrow).symlink_to(outside / arrow)  # the symlink rule of a text directory
    with pytest.raises(ValueError, match=rf"'{arrow}' in .* is a symlink to .*outside.*pass --follow-symlinks"):
        load_corpus(str(saved))
    assert [d.text for d in load_corpus(str(saved), follow_symlinks=True)] == ["secret"]
    monkeypatch.setattr(corpus_module, "SAVED_JSON_MAX_BYTES", 10)
    with pytest.raises(ValueError, match=r"saved': dataset_info.json holds [\d,]+ bytes, more than 10;"):
        load_corpus(str(saved), follow_symlinks=True)
    monkeypatch.undo()
    splits = save_to_disk(tmp_path / "dd", {"text": ["t"]}, splits=("train",))
    shutil.rmtree(splits / "train")
    (splits / "train").symlink_to(outside)  # a DatasetDict's train split that is a link out
    with pytest.raises(ValueError, match=r"split 'train' in .* is a symlink to .*outside"):
        load_corpus(str(splits))
    (splits / "dataset_dict.json").write_text("{}")
    with pytest.raises(ValueError, match=r"dataset_dict.json must list its splits as strings under 'splits', got None"):
        load_corpus(str(splits))
