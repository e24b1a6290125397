"""Tokenise documents and pack them into fixed-length training rows.

A row holds ``row_len = seq_len + 1`` tokens (inputs are ``row[:-1]``, labels ``row[1:]``).
Each document is framed as ``<|begin_text|> tokens [<|end_text|>]`` and the framed documents
are concatenated into rows, with no attention masking between them (as the reference).

The paper's rule (Huginn's data script): when a row fills up, the rest of the document that
filled it is dropped and the next row starts with the next document. So a document lies
within one row (it never continues into the next) and contributes at most ``row_len``
tokens. With ``keep_all=True`` the remainder instead flows on into further rows,
so every token is used. An unfinished last row is dropped in both modes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from tokenizers import Tokenizer

from recurrent_depth.data.corpus import Document
from recurrent_depth.data.tokenizer import PIECE_CHARS, text_pieces


@dataclass
class PackingStats:
    """Token accounting of one packing pass; ``tokens_in == tokens_packed + tokens_dropped``."""

    documents: int = 0  # documents packed (empty ones excluded)
    empty_documents: int = 0  # documents with no tokens, skipped entirely
    rows: int = 0
    tokens_in: int = 0  # framed document tokens offered (bos/eos included)
    tokens_packed: int = 0  # rows * row_len
    tokens_dropped: int = 0  # cut by the drop rule, plus the unfinished last row

    def to_dict(self) -> dict:
        return asdict(self)


class RowPacker:
    """Incremental packer: feed documents with :meth:`add`, collect finished rows as they fill.

    Args:
        row_len: tokens per row (``seq_len + 1``), at least 2.
        bos_id: written before every document.
        eos_id: written after every document when not None.
        keep_all: False = the paper's drop rule; True = keep every token.
    """

    def __init__(self, row_len: int, bos_id: int, eos_id: int | None = None, keep_all: bool = False) -> None:
        if isinstance(row_len, bool) or not isinstance(row_len, int) or row_len < 2:
            raise ValueError(f"row_len (seq_len + 1) must be an int >= 2, got {row_len!r}")
        self.row_len = row_len
        self.bos_id = int(bos_id)
        self.eos_id = None if eos_id is None else int(eos_id)
        self.keep_all = keep_all
        self.stats = PackingStats()
        self._row = np.empty(row_len, dtype=np.int64)
        self._fill = 0
        self._finished = False

    def add(self, tokens: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """Pack one document's tokens (without bos/eos); returns the rows it completed."""
        if self._finished:
            raise RuntimeError("RowPacker.add() after finish()")
        body = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if body.size == 0:
            self.stats.empty_documents += 1
            return []
        parts = [np.array([self.bos_id], dtype=np.int64), body]
        if self.eos_id is not None:
            parts.append(np.array([self.eos_id], dtype=np.int64))
        doc = np.concatenate(parts)
        self.stats.documents += 1
        self.stats.tokens_in += doc.size
        rows: list[np.ndarray] = []
        pos = 0
        while pos < doc.size:
            take = min(self.row_len - self._fill, doc.size - pos)
            self._row[self._fill : self._fill + take] = doc[pos : pos + take]
            self._fill += take
            pos += take
            if self._fill == self.row_len:
                rows.append(self._row.copy())
                self._fill = 0
                self.stats.rows += 1
                self.stats.tokens_packed += self.row_len
                if not self.keep_all:
                    self.stats.tokens_dropped += doc.size - pos
                    break
        return rows

    def finish(self) -> PackingStats:
        """Drop the unfinished last row (counted in ``tokens_dropped``) and return the stats."""
        if not self._finished:
            self.stats.tokens_dropped += self._fill
            self._fill = 0
            self._finished = True
        return self.stats


def pack_documents(
    docs: Iterable[Sequence[int] | np.ndarray],
    seq_len: int,
    bos_id: int,
    eos_id: int | None = None,
    *,
    keep_all: bool = False,
    shuffle_seed: int | Sequence[int] | None = None,
    stats: PackingStats | None = None,
) -> Iterator[np.ndarray]:
    """Yield packed rows ``[seq_len + 1]`` (int64) from tokenised documents.

    ``shuffle_seed`` (an int or a tuple of ints) packs the documents in a seeded random order
    (NumPy PCG64, so the same on every machine); it needs ``docs`` to be a sequence (``len``
    and indexing), such as a list or :class:`recurrent_depth.data.shards.TokenizedDocs`.
    Pass ``stats`` to receive the accounting once the generator is exhausted.
    """
    packer = RowPacker(seq_len + 1, bos_id, eos_id, keep_all)
    if shuffle_seed is not None:
        if not isinstance(docs, Sequence) and not hasattr(docs, "__getitem__"):
            raise ValueError("pack_documents: shuffle_seed needs docs with len() and indexing")
        order = np.random.default_rng(shuffle_seed).permutation(len(docs))  # type: ignore[arg-type]
        source: Iterable = (docs[int(i)] for i in order)  # type: ignore[index]
    else:
        source = docs
    for tokens in source:
        yield from packer.add(tokens)
    final = packer.finish()
    if stats is not None:
        for key, value in final.to_dict().items():
            setattr(stats, key, value)


def tokenize_documents(
    docs: Iterable[Document | str], tokenizer: Tokenizer, batch_size: int = 64, piece_chars: int = PIECE_CHARS
) -> Iterator[np.ndarray]:
    """Token ids of each document (no bos/eos added), encoded ``batch_size`` documents at a time.

    Special-token strings that occur literally in a document (e.g. source code mentioning
    ``"<|end_text|>"``) are encoded as ordinary text, never as the special id, so a document
    cannot forge a document boundary. A document longer than ``piece_chars`` characters is
    encoded alone, piece by piece (:func:`text_pieces`), so memory stays bounded per document.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    literal = Tokenizer.from_str(tokenizer.to_str())
    literal.encode_special_tokens = True
    batch: list[str] = []

    def flush() -> Iterator[np.ndarray]:
        for enc in literal.encode_batch_fast(batch, add_special_tokens=False):
            yield np.asarray(enc.ids, dtype=np.int64)
        batch.clear()

    for doc in docs:
        text = doc.text if isinstance(doc, Document) else doc
        if len(text) <= piece_chars:
            batch.append(text)
            if len(batch) == batch_size:
                yield from flush()
            continue
        yield from flush()
        parts = [np.asarray(literal.encode_batch_fast([piece], add_special_tokens=False)[0].ids, dtype=np.int32)
                 for piece in text_pieces(text, piece_chars)]
        yield np.concatenate(parts).astype(np.int64)
    if batch:
        yield from flush()
