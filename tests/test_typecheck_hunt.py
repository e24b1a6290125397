"""Bugs a type checker (mypy) pointed at: a damaged Parquet page header read as a struct it is not, and a
damaged data state's key sliced as a string."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from recurrent_depth.data.parquet_pages import Page, column_pages
from recurrent_depth.data.shards import SHARD_FORMAT, SHARD_FORMAT_VERSION, ShardDataset, ShardWriter, write_index

I32, STRUCT = 5, 12  # Thrift compact-protocol type codes


def _zigzag(n: int) -> bytes:
    n, out = (n << 1) ^ (n >> 63), b""
    while n >= 0x80:
        out += bytes([n & 0x7F | 0x80])
        n >>= 7
    return out + bytes([n])


def _struct(fields: list[tuple[int, int, int | bytes]]) -> bytes:
    """A compact-protocol struct of (field id delta, type, i32 value or nested struct bytes) fields."""
    out = b""
    for delta, kind, value in fields:
        out += bytes([delta << 4 | kind]) + (value if isinstance(value, bytes) else _zigzag(value))
    return out + b"\0"


def _pages(header: bytes, payload: int = 4) -> list:
    data = header + b"\0" * payload
    chunk = SimpleNamespace(data_page_offset=0, has_dictionary_page=False, dictionary_page_offset=0,
                            total_compressed_size=len(data))
    return list(column_pages(io.BytesIO(data), chunk, "x.parquet"))


def test_a_page_header_holding_an_integer_for_its_page_struct_is_a_one_line_error() -> None:
    # a data page (type 0) of 4 bytes whose DataPageHeader (field 5) is an i32: was AttributeError 'int' .get
    damaged = _struct([(1, I32, 0), (1, I32, 4), (1, I32, 4), (2, I32, 7)])
    with pytest.raises(ValueError, match=r"^x\.parquet: the page header at byte 0 is damaged"):
        _pages(damaged)


def test_a_page_header_holding_a_struct_for_its_row_count_is_a_one_line_error() -> None:
    # a v2 data page (type 3) whose num_rows (field 3 of field 8) is a struct: was a Page with rows={...}, a
    # TypeError in the caller's row sum
    damaged = _struct([(1, I32, 3), (1, I32, 4), (1, I32, 4), (5, STRUCT, _struct([(3, STRUCT, _struct([]))]))])
    with pytest.raises(ValueError, match=r"^x\.parquet: the page header at byte 0 is damaged"):
        _pages(damaged)
    # the well-formed headers still read: v1 num_values, v2 num_rows, a dictionary page's 0
    assert _pages(_struct([(1, I32, 0), (1, I32, 4), (1, I32, 4), (2, STRUCT, _struct([(1, I32, 9)]))]))[0].rows == 9
    assert _pages(_struct([(1, I32, 3), (1, I32, 4), (1, I32, 4), (5, STRUCT, _struct([(3, I32, 6)]))]))[0].rows == 6
    assert _pages(_struct([(1, I32, 2), (1, I32, 4), (1, I32, 4)])) == [Page(True, 4, 4, 0)]


def test_real_parquet_pages_still_count_their_rows(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": [f"document {i}" for i in range(300)]}), path, data_page_size=256,
                   write_batch_size=16, use_dictionary=False)
    meta = pq.ParquetFile(path).metadata
    with path.open("rb") as raw:
        pages = list(column_pages(raw, meta.row_group(0).column(0), str(path)))
    assert sum(page.rows for page in pages) == 300 and len(pages) > 2


def test_a_data_state_whose_key_is_no_string_is_refused_in_one_line(tmp_path: Path) -> None:
    rows = np.arange(40, dtype=np.uint16).reshape(10, 4)
    with ShardWriter(tmp_path, "train", 4, np.uint16, 10**9) as writer:
        writer.write_rows(rows)
    index = tmp_path / "train.json"
    write_index(index, {"format": SHARD_FORMAT, "version": SHARD_FORMAT_VERSION, "split": "train", "dtype": "uint16",
                        "seq_len": 3, "row_len": 4, "num_rows": writer.num_rows, "num_tokens": rows.size,
                        "shards": writer.shards, "key": "a" * 64})
    assert json.loads(index.read_text())["key"] == "a" * 64
    state = ShardDataset(index, seed=3).state_dict()
    # a damaged checkpoint's key: was TypeError 'int' object is not subscriptable
    with pytest.raises(ValueError, match=r"built from other data \(key 12345\.\.\.\)"):
        ShardDataset(index, seed=3).load_state_dict({**state, "data_key": 12345})
