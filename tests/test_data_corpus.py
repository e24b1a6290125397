"""Corpus readers, content hashes and the document-level train/validation split."""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from pathlib import Path

import pytest

from recurrent_depth.data.corpus import (
    STDLIB_EXCLUDED_DIRS,
    DirectoryCorpus,
    Document,
    DocumentListCorpus,
    DocumentSplit,
    JsonlCorpus,
    StdlibCorpus,
    corpus_sha256,
    load_corpus,
)


@pytest.fixture(scope="module")
def stdlib() -> StdlibCorpus:
    return StdlibCorpus()


def test_stdlib_selects_sorted_non_test_python_files(stdlib: StdlibCorpus) -> None:
    files = stdlib.files()
    assert files == sorted(files)
    assert all(f.endswith(".py") for f in files)
    for f in files:
        assert not set(Path(f).parts[:-1]) & STDLIB_EXCLUDED_DIRS, f
    assert "os.py" in files and "json/encoder.py" in files
    # Independent count: every .py under the stdlib root minus the excluded components.
    root = Path(sysconfig.get_paths()["stdlib"])
    expected = [
        p for p in root.rglob("*.py") if not set(p.relative_to(root).parts[:-1]) & STDLIB_EXCLUDED_DIRS
    ]
    assert len(files) == len(expected)
    # DESIGN.md: about 660 files on CPython 3.11; any CPython 3.11+ lands in this band.
    assert 400 <= len(files) <= 1200


def test_stdlib_info_is_deterministic(stdlib: StdlibCorpus) -> None:
    first = stdlib.info()
    again = StdlibCorpus().info()  # a fresh object: no cache shared
    assert first == again
    assert first.num_documents == len(stdlib.files()) - first.num_skipped
    assert 5_000_000 < first.num_bytes < 30_000_000
    assert len(first.sha256) == 64 and first.kind == "stdlib" and first.python_version
    assert first.sha256 == corpus_sha256(stdlib)


def _write_tree(root: Path) -> None:
    (root / "b").mkdir()
    (root / "a.py").write_text("print('a')\n")
    (root / "b" / "c.txt").write_text("naïve café ☕\n", encoding="utf-8")
    (root / "b" / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (root / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    (root / ".hidden").write_text("secret")
    (root / ".git").mkdir()
    (root / ".git" / "HEAD").write_text("ref: main")
    (root / "empty.md").write_text("")


def test_directory_corpus_reads_text_and_counts_skips(tmp_path: Path) -> None:
    _write_tree(tmp_path)
    corpus = DirectoryCorpus(tmp_path)
    docs = list(corpus)
    assert [d.id for d in docs] == ["a.py", "b/c.txt", "empty.md"]
    assert docs[1].text == "naïve café ☕\n"
    assert corpus.num_skipped == 2  # blob.bin (NUL) and latin1.txt (not UTF-8)
    info = corpus.info()
    assert (info.num_documents, info.num_skipped, info.kind) == (3, 2, "directory")
    assert info.num_bytes == sum(len(d.text.encode()) for d in docs)
    assert [d.id for d in DirectoryCorpus(tmp_path, suffixes=[".py"])] == ["a.py"]


def test_hash_changes_with_any_edit(tmp_path: Path) -> None:
    _write_tree(tmp_path)
    before = DirectoryCorpus(tmp_path).info().sha256
    assert DirectoryCorpus(tmp_path).info().sha256 == before
    (tmp_path / "a.py").write_text("print('A')\n")
    edited = DirectoryCorpus(tmp_path).info().sha256
    (tmp_path / "a.py").rename(tmp_path / "z.py")
    renamed = DirectoryCorpus(tmp_path).info().sha256
    assert len({before, edited, renamed}) == 3
    # Length-prefixing: moving text between id and body must change the hash.
    assert corpus_sha256([Document("ab", "c")]) != corpus_sha256([Document("a", "bc")])


def test_jsonl_reads_text_field_and_skips_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "first"}\n\n{"text": "second ☃", "meta": 1}\n')
    docs = list(JsonlCorpus(path))
    assert docs == [Document("line-0000000001", "first"), Document("line-0000000003", "second ☃")]
    assert load_corpus(str(path)).info().num_documents == 2
    other = tmp_path / "other.jsonl"
    other.write_text('{"body": "x"}\n')
    assert [d.text for d in JsonlCorpus(other, text_field="body")] == ["x"]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "not valid JSON"),
        ('{"text": "a"', r"not valid JSON \(Expecting ',' delimiter at column 13\)"),  # (not "line 2 column 1")
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"content": "x"}', "missing field 'text'"),
        ('{"text": 3}', "field 'text' must be a string, got int"),
        ('{"text": "a\\ud800b"}', "field 'text' is not valid Unicode text"),
        ("[" * 100_000 + "]" * 100_000, "JSON nested too deeply to parse"),  # issue 33 item 19
    ],
    ids=["bad-json", "torn", "not-object", "missing-field", "non-string", "lone-surrogate", "nested"],
)
def test_jsonl_bad_lines_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message) as err:
        list(JsonlCorpus(path))
    assert f"{path.resolve()}:2:" in str(err.value)


