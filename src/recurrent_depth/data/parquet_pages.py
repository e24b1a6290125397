"""Parquet page headers, read without decoding a page: how large each page of a column chunk is and how many
rows it holds (`ParquetCorpus` refuses a page too large to decode, and sizes its batches from them).

pyarrow gives no access to page headers, and only they tell how large a page (so a single text) is before it is
decoded; they are Thrift compact-protocol structs (parquet.thrift's `PageHeader`), of which `ThriftReader` reads
just enough: integer fields and nested structs, everything else skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# Thrift compact-protocol type codes (parquet.thrift is read with it): those skipped as fixed-size values.
THRIFT_FIXED_SIZES = {1: 0, 2: 0, 3: 1, 7: 8}  # bool true, bool false, byte, double
THRIFT_VARINTS = (4, 5, 6)  # i16, i32, i64 (zigzag varints)
THRIFT_BINARY, THRIFT_LIST, THRIFT_SET, THRIFT_MAP, THRIFT_STRUCT = 8, 9, 10, 11, 12
# Largest Parquet page header read (pyarrow's own default bound).
PAGE_HEADER_MAX_BYTES = 16 << 20


class ShortHeader(Exception):
    """The bytes read so far end inside the page header: read more."""


class ThriftReader:
    """Just enough of Thrift's compact protocol to read a Parquet `PageHeader`: integer fields and nested
    structs are returned, everything else skipped. pyarrow gives no access to page headers, and only they
    tell how large a page (so a single text) is before it is decoded."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise ShortHeader
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        value = shift = 0
        while True:
            byte = self.byte()
            value |= (byte & 0x7F) << shift
            if byte < 0x80:
                return value
            shift += 7
            if shift > 63:
                raise ValueError("varint longer than 10 bytes")

    def zigzag(self) -> int:
        value = self.varint()
        return (value >> 1) ^ -(value & 1)

    def skip(self, kind: int, depth: int) -> None:
        if depth > 32:
            raise ValueError("structs nested too deeply")
        if kind in THRIFT_FIXED_SIZES:
            self.pos += THRIFT_FIXED_SIZES[kind]
        elif kind in THRIFT_VARINTS:
            self.varint()
        elif kind == THRIFT_BINARY:
            length = self.varint()  # (read first: `self.pos += self.varint()` would add to the old position)
            self.pos += length
        elif kind in (THRIFT_LIST, THRIFT_SET):
            head = self.byte()
            count = head >> 4 if head >> 4 != 15 else self.varint()
            element = head & 0x0F
            for _ in range(count):
                if element in (1, 2):  # (a bool element is a byte, not a type code)
                    self.pos += 1
                else:
                    self.skip(element, depth + 1)
        elif kind == THRIFT_MAP:
            count = self.varint()
            types = self.byte() if count else 0
            for _ in range(count):
                self.skip(types >> 4, depth + 1)
                self.skip(types & 0x0F, depth + 1)
        elif kind == THRIFT_STRUCT:
            self.struct(depth + 1)
        else:
            raise ValueError(f"unknown Thrift type {kind}")
        if self.pos > len(self.data):
            raise ShortHeader

    def struct(self, depth: int = 0) -> dict[int, Any]:
        """A struct's integer and struct fields by field id; other fields are skipped."""
        fields: dict[int, Any] = {}
        field_id = 0
        while (head := self.byte()) != 0:
            field_id = field_id + (head >> 4) if head >> 4 else self.zigzag()
            kind = head & 0x0F
            if kind in THRIFT_VARINTS:
                fields[field_id] = self.zigzag()
            elif kind == THRIFT_STRUCT:
                fields[field_id] = self.struct(depth + 1)
            else:
                self.skip(kind, depth)
        return fields


@dataclass(frozen=True)
class Page:
    """What a Parquet page header says of a page: its sizes and rows (0 for a dictionary page)."""

    dictionary: bool
    uncompressed: int
    compressed: int
    rows: int


def read_page_header(raw: Any, offset: int, what: str) -> tuple[dict[int, Any], int]:
    """The fields of the page header at `offset` of the binary file `raw`, and the header's length in bytes."""
    size = 8192
    while True:
        raw.seek(offset)
        data = raw.read(size)
        try:
            reader = ThriftReader(data)
            return reader.struct(), reader.pos
        except ShortHeader:
            if len(data) < size or size >= PAGE_HEADER_MAX_BYTES:
                raise ValueError(f"{what}: the page header at byte {offset:,} is truncated") from None
            size *= 4
        except ValueError as exc:
            raise ValueError(f"{what}: the page header at byte {offset:,} is damaged ({exc})") from None


def column_pages(raw: Any, chunk: Any, what: str) -> Iterator[Page]:
    """The pages of a column chunk (`pyarrow.parquet.ColumnChunkMetaData`) of the binary file `raw`, from their
    headers alone (a few hundred bytes each): nothing of the pages is read."""
    start = chunk.data_page_offset
    if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
        start = chunk.dictionary_page_offset
    offset, end = start, start + chunk.total_compressed_size
    while offset < end:
        header, length = read_page_header(raw, offset, what)
        kind, uncompressed, compressed = header.get(1), header.get(2), header.get(3)
        if not all(isinstance(value, int) and value >= 0 for value in (kind, uncompressed, compressed)):
            raise ValueError(f"{what}: the page header at byte {offset:,} is damaged (no page type or sizes)")
        detail = header.get({0: 5, 2: 7, 3: 8}.get(kind, 0), {})  # (data page, dictionary page, data page v2)
        # (a damaged header can hold an integer where the page's struct belongs, or a struct for its row count:
        # an AttributeError / TypeError naming no file before)
        rows = detail.get(3 if kind == 3 else 1, 0) if kind in (0, 3) and isinstance(detail, dict) else 0
        if not isinstance(detail, dict) or not (isinstance(rows, int) and rows >= 0):
            raise ValueError(f"{what}: the page header at byte {offset:,} is damaged (a malformed page row count)")
        yield Page(kind == 2, uncompressed, compressed, rows)
        offset += length + compressed
