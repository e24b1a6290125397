"""The recent-token window of a quantized KV storage: the last W tokens of each sequence in bf16.

`kv_quant="...,window=W"`: a storage holding a codec (`kv_codec.CodeRows`) writes every token's code
row as before, and the codec keeps, per lane (one storage row of one layer slot: `(group, row)`), a
ring of the last W columns that lane wrote, in bf16, each entry tagged with its column. A query at
column c reads the columns (c − W, c] from the ring (exact, up to bf16; later columns of its own
call too, where the mask lets it see them) and every older column through the codes, so older
tokens are read through the codec from the moment they leave the window (their codes were written
with them; encoding them on leaving would give the same bytes).

An entry is read only where its tag is the column asked for, so anything the ring does not hold
exactly falls back to the codes: a column this lane's slot never wrote (a token that exited before
the step: its slot holds the lookup rule's settled code), entries a truncation forgot, a new request
in a reused row. Tags are long bookkeeping per ring position, like the storages' per-column `depth`;
the window's bytes are its bf16 entries (`nbytes`, `logical_nbytes`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

WINDOW_DTYPE = torch.bfloat16


class ExactWindow(NamedTuple):
    """The full-precision entries one call's queries may read: k, v `[B, Hkv, E, D]` at storage columns
    `cols` `[B, E]` (-1: none), for queries at columns `qcols` `[B, T]`: query t reads exactly the columns
    after qcol − size, its window (the last `size` up to itself, and any later ones the mask lets it see)."""

    k: Tensor
    v: Tensor
    cols: Tensor
    qcols: Tensor
    size: int

    def in_window(self) -> Tensor:
        """Bool `[B, T, E]`: entry e is in query t's window."""
        cols, q = self.cols[:, None, :], self.qcols[:, :, None]
        return (cols >= 0) & (cols > q - self.size)


class RecentWindow:
    """Per lane, a ring of the last `size` columns written (bf16 k and v `[Hkv, size, D]`, tags `[size]`)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a recent-token window holds >= 1 token, got {size}")
        self.size = size
        self.lanes: dict[tuple[Hashable, int], tuple[Tensor, Tensor, Tensor]] = {}

    def _ring(self, lane: tuple[Hashable, int], k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        ring = self.lanes.get(lane)
        if ring is None:
            Hkv, W = k.shape[1], self.size
            ring = self.lanes[lane] = (
                torch.zeros(Hkv, W, k.shape[-1], dtype=WINDOW_DTYPE, device=k.device),
                torch.zeros(Hkv, W, v.shape[-1], dtype=WINDOW_DTYPE, device=v.device),
                torch.full((W,), -1, dtype=torch.long, device=k.device),
            )
        return ring

    def read_and_write(self, lanes: Sequence[tuple[Hashable, int]], cols: Tensor, written: Tensor | None,
                       k: Tensor, v: Tensor) -> ExactWindow:
        """One call's window: the entries held before it (those this call rewrites left out) and the call's
        own k, v `[B, Hkv, T, D]` at columns `cols` `[B, T]`; then the call's written tokens (`written`
        bool `[B, T]`, None: all) enter the rings, the oldest leaving."""
        W = self.size
        new_k, new_v = k.to(WINDOW_DTYPE), v.to(WINDOW_DTYPE)
        new_cols = cols if written is None else torch.where(written, cols, -1)
        rings = [self._ring(lane, k, v) for lane in lanes]
        old_k = torch.stack([r[0] for r in rings])
        old_v = torch.stack([r[1] for r in rings])
        old_cols = torch.stack([r[2] for r in rings])  # copies: the rings are written below
        rewritten = (old_cols[:, :, None] == new_cols[:, None, :]).any(-1)
        old_cols = old_cols.masked_fill(rewritten, -1)
        for b, (ring_k, ring_v, tags) in enumerate(rings):
            take = (new_cols[b] >= 0).nonzero().flatten()[-W:]  # at most W, the last (distinct columns)
            if take.numel():
                at = new_cols[b, take] % W
                ring_k[:, at] = new_k[b][:, take]
                ring_v[:, at] = new_v[b][:, take]
                tags[at] = new_cols[b, take]
        return ExactWindow(torch.cat([old_k, new_k], 2), torch.cat([old_v, new_v], 2),
                           torch.cat([old_cols, new_cols], 1), cols, W)

    def forget_columns(self, num_columns: int) -> None:
        """Entries at columns >= num_columns are gone (a truncation)."""
        for lane, (ring_k, ring_v, tags) in self.lanes.items():  # not in place: the rings may be inference tensors
            self.lanes[lane] = (ring_k, ring_v, tags.masked_fill(tags >= num_columns, -1))

    def forget_row(self, row: int) -> None:
        """Row `row` starts a new sequence: its lanes are dropped."""
        for lane in [lane for lane in self.lanes if lane[1] == row]:
            del self.lanes[lane]

    def move_row(self, src: int, dst: int) -> None:
        """Row `src`'s lanes become row `dst`'s (whose own are dropped)."""
        self.forget_row(dst)
        for lane in [lane for lane in self.lanes if lane[1] == src]:
            self.lanes[(lane[0], dst)] = self.lanes.pop(lane)

    @staticmethod
    def _core(lane: tuple[Hashable, int]) -> bool:
        group = lane[0]  # (base layer key, slot), base ("core", j) for a core layer
        return isinstance(group, tuple) and isinstance(group[0], tuple) and group[0][0] == "core"

    def nbytes(self, core_only: bool = False) -> int:
        """Bytes of every ring's bf16 entries (core_only: the core layers' lanes)."""
        return sum(rk.nbytes + rv.nbytes for lane, (rk, rv, _) in list(self.lanes.items())
                   if not core_only or self._core(lane))

    def logical_nbytes(self, rows: int, valid: Tensor | None, end: int, core_only: bool = False) -> Tensor:
        """Bytes per row `[rows]` of the entries held at columns [0, end) (valid: bool `[rows, >= end]`,
        the real columns; None: all; core_only: the core layers' lanes)."""
        total = torch.zeros(rows, dtype=torch.long)
        for lane, (rk, rv, tags) in self.lanes.items():
            if core_only and not self._core(lane):
                continue
            row = lane[1]
            held = (tags >= 0) & (tags < end)
            if valid is not None:
                held &= valid[row].to(tags.device)[tags.clamp(0, max(end - 1, 0))]
            per_entry = (rk.nbytes + rv.nbytes) // self.size
            total[row] += int(held.sum()) * per_entry
        return total
