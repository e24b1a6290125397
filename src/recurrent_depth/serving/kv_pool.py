"""KV storage for a continuously batched set of sequences, keyed by (layer, recurrence step).

Every base layer key (`("prelude", i)`, `("core", j)`, `("coda", c)`) owns two tensors
`[S, R, Hkv, C, D]`: S slots (one per recurrence step of the core, 1 for prelude and coda),
R rows (one per running sequence) and C columns (token positions). Each row is one request: its
column c holds its token at position c, so rows of different lengths need no padding and no
realignment when requests join or leave. A decode call writes one column per row (at that row's
own position) and reads columns `[0, L)`, L = the longest row; the attention mask hides a row's
columns beyond its own length.

The slot a core step uses is per row: `step` under the full policy, `step mod k` under a KV budget
k (the paper's sharing, as `recurrent_depth.inference.cache`). A token that ran d steps has its
slots d.. filled with its deepest entry (`close_*`), the paper's remark 6.1, so later reads are
plain slices and each row reads exactly what it would read when generated alone.

The pool follows the model's cache protocol (`update_kv`, `get_state`/`set_state`, `advance`,
`seq_len`, `nbytes`) for the one call it is bound to (`bind_prefill` / `bind_decode`). Only
attention mixers are supported (recurrent-state mixers keep a single per-batch state).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

LayerKey = tuple


class SlotKVPool:
    """Per-row, per-slot KV storage that grows on demand (slots, rows and columns)."""

    def __init__(self, device: Any = "cpu") -> None:
        self.device = torch.device(device)
        self.kv: dict[tuple, tuple[Tensor, Tensor]] = {}
        self.slots = 1  # allocated core slots S
        self.rows = 0  # allocated rows R
        self.capacity = 0  # allocated columns C
        self.seq_len = 0  # protocol field; positions come from the bound call, not from here
        self.write_mask: Tensor | None = None  # bool [B]: rows that write in the current call
        self._row_start = 0
        self._row_count = 0
        self._cols: Tensor | None = None  # decode: [B] column of each row; None: prefill of one row
        self._row_index: Tensor | None = None  # decode: [B] absolute row of each bound row
        self._prefill_len = 0
        self._read_len = 0
        self._slot_table: Tensor | None = None  # [B, steps] slot of each (row, core step)
        self._uniform_slots: list[int] | None = None  # slot per step when every row agrees

    # ------------------------------------------------------------------ sizing
    def reserve(self, slots: int, rows: int, capacity: int, max_rows: int, max_capacity: int) -> None:
        """Make room for at least these many core slots, rows and columns (copies on growth).

        Rows and columns grow geometrically (up to `max_rows` / `max_capacity`), so a stream of
        slightly larger requests does not copy the storage every time.
        """
        new_s = max(self.slots, slots)
        new_r = self.rows if rows <= self.rows else min(max(rows, 2 * self.rows), max(rows, max_rows))
        new_c = self.capacity if capacity <= self.capacity else min(
            max(capacity, 2 * self.capacity), max(capacity, max_capacity)
        )
        if (new_s, new_r, new_c) == (self.slots, self.rows, self.capacity):
            return
        for base, (K, V) in self.kv.items():
            S = new_s if base[0] == "core" else 1
            self.kv[base] = (self._regrow(K, S, new_r, new_c), self._regrow(V, S, new_r, new_c))
        self.slots, self.rows, self.capacity = new_s, new_r, new_c

    @staticmethod
    def _regrow(old: Tensor, S: int, R: int, C: int) -> Tensor:
        new = old.new_zeros(S, R, old.shape[2], C, old.shape[4])
        s, r, c = old.shape[0], old.shape[1], old.shape[3]
        new[:s, :r, :, :c] = old
        return new

    def _storage(self, base: tuple, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if base not in self.kv:
            S = self.slots if base[0] == "core" else 1
            Hkv, D, Dv = k.shape[2], k.shape[3], v.shape[3]
            self.kv[base] = (
                torch.zeros(S, self.rows, Hkv, self.capacity, D, dtype=k.dtype, device=self.device),
                torch.zeros(S, self.rows, Hkv, self.capacity, Dv, dtype=v.dtype, device=self.device),
            )
        return self.kv[base]

    # ------------------------------------------------------------------ binding one model call
    def bind_prefill(self, row: int, length: int, slot_table: Tensor) -> None:
        """The next model call runs one row's prompt: columns [0, length) of `row`.

        slot_table: long `[1, steps]`, the slot of each core step for this row.
        """
        self._row_start, self._row_count = row, 1
        self._cols = None
        self._row_index = None
        self._prefill_len = length
        self._read_len = length
        self._set_slots(slot_table)
        self.write_mask = None

    def bind_decode(self, rows: int, positions: Tensor, slot_table: Tensor) -> None:
        """The next model call feeds one token to each of rows [0, rows), at `positions` `[B]`."""
        self._row_start, self._row_count = 0, rows
        self._cols = positions
        self._row_index = torch.arange(rows, device=self.device)
        self._read_len = int(positions.max()) + 1
        self._set_slots(slot_table)
        self.write_mask = None

    def _set_slots(self, slot_table: Tensor) -> None:
        self._slot_table = slot_table.to(self.device)
        # Columns where every row uses the same slot read a plain view instead of a gather.
        first = slot_table[:1]
        same = (slot_table == first).all(dim=0).tolist()
        self._uniform_slots = [int(s) if ok else -1 for s, ok in zip(first[0].tolist(), same)]

    def _slot(self, key: LayerKey) -> int | Tensor:
        if key[0] != "core":
            return 0
        step = key[2]
        uniform = self._uniform_slots[step]
        return uniform if uniform >= 0 else self._slot_table[:, step]

    # ------------------------------------------------------------------ the cache protocol
    def update_kv(self, key: LayerKey, k: Tensor, v: Tensor, ctx: Any = None) -> tuple[Tensor, Tensor]:
        """Store this call's k, v `[B, T, Hkv, D]`; return every visible column `[B, L, Hkv, D]`."""
        base = key[:2] if key[0] == "core" else key
        K, V = self._storage(base, k, v)
        slot = self._slot(key)
        if self._cols is None:  # prefill: one row, columns [0, T), every step writes
            r, T = self._row_start, self._prefill_len
            K[slot, r, :, :T] = k[0].transpose(0, 1)
            V[slot, r, :, :T] = v[0].transpose(0, 1)
            return K[slot, r : r + 1, :, :T].transpose(1, 2), V[slot, r : r + 1, :, :T].transpose(1, 2)
        rows, cols, n, L = self._row_index, self._cols, self._row_count, self._read_len
        new_k, new_v = k[:, 0], v[:, 0]  # [B, Hkv, D]
        if self.write_mask is not None:
            keep = self.write_mask[:, None, None]
            new_k = torch.where(keep, new_k, K[slot, rows, :, cols])
            new_v = torch.where(keep, new_v, V[slot, rows, :, cols])
        K[slot, rows, :, cols] = new_k
        V[slot, rows, :, cols] = new_v
        if isinstance(slot, int):
            k_all, v_all = K[slot, :n, :, :L], V[slot, :n, :, :L]  # views [B, Hkv, L, D]
        else:  # rows disagree on the slot (mixed KV budgets): gather each row's own
            k_all, v_all = K[slot, rows, :, :L], V[slot, rows, :, :L]
        return k_all.transpose(1, 2), v_all.transpose(1, 2)

    def get_state(self, key: LayerKey) -> Any:
        raise NotImplementedError("the serving KV pool supports attention mixers only")

    def set_state(self, key: LayerKey, value: Any) -> None:
        raise NotImplementedError("the serving KV pool supports attention mixers only")

    def advance(self, num_tokens: int) -> None:
        """Protocol no-op: each row's length is tracked by its sequence, not by the pool."""

    def nbytes(self) -> int:
        return sum(K.nbytes + V.nbytes for K, V in self.kv.values())

    # ------------------------------------------------------------------ after a call
    def close_prefill(self, row: int, length: int, depth: int, row_slots: int) -> None:
        """The prompt columns [0, length) of `row` ran `depth` steps; fill its slots depth..row_slots-1."""
        if depth <= 0 or depth >= row_slots:
            return
        for base, (K, V) in self.kv.items():
            if base[0] == "core":
                for store in (K, V):
                    store[depth:row_slots, row, :, :length] = store[depth - 1, row, :, :length]

    def close_decode(self, depth: Tensor, row_slots: Tensor) -> None:
        """Row b's new column ran `depth[b]` steps: its slots depth[b]..row_slots[b]-1 get the
        deepest entry (slot depth[b]-1), as `StaticRecurrentCache.close` does."""
        need = (depth > 0) & (depth < row_slots)
        if not bool(need.any()):
            return
        idx = need.nonzero().squeeze(1)  # rows to fill
        rows = self._row_index[idx]
        cols = self._cols[idx]
        s = torch.arange(self.slots, device=self.device)[None]  # [1, S]
        src = torch.where(s < row_slots[idx, None], torch.minimum(s, depth[idx, None] - 1), s)  # [n, S]
        for base, (K, V) in self.kv.items():
            if base[0] != "core":
                continue
            for store in (K, V):
                current = store[:, rows, :, cols]  # [n, S, Hkv, D]
                index = src[:, :, None, None].expand_as(current)
                store[:, rows, :, cols] = torch.gather(current, 1, index)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy columns [0, length) of row `src` to row `dst` (keeps running rows contiguous)."""
        for K, V in self.kv.values():
            K[:, dst, :, :length] = K[:, src, :, :length]
            V[:, dst, :, :length] = V[:, src, :, :length]
