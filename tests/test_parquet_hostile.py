"""Hostile Parquet files: a footer whose row counts disagree with the data, a text too long to decode, a
dictionary page that hands one long text to every row, and a huge number of tiny row groups."""

from __future__ import annotations

import struct
from itertools import combinations
from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from recurrent_depth.data import corpus as corpus_module  # noqa: E402
from recurrent_depth.data.corpus import load_corpus  # noqa: E402


def _zigzag_varint(n: int) -> bytes:
    n = (n << 1) ^ (n >> 63)
    out = b""
    while n >= 0x80:
        out += bytes([n & 0x7F | 0x80])
        n >>= 7
    return out + bytes([n])


def _footer_lying_about_rows(path: Path, rows: int, want: Any) -> Path:
    """A file of `rows` texts whose footer counts `rows - 1` in the places `want(metadata)` accepts (found by
    patching each combination of the footer's copies of the count)."""
    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(rows)]}), path)
    data = path.read_bytes()
    (length,) = struct.unpack("<I", data[-8:-4])
    start = len(data) - 8 - length
    old, new = _zigzag_varint(rows), _zigzag_varint(rows - 1)
    spots = [start + i for i in range(length) if data[start:-8].startswith(old, i)]
    for count in (1, 2):
        for chosen in combinations(spots, count):
            patched = bytearray(data)
            for at in chosen:
                patched[at:at + len(old)] = new
            path.write_bytes(patched)
            if want(pq.ParquetFile(path).metadata):
                return path
    raise AssertionError("no such footer")


def test_a_footer_row_count_that_disagrees_with_the_data_is_one_line_naming_the_file(tmp_path: Path) -> None:
    # the file's count disagrees with its row groups': ids() counted the one, reading the other (999 ids, 1000 docs)
    header = _footer_lying_about_rows(tmp_path / "header.parquet", 1000,
                                      lambda m: m.num_rows == 999 and m.row_group(0).num_rows == 1000)
    for read in (lambda c: list(c.ids()), list):
        with pytest.raises(ValueError, match=rf"^{header}: damaged footer: it counts 999 rows but its row groups "
                                             r"1,000; rewrite the file$"):
            read(load_corpus(str(header)))
    # both agree on 999 and the pages hold 1000: pyarrow read 999 rows and dropped one without a word
    both = _footer_lying_about_rows(tmp_path / "both.parquet", 1000,
                                    lambda m: m.num_rows == 999 and m.row_group(0).num_rows == 999)
    assert len(list(load_corpus(str(both)).ids())) == 999
    with pytest.raises(ValueError, match=rf"^{both}:rows 1-999: damaged row group: the pages of field 'text' hold "
                                         r"1,000 rows, its footer says 999; rewrite the file$"):
        list(load_corpus(str(both)))


@pytest.mark.parametrize("options", [
    {}, {"use_dictionary": False}, {"data_page_version": "2.0"}, {"compression": "zstd", "write_page_index": True},
    {"compression": "none", "write_statistics": False},
])
def test_a_text_too_long_is_refused_from_its_page_header_before_it_is_decoded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict
) -> None:
    texts = [f"short text {i}" for i in range(300)]
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": texts}), good, data_page_size=512, **options)
    assert [d.text for d in load_corpus(str(good))] == texts  # (every writer setting's page headers are read)
    texts[150] = "x" * 5000  # the row group's average stays far under the bound: the footer cannot tell
    huge = tmp_path / "huge.parquet"
    pq.write_table(pa.table({"text": texts}), huge, data_page_size=512, **options)
    monkeypatch.setattr(corpus_module, "TABLE_MAX_VALUE_BYTES", 4000)

    def no_decoding(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the file was decoded before the long text was refused")

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", no_decoding)
    with pytest.raises(ValueError, match=rf"^{huge}:rows \d+-\d+: field 'text' has a page of [\d,]+ bytes, more than "
                                         r"4,000, the longest text read: split the documents"):
        list(load_corpus(str(huge)))


def test_a_dictionary_page_handing_one_long_text_to_every_row_is_read_in_small_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "repeated.parquet"
    pq.write_table(pa.table({"text": ["y" * 2000] * 1000}), path)  # a dictionary of one text, 1000 indices
    monkeypatch.setattr(corpus_module, "TABLE_BATCH_BYTES", 20_000)
    seen: list[int] = []
    original = corpus_module._check_value_sizes

    def record(column: Any, *args: Any) -> None:
        seen.append(pa.compute.sum(pa.compute.binary_length(column)).as_py())
        original(column, *args)

    monkeypatch.setattr(corpus_module, "_check_value_sizes", record)
    assert sum(1 for _ in load_corpus(str(path))) == 1000
    assert max(seen) <= 20_000  # (the footer's 3 KiB for 2 MB of texts had made one batch of 1000 rows)


def test_many_tiny_row_groups_are_read_with_few_pyarrow_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tiny.parquet"
    texts = [f"t{i}" for i in range(300)]
    pq.write_table(pa.table({"text": texts}), path, row_group_size=1)
    calls: list[int] = []
    original = pq.ParquetFile.iter_batches

    def count(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(kwargs.get("row_groups") or ()))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", count)
    assert [d.text for d in load_corpus(str(path))] == texts
    # pyarrow's iter_batches takes time in the file's row groups at each call: one call per group was quadratic
    assert len(calls) == 1 and calls == [300]