def test_directory_corpus_accepts_file_names_that_are_not_utf8(tmp_path: Path) -> None:
    # Linux file names are bytes; os.walk hands undecodable ones over with surrogate escapes.
    (tmp_path / "ok.txt").write_text("ok")
    with open(os.path.join(os.fsencode(tmp_path), b"caf\xe9.txt"), "wb") as handle:
        handle.write(b"latin-1 name")
    corpus = DirectoryCorpus(tmp_path)
    info = corpus.info()
    assert info.num_documents == 2 and info.num_bytes == len("oklatin-1 name")
    odd = next(d.id for d in corpus if d.id != "ok.txt")
    split = DocumentSplit.plan(corpus.ids(), 0.5, seed=0)
    assert isinstance(split.is_validation(odd), bool)
    digest = hashlib.sha256()
    for name, text in sorted([(b"caf\xe9.txt", b"latin-1 name"), (b"ok.txt", b"ok")]):
        for field in (name, text):
            digest.update(len(field).to_bytes(8, "little") + field)
    assert info.sha256 == digest.hexdigest()  # the hash covers the name's own bytes


def test_load_corpus_specs(tmp_path: Path) -> None:
    assert isinstance(load_corpus("stdlib"), StdlibCorpus)
    assert isinstance(load_corpus(tmp_path), DirectoryCorpus)
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(ValueError, match="not .jsonl"):
        load_corpus(tmp_path / "x.txt")
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(tmp_path / "missing")


def test_document_list_corpus_rejects_duplicate_ids() -> None:
    corpus = DocumentListCorpus([Document("b", "2"), Document("a", "1")])
    assert [d.id for d in corpus] == ["a", "b"]
    with pytest.raises(ValueError, match="duplicate id 'a'"):
        DocumentListCorpus([Document("a", "1"), Document("a", "2")])


IDS = [f"pkg/module_{i}.py" for i in range(2000)]


@pytest.mark.parametrize("val_fraction", [0.05, 0.2, 0.5], ids=lambda f: f"val{f}")
def test_split_is_deterministic_disjoint_and_close_to_fraction(val_fraction: float) -> None:
    split = DocumentSplit.plan(IDS, val_fraction, seed=3)
    val = {i for i in IDS if split.is_validation(i)}
    again = DocumentSplit.plan(list(reversed(IDS)), val_fraction, seed=3)
    assert val == {i for i in IDS if again.is_validation(i)}  # order of ids does not matter
    train = set(split.select((Document(i, "") for i in IDS), "train"))
    assert not {d.id for d in train} & val
    assert len(train) + len(val) == len(IDS)
    # Binomial(2000, f): 5 standard deviations.
    sd = (len(IDS) * val_fraction * (1 - val_fraction)) ** 0.5
    assert abs(len(val) - len(IDS) * val_fraction) < 5 * sd
    other = DocumentSplit.plan(IDS, val_fraction, seed=4)
    assert {i for i in IDS if other.is_validation(i)} != val


def test_split_is_stable_when_documents_are_added() -> None:
    split = DocumentSplit.plan(IDS, 0.1, seed=0)
    bigger = DocumentSplit.plan(IDS + [f"new_{i}" for i in range(500)], 0.1, seed=0)
    assert all(split.is_validation(i) == bigger.is_validation(i) for i in IDS)


def test_split_follows_the_documented_hash_recipe() -> None:
    # The recipe written out independently: sha256("<seed>\0<id>"), first 8 bytes big-endian
    # over 2**64, below val_fraction. Pinning it keeps splits identical across versions/machines.
    def reference(doc_id: str, seed: int, fraction: float) -> bool:
        digest = hashlib.sha256(f"{seed}\x00{doc_id}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < fraction

    split = DocumentSplit.plan(IDS[:200], 0.1, seed=0)
    val = sorted(i for i in IDS[:200] if split.is_validation(i))
    assert val == sorted(i for i in IDS[:200] if reference(i, 0, 0.1))
    assert len(val) == 11 and val[:3] == ["pkg/module_1.py", "pkg/module_123.py", "pkg/module_156.py"]


def test_split_keeps_both_sides_non_empty_on_tiny_corpora() -> None:
    ids = ["a", "b", "c"]
    split = DocumentSplit.plan(ids, 0.01, seed=0)
    assert sum(split.is_validation(i) for i in ids) == 1
    split = DocumentSplit.plan(ids, 0.999, seed=0)
    assert sum(split.is_validation(i) for i in ids) == 2
    single = DocumentSplit.plan(["only"], 0.5, seed=0)
    assert not single.is_validation("only")
    none = DocumentSplit.plan(ids, 0.0, seed=0)
    assert not any(none.is_validation(i) for i in ids)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5], ids=["negative", "one", "above-one"])
def test_split_rejects_bad_fraction(bad: float) -> None:
    with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\)"):
        DocumentSplit.plan(IDS, bad)


def test_split_metadata_is_json() -> None:
    split = DocumentSplit.plan(["a", "b"], 0.01, seed=1)
    assert json.loads(json.dumps(split.to_dict()))["seed"] == 1


# ------------------------------------------------------------------ issue 33 item 19: files are streamed
def test_a_large_binary_file_is_skipped_from_its_first_bytes_without_being_read(tmp_path: Path) -> None:
    import tracemalloc

    (tmp_path / "a.txt").write_text("hello\n")
    with open(tmp_path / "sparse.bin", "wb") as handle:
        handle.truncate(256 << 20)  # a sparse 256 MB file of NUL bytes: no disk, but read whole it is 256 MB
    tracemalloc.start()
    try:
        docs = list(DirectoryCorpus(tmp_path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [d.id for d in docs] == ["a.txt"]
    assert peak < 8 << 20, f"reading the corpus allocated {peak:,} bytes"


def test_a_file_larger_than_a_part_is_read_as_parts_cut_at_newlines(tmp_path: Path, monkeypatch) -> None:
    from recurrent_depth.data import corpus as corpus_module

    monkeypatch.setattr(corpus_module, "PART_BYTES", 100)
    monkeypatch.setattr(corpus_module, "_READ_CHUNK_BYTES", 7)
    lines = [f"line {i} é\n" for i in range(40)]  # (a 2-byte character: chunks cut inside it decode whole)
    (tmp_path / "big.txt").write_text("".join(lines))
    (tmp_path / "bad.txt").write_bytes(b"x" * 150 + b"\xff")  # not UTF-8, found only past the first part
    (tmp_path / "small.txt").write_text("short\n")
    corpus = DirectoryCorpus(tmp_path)
    docs = list(corpus)
    parts = [d for d in docs if d.id.startswith("big.txt#part-")]
    assert [d.id for d in docs] == [f"big.txt#part-{k:05d}" for k in range(1, len(parts) + 1)] + ["small.txt"]
    assert "".join(d.text for d in parts) == "".join(lines)
    assert all(d.text.endswith("\n") and len(d.text) <= 100 for d in parts)
    assert corpus.num_skipped == 1


def test_a_plain_text_file_as_data_says_to_pass_its_directory(tmp_path: Path) -> None:
    """The message listed "a directory" without saying directories of text files are read, and a single
    corpus.txt got no hint of what to pass instead."""
    text = tmp_path / "corpus.txt"
    text.write_text("def f():\n    return 1\n")
    with pytest.raises(ValueError, match=r"a directory \(of text files, .*pass the directory holding it\)$"):
        load_corpus(str(text))
    assert [d.text for d in load_corpus(str(tmp_path))] == ["def f():\n    return 1\n"]


def test_a_training_run_refused_for_its_data_leaves_no_out_directory(tmp_path: Path) -> None:
    """The refusal came after --out was made and locked: an empty directory holding .rdepth.lock stayed behind. A
    directory the user made is kept, whatever it holds."""
    from recurrent_depth.cli import main

    text = tmp_path / "corpus.txt"
    text.write_text("def f():\n    return 1\n")
    argv = ["train", "--preset", "tiny", "--data", str(text), "--max-steps", "1", "--threads", "1"]
    assert main([*argv, "--out", str(tmp_path / "new")]) == 2
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    assert main([*argv, "--out", str(tmp_path / "mine")]) == 2
    assert (tmp_path / "mine").is_dir()
