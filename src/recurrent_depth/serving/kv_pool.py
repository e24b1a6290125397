"""KV storage for a continuously batched set of sequences, keyed by (layer, recurrence step).

Every base layer key (`("prelude", i)`, `("core", j)`, `("coda", c)`) owns two tensors
`[S, R, Hkv, C, D]`: S slots (one per recurrence step of the core, 1 for prelude and coda),
R rows (one per running sequence) and C columns (token positions). Each row is one request: its
column c holds its token at position c, so rows of different lengths need no padding and no
realignment when requests join or leave. A token call writes one column per listed row (at that
row's own position) and reads columns `[0, L)`, L = the longest listed row; the attention mask
hides a row's columns beyond its own.

Each row follows its request's `KVPolicy` (`recurrent_depth.model.cache`, the same rule classes as
the generation caches): the slot a core step uses is the row's slot rule (`step`, or `step mod k`
under a budget), and rows in one call may be at different steps. When a token closes at depth d,
the row's lookup rule settles slots d.. (`Deepest` copies its deepest entry there, the paper's
remark 6.1); under `Skip` the pool's `key_mask` hides the column from steps >= d (under `Full`, from
slots it did not write). Each row reads exactly what it would read when generated alone. Policies
that pick entries at every read (`always-last`, `randomized`) or share slots among core layers
(`compress-rN`) are refused (`SlotKVPool.takes`): the server runs those requests alone.

The pool follows the model's cache protocol (`update_kv` / `update_heads`, `key_mask`,
`get_state`/`set_state`, `advance`, `seq_len`, `nbytes`) for the one call it is bound to
(`bind_prefill` / `bind_tokens`). Only attention mixers are supported (recurrent-state mixers
keep a single per-batch state).

With `kv_quant` (`rdepth serve --kv-quant SPEC`; `QuantizedSlotKVPool`) the pool holds the generation
cache's codec (`inference.kv_codec.CodeRows`) and stores each entry as its code row: every storage
is then `[S, R, Hkv, C, bytes]` uint8, and the slot rules, growth, settling, key masks and row
moves above apply to the bytes unchanged; calibrated outlier channels are each row's own (from its
prompt, `RowCodecs`). Prompt and generated tokens are encoded as they are written, and no float
copy of an entry outlives the call.

Sliding-window layers (`windows`, `inference.cache.layer_windows`) hold each row's recent columns only, as
autoregressive decoding does (`inference.cache`): a windowed base's storage is `[S, R, Hkv, Cw, D]` (or code rows
`[S, R, Hkv, Cw, bytes]`), Cw = `decoding_window_columns(reach, dtype)` (`reach`: the largest window, and for code rows
at least `kv_codec.exact_decode_columns`, so that each held column decodes bitwise as in a longer read), and
row r holds its columns from `first[r]` on (`window_start`: a multiple of `WINDOW_ALIGN`, of 32 in a bf16 / fp16
store, of a whole 512-column
SDPA block from W = 512 on: the attention's sums keep their lanes and blocks, so a row reads bitwise what it reads
with every column held; with W < 512 only up to column 512, past which CPU SDPA's block boundaries differ and the
sums ~1e-7, as rows of one call start at different columns and cannot share `inference.cache.read_start`'s zero
prefix) at held positions `column - first[r]`. A
prefill stores only the prompt's columns the next token's window reaches (its own queries read the call's
entries); `hold` moves a row's columns down to its next token's window when that token's column runs past the
room (that row alone). Token calls then write each row at its held position and read held positions
`[0, Lw)`, Lw = the longest held span among the call's rows, after zero columns where a row that dropped holds
fewer than `read_floor` (`_read_pad`, `inference.cache.floored_start`: as the generation cache's `read_start`, so
that a soft-capped layer's plain attention over them rounds as over the full cache's read): `hold` returns each
row's position in that read, which the batch gives the context as `query_columns` (`window_mask` counts keys from
them), and `key_mask` reads each row's depths from the read's first column. A quantized window's bf16 entries
keep their columns as tags (moves leave them be):
`first_column` gives each row's first held column, and `CodeRows.update_heads` writes an entry back at its
column's held position. Layers without a window keep every column. `RDEPTH_FULL_WINDOW_CACHE=1` turns the
bound off (`layer_windows` names no layer).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from recurrent_depth.inference.cache import decoding_window_columns, floored_start, read_floor, window_start
from recurrent_depth.inference.kv_codec import (
    Codec,
    CodeRows,
    KVQuant,
    attend_through_codec,
    exact_decode_columns,
    layer_codec,
    update_heads_through_codec,
    update_kv_head_major,
)
from recurrent_depth.model.cache import KVPolicy, grown_slot_count, no_decode_views, settle_new_slots

LayerKey = tuple


class SlotKVPool:
    """Per-row, per-slot KV storage that grows on demand (slots, rows and columns)."""

    def __init__(self, device: Any = "cpu", kv_quant: KVQuant | str | None = None,
                 windows: Mapping[tuple, int] | None = None, head_dim: int | None = None) -> None:
        self.device = torch.device(device)
        # Quantized entries: the codec, choosing each call's codecs from its rows' calibration (None: floats).
        self.row_codecs = RowCodecs(kv_quant) if kv_quant is not None else None
        self.codes = CodeRows(kv_quant, self.row_codecs) if self.row_codecs is not None else None
        # Sliding-window bases holding each row's recent columns (module docstring)
        self.windows: dict[tuple, int] = dict(windows or {})
        self.reach = max(self.windows.values(), default=0)  # one held range per row serves every windowed base
        if self.windows and self.codes is not None:  # code rows: reads long enough to decode as longer ones do
            self.reach = max(self.reach, self._decode_floor(head_dim))
        self.held = decoding_window_columns(self.reach) if self.windows else 0  # columns a windowed base allocates
        self.dtype: torch.dtype | None = None  # the windowed stores' (it sets their alignment): from their first write
        self.first: list[int] = []  # per row: the first column its windowed bases hold
        self._held_cols: Tensor | None = None  # token calls: [B] position of each row's column in a windowed read
        self._stored_cols: Tensor | None = None  # token calls: [B] held position of each row's column (in the stores)
        self._held_len = 0  # token calls: columns a windowed base's read returns
        self._pad = 0  # token calls: zero columns a windowed read returns before the held ones (`_read_pad`)
        self.floor = read_floor(head_dim)  # the fewest columns a windowed read after a drop returns
        self.kv_quant = self.codes.kv_quant if self.codes is not None else None
        self.attends_from_codes = self.codes is not None and self.codes.attends_from_codes
        self.kv: dict[tuple, tuple[Tensor, Tensor]] = {}
        self.slots = 1  # allocated core slots S
        self.rows = 0  # allocated rows R
        self.capacity = 0  # allocated columns C
        self.seq_len = 0  # protocol field; positions come from the bound call, not from here
        self._rows: list[int] = []  # the rows of the bound call
        self._row_index: Tensor | None = None  # [B] the same rows as a tensor (token calls)
        self._cols: Tensor | None = None  # token calls: [B] column of each row; None: a prefill
        self._contiguous = False  # the rows are r0, r0 + 1, ... (reads can be views)
        self._prefill_len = 0
        self._read_len = 0
        self._slot_table: Tensor | None = None  # prefill: [1, steps] slot of each core step
        self._token_slots: int | Tensor = 0  # token calls: the core slot, one int or [B]
        self._token_steps: Tensor | None = None  # token calls: [B] core step of each row
        self.depth = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [R, C] steps each column ran
        self.policies: dict[int, KVPolicy] = {}  # row -> its request's policy

    def _decode_floor(self, head_dim: int | None) -> int:
        """The fewest columns a read of a windowed base's code rows decodes bitwise as a longer read does
        (`kv_codec.exact_decode_columns`, as the generation cache's `_reach`)."""
        if head_dim is None:
            raise ValueError("a quantized KV pool with sliding-window layers needs the model's head_dim")
        quant = self.codes.kv_quant
        return exact_decode_columns((layer_codec(quant, "k", head_dim), layer_codec(quant, "v", head_dim)))

    # ------------------------------------------------------------------ sizing
    INITIAL_SLOTS = 64  # core slots `reserve` allocates at most; deeper steps grow them (`_grow_slots`)

    def reserve(self, slots: int, rows: int, capacity: int, max_rows: int, max_capacity: int) -> None:
        """Make room for at least these many rows and columns, and core slots up to `INITIAL_SLOTS`
        (copies on growth).

        Rows and columns grow geometrically (up to `max_rows` / `max_capacity`), so a stream of
        slightly larger requests does not copy the storage every time. Core slots beyond
        `INITIAL_SLOTS` are allocated when a step first writes them, so a very deep request holds
        only the steps it reached (10^5 steps would otherwise zero gigabytes before its first step,
        and its deadline could not stop that).
        """
        new_s = max(self.slots, min(slots, self.INITIAL_SLOTS))
        new_r = self.rows if rows <= self.rows else min(max(rows, 2 * self.rows), max(rows, max_rows))
        new_c = self.capacity if capacity <= self.capacity else min(
            max(capacity, 2 * self.capacity), max(capacity, max_capacity)
        )
        if self.row_codecs is not None:
            self.row_codecs.reserve(new_r)
        self.first += [0] * (new_r - len(self.first))
        if (new_s, new_r, new_c) == (self.slots, self.rows, self.capacity):
            return
        for base, (K, V) in self.kv.items():
            S = new_s if base[0] == "core" else 1
            C = self.held if base in self.windows else new_c  # (a windowed base holds recent columns only)
            self.kv[base] = (self._regrow(K, S, new_r, C), self._regrow(V, S, new_r, C))
        depth = self.depth.new_zeros(new_r, new_c)
        depth[: self.depth.shape[0], : self.depth.shape[1]] = self.depth
        self.depth = depth
        self.slots, self.rows, self.capacity = new_s, new_r, new_c

    def _grow_slots(self, slot: int) -> None:
        """Allocate core slots up to `slot` (doubling). Closed columns reached fewer slots than were
        held, so each row's lookup rule settles the new ones from the old (`Deepest`: the deepest)."""
        old = self.slots
        new = grown_slot_count(old, slot)
        # Each row's lookup rule, one fill for all rows (a rule that settles nothing: any entry, never read).
        fill = torch.arange(new, device=self.device)[:, None, None].repeat(1, self.rows, self.capacity)
        for row, policy in self.policies.items():
            rule = policy.lookup.fill_index(self.depth[row : row + 1], new)  # [new, 1, C] or None
            if rule is not None:
                fill[:, row : row + 1] = rule
        held_fill = None
        if self.windows:  # a windowed base's position p of row r holds column first[r] + p
            cols = self._held_columns(torch.arange(self.rows, device=self.device), self.held)  # [R, Cw]
            held_fill = fill.gather(2, cols[None].expand(new, -1, -1))
        for base, (K, V) in self.kv.items():
            if base[0] != "core":
                continue
            windowed = base in self.windows
            grown = []
            for store in (K, V):
                bigger = self._regrow(store, new, self.rows, self.held if windowed else self.capacity)
                settle_new_slots(bigger, old, held_fill if windowed else fill)
                grown.append(bigger)
            self.kv[base] = (grown[0], grown[1])
        self.slots = new

    def _held_columns(self, rows: Tensor, length: int, pad: int = 0) -> Tensor:
        """Long `[B, length]`: the column each held position of `rows` holds in a windowed base, or each position of
        a read that starts `pad` zero columns earlier (capped at the columns `depth` records: positions before a
        row's first held column or past its own are never read)."""
        first = torch.tensor(self.first, dtype=torch.long, device=self.device)[rows] - pad
        cols = first[:, None] + torch.arange(length, device=self.device)[None]
        return cols.clamp(min=0, max=max(self.depth.shape[1] - 1, 0))

    def hold(self, rows: list[int], columns: list[int]) -> list[int]:
        """Make room in the windowed bases for each row's token at column columns[b] and return its position in
        the call's windowed reads: its held position, after `_read_pad` zero columns (the column itself without
        windows). A row whose column runs past its room keeps the columns from its token's window on
        (`window_start`) and drops the older ones: that row alone moves."""
        if not self.windows:
            return columns
        held = []
        for r, c in zip(rows, columns):
            if c - self.first[r] >= self.held:
                self._compact(r, c)
            held.append(c - self.first[r])
        pad = self._read_pad(rows, max(held) + 1)
        return [h + pad for h in held]

    def _read_pad(self, rows: list[int], span: int) -> int:
        """Zero columns a token call of `rows` returns before the held positions [0, span) of its windowed reads:
        where a row that dropped holds fewer than `floor`, `floored_start`'s, the most of any row (a multiple of
        16: every row's columns keep their lanes), if no row holds fewer dropped columns than that (0 otherwise):
        each row's zeros then stand for columns it dropped, outside its window (a row that dropped none would see
        zeros in its window; a batch's padded read is not bitwise a row's own anyway). Not `read_start`'s block
        rule: rows of one call start at different columns (module docstring)."""
        firsts = [self.first[r] for r in rows]
        pad = max(first - floored_start(first, first + span, self.floor) for first in firsts)
        return pad if pad <= min(firsts) else 0

    def _compact(self, row: int, column: int) -> None:
        """Row `row`'s windowed bases keep its columns window_start(column) .. column, at held positions from 0."""
        first = window_start(column, self.reach, self.dtype)
        shift = first - self.first[row]
        span = min(column + 1, self.first[row] + self.held) - first  # the held ones (the column may be unwritten)
        for base, (K, V) in self.kv.items():
            if base in self.windows:
                for store in (K, V):
                    store[:, row, :, :span] = store[:, row, :, shift : shift + span].clone()
        self.first[row] = first

    @staticmethod
    def _regrow(old: Tensor, S: int, R: int, C: int) -> Tensor:
        new = old.new_zeros(S, R, old.shape[2], C, old.shape[4])
        s, r, c = old.shape[0], old.shape[1], old.shape[3]
        new[:s, :r, :, :c] = old
        return new

    def _storage(self, base: tuple, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if base not in self.kv:
            if base in self.windows and self.dtype is None:  # the first windowed store: its dtype's alignment
                self._window_dtype(k.dtype)
            S = self.slots if base[0] == "core" else 1
            C = self.held if base in self.windows else self.capacity
            Hkv, D, Dv = k.shape[1], k.shape[3], v.shape[3]  # head-major [B, Hkv, T, D]
            self.kv[base] = (
                torch.zeros(S, self.rows, Hkv, C, D, dtype=k.dtype, device=self.device),
                torch.zeros(S, self.rows, Hkv, C, Dv, dtype=v.dtype, device=self.device),
            )
        return self.kv[base]

    def _window_dtype(self, dtype: torch.dtype) -> None:
        """The windowed stores hold `dtype` (a bf16 / fp16 store starts its rows' held columns on multiples of 32,
        `window_align`): size them for it and, in the prefill that makes the first one (no row holds a column
        yet), start its row's held columns there."""
        self.dtype = dtype
        self.held = decoding_window_columns(self.reach, dtype)
        if self._cols is None and self._rows:
            self.first[self._rows[0]] = window_start(self._prefill_len, self.reach, dtype)

    # ------------------------------------------------------------------ binding one model call
    def bind_prefill(self, row: int, length: int, slot_table: Tensor) -> None:
        """The next model call runs one row's prompt: columns [0, length) of `row`.

        slot_table: long `[1, steps]`, the slot of each core step for this row.
        """
        self._rows = [row]
        self._cols = None
        # a prefill hides no column (the prompt runs at full depth); a skip lookup's token call left its steps
        # here when no coda call followed, and key_mask read them with no columns: a 500 for the new request
        self._token_steps = None
        self._prefill_len = length
        self._read_len = length
        self._slot_table = slot_table.to(self.device)
        if self.windows:  # the prompt's columns its first token's window reaches (module docstring)
            self.first[row] = window_start(length, self.reach, self.dtype)
        if self.row_codecs is not None:
            self.row_codecs.bind_prefill(row, self.rows)
            self.codes.forget_row(row)  # a new request: the row's old window entries are not its own

    def bind_tokens(self, rows: list[int], row_index: Tensor, cols: Tensor, read_len: int,
                    core_slots: list[int] | None, core_steps: list[int] | None = None,
                    held_cols: Tensor | None = None) -> None:
        """The next model call feeds one token to each of `rows` (also as `row_index` `[B]`), at
        columns `cols` `[B]`.

        core_slots: the KV slot each row's core step uses (rows may be at different steps), and
        core_steps the steps themselves (what `key_mask` compares depths with); None for prelude /
        coda calls. held_cols: `[B]` the rows' positions in the windowed bases' reads (`hold`; None: the columns).
        """
        self._rows = rows
        self._row_index = row_index
        self._contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        self._cols = cols
        self._read_len = read_len
        self._held_cols = self._stored_cols = cols if held_cols is None else held_cols
        self._held_len = read_len if held_cols is None else int(held_cols.max()) + 1
        self._pad = 0
        if self.windows:  # positions in the read are `_read_pad` zero columns after the held ones (maybe the columns)
            first = torch.tensor([self.first[r] for r in rows], dtype=torch.long, device=self.device)
            self._stored_cols = cols - first
            self._pad = int(self._held_cols[0] - self._stored_cols[0])
        if self.row_codecs is not None:
            self.row_codecs.bind_tokens(rows, row_index)
        if core_slots and max(core_slots) >= self.slots:
            self._grow_slots(max(core_slots))
        if core_slots is None or len(set(core_slots)) == 1:
            self._token_slots = core_slots[0] if core_slots else 0
        else:
            self._token_slots = torch.tensor(core_slots, dtype=torch.long, device=self.device)
        self._token_steps = None
        if core_steps is not None and any(self.policies[r].lookup.hides_columns for r in rows):
            self._token_steps = torch.tensor(
                [self.policies[r].visible_above(s) if self.policies[r].lookup.hides_columns else -1
                 for r, s in zip(rows, core_steps)],
                dtype=torch.long, device=self.device,
            )  # a row sees the columns that ran more steps than this; -1: a row whose lookup hides nothing

    def _slot(self, key: LayerKey) -> int | Tensor:
        if key[0] != "core":
            return 0
        if self._cols is None:  # prefill: the step's slot
            return int(self._slot_table[0, key[2]])
        return self._token_slots

    # ------------------------------------------------------------------ the cache protocol
    @staticmethod
    def base(key: LayerKey) -> tuple:
        """The storage a layer key writes: ("core", j) for every step of core layer j, else the key."""
        return key[:2] if key[0] == "core" else key

    # `update_kv` (k, v `[B, T, Hkv, D]` written at the next columns, every visible column returned), the
    # same in head-major layout (`[B, Hkv, T, D]` in, `[B, Hkv, S, D]` out) and softmax attention, through
    # the codec the storage holds (None: floats straight to `write_rows`).
    update_kv = update_kv_head_major
    update_heads = update_heads_through_codec
    attend = attend_through_codec
    decode_views = no_decode_views

    def write_rows(self, key: LayerKey, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write rows `[B, Hkv, T, width]` (floats, or a codec's code rows); return every visible column's."""
        base = self.base(key)
        slot = self._slot(key)
        if isinstance(slot, int) and slot >= self.slots:  # a prefill's step (token calls grow in bind_tokens)
            self._grow_slots(slot)
        K, V = self._storage(base, k, v)
        windowed = base in self.windows
        if self._cols is None:  # prefill: one row, columns [0, T)
            r, T = self._rows[0], self._prefill_len
            if windowed:  # held: the columns from first[r] on; the prompt's queries read the call's own entries
                first = self.first[r]
                K[slot, r, :, : T - first] = k[0, :, first:]
                V[slot, r, :, : T - first] = v[0, :, first:]
                return k, v
            K[slot, r, :, :T] = k[0]
            V[slot, r, :, :T] = v[0]
            return K[slot, r : r + 1, :, :T], V[slot, r : r + 1, :, :T]
        rows = self._row_index
        cols, L = (self._stored_cols, self._held_len - self._pad) if windowed else (self._cols, self._read_len)
        K[slot, rows, :, cols] = k[:, :, 0]  # [B, Hkv, D] at each row's own column
        V[slot, rows, :, cols] = v[:, :, 0]
        if isinstance(slot, int) and self._contiguous:
            r0, r1 = self._rows[0], self._rows[0] + len(self._rows)
            read = K[slot, r0:r1, :, :L], V[slot, r0:r1, :, :L]  # views [B, Hkv, L, D]
        else:
            # Scattered rows, or rows at different steps: gather each row's (slot, row) entry.
            # One index_select over the flattened (slot, row) dimension is several times faster
            # than advanced indexing with two index tensors.
            flat = slot * self.rows + rows  # [B] (slot: an int or one per row)
            read = K.flatten(0, 1)[:, :, :L].index_select(0, flat), V.flatten(0, 1)[:, :, :L].index_select(0, flat)
        if not (windowed and self._pad):
            return read
        return tuple(torch.cat([x.new_zeros(*x.shape[:2], self._pad, x.shape[3]), x], dim=2) for x in read)

    def first_column(self, key: LayerKey) -> int | Tensor:
        """The column the bound call's reads of `key` return first: 0, or in a token call of a windowed base each
        row's first held column `[B]` (a prefill returns its own columns from 0). A quantized window writes its
        exact entries back at their column's place in the read (`CodeRows.update_heads`)."""
        if self._cols is None or self.base(key) not in self.windows:
            return 0
        return self._cols - self._held_cols

    def window_positions(self, key: LayerKey, num_tokens: int) -> tuple[list[tuple[Any, int]], Tensor, None]:
        """A quantized window's lanes `((base, slot), row)` and the call's columns `[B, T]` (every token written)."""
        base, slot = self.base(key), self._slot(key)
        if self._cols is None:  # prefill: one row, columns [0, T)
            cols = torch.arange(num_tokens, device=self.device)[None]
            return [((base, int(slot)), self._rows[0])], cols, None
        slots = slot.tolist() if isinstance(slot, Tensor) else [slot] * len(self._rows)
        return [((base, s), r) for s, r in zip(slots, self._rows)], self._cols[:, None], None

    def key_mask(self, key: LayerKey) -> Tensor | None:
        """Bool `[B, L]` in token calls with rows whose lookup hides columns (`Skip`), else None."""
        if key[0] != "core" or self._token_steps is None:
            return None
        if self.base(key) in self.windows:  # positions in the read: each row's depths from the read's first column
            L, own = self._held_len, self._held_cols
            depth = self.depth[self._row_index[:, None], self._held_columns(self._row_index, L, self._pad)]
        else:
            L, own = self._read_len, self._cols
            depth = self.depth[self._row_index, :L]
        visible = depth > self._token_steps[:, None]
        return visible | (torch.arange(L, device=self.device)[None] == own[:, None])  # own column

    def get_state(self, key: LayerKey) -> Any:
        raise NotImplementedError("the serving KV pool supports attention mixers only")

    def set_state(self, key: LayerKey, value: Any) -> None:
        raise NotImplementedError("the serving KV pool supports attention mixers only")

    def advance(self, num_tokens: int) -> None:
        """Protocol no-op: each row's length is tracked by its sequence, not by the pool."""

    def nbytes(self) -> int:
        """Allocated KV bytes (code rows, and a window's bf16 entries, under `kv_quant`); safe to call from
        another thread (the metrics scrape) while the engine adds layers."""
        window = self.codes.window_nbytes() if self.codes is not None else 0
        return window + sum(K.nbytes + V.nbytes for K, V in list(self.kv.values()))

    @property
    def orders(self) -> dict[tuple, Tensor]:
        """Each row's calibrated channel order per (layer, side) (`RowCodecs`; empty for floats)."""
        return self.row_codecs.orders if self.row_codecs is not None else {}

    def state_nbytes(self) -> int:
        """Quantizer state, not per token (`RowCodecs.state_nbytes`; 0 for floats)."""
        return self.row_codecs.state_nbytes() if self.row_codecs is not None else 0

    # ------------------------------------------------------------------ after a call
    @staticmethod
    def takes(policy: KVPolicy) -> bool:
        """Whether rows may follow `policy`: per-layer slots, and a lookup settled when a token closes
        (not `always-last` / `randomized`, which pick entries at every read)."""
        return policy.bound and policy.slots.per_layer and not policy.lookup.reads_per_step

    def set_policy(self, row: int, policy: KVPolicy) -> None:
        if not self.takes(policy):
            raise ValueError(
                f"kv_policy {policy.name!r} is not supported by the serving slot pool (it takes per-layer slots "
                "and the deepest / skip / full lookups); run the request alone"
            )
        self.policies[row] = policy

    def _settle(self, row: int, cols: slice | int, depth: int, row_slots: int) -> None:
        """Columns `cols` of `row` ran `depth` steps: record it and let the row's lookup rule fill."""
        self.depth[row, cols] = depth
        row_slots = min(row_slots, self.slots)  # slots allocated later are settled by `_grow_slots`
        if not 0 < depth < row_slots:  # under a budget k, d >= k wrote every slot (then n <= d)
            return
        src = self.policies[row].lookup.fill_index(torch.tensor([[depth]], device=self.device), row_slots)
        if src is None:
            return
        index = src[:, 0, 0]  # [row_slots]
        for base, (K, V) in self.kv.items():
            if base[0] == "core":
                held = self._held(row, cols) if base in self.windows else cols
                for store in (K, V):
                    store[:row_slots, row, :, held] = store[index, row, :, held]

    def _held(self, row: int, cols: slice | int) -> slice | int:
        """Columns `cols` of `row` (a column, or a slice from 0) as held positions of a windowed base; a
        prompt's columns before the row's first held one are not held."""
        first = self.first[row]
        if isinstance(cols, int):
            return cols - first
        return slice(max(cols.start - first, 0), max(cols.stop - first, 0))

    def close_prefill(self, row: int, length: int, depth: int, row_slots: int) -> None:
        """The prompt columns [0, length) of `row` ran `depth` steps."""
        self._settle(row, slice(0, length), depth, row_slots)

    def close_tokens(self, rows: list[int], cols: list[int], depth: list[int], row_slots: list[int]) -> None:
        """Row rows[b]'s token at column cols[b] ran depth[b] steps (as `StaticRecurrentCache.close`)."""
        for r, c, d, n in zip(rows, cols, depth, row_slots):
            self._settle(r, c, d, n)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Copy columns [0, length) of row `src` to row `dst` (keeps running rows contiguous)."""
        for base, (K, V) in self.kv.items():
            held = min(length - self.first[src], K.shape[3]) if base in self.windows else length
            K[:, dst, :, :held] = K[:, src, :, :held]
            V[:, dst, :, :held] = V[:, src, :, :held]
        if self.windows:
            self.first[dst] = self.first[src]
        self.depth[dst, :length] = self.depth[src, :length]
        self.policies[dst] = self.policies.pop(src)
        if self.row_codecs is not None:
            self.row_codecs.move(src, dst)
            self.codes.move_row(src, dst)


class RowCodecs:
    """The codecs of a quantized pool's calls: each row reads what `rd.generate(..., kv_quant=spec)` reads
    when its request is generated alone.

    Where the spec calibrates outlier channels, they come from each row's own prompt, as `generate`
    alone takes them from a layer's first write: a row's prefill calibrates each layer at its first
    write there (`layer_codec`), the row keeps that channel order per (layer, side) in `orders`
    (`[R, Hkv, D]`, moved with the row), and a call's codec is the shared one permuted by the
    stacked orders of its rows (`permuted`; kept while the same rows come back). The pool tells it
    which rows each call runs (`bind_prefill`, `bind_tokens`) and how many rows it holds (`reserve`)."""

    def __init__(self, kv_quant: KVQuant | str) -> None:
        self.kv_quant = KVQuant.parse(kv_quant)
        self.orders: dict[tuple, Tensor] = {}  # (base, role) -> [R, Hkv, D]: each row's calibrated channel order
        self.calibrated: set[tuple] = set()  # (base, role) the bound prefill has calibrated
        self._permuted: dict[tuple, Codec] = {}  # (base, role, rows) -> that call's codec, until an order changes
        self.rows = 0  # rows the pool holds (an order's first axis)
        self._call_rows: list[int] = []  # the bound call's rows
        self._row_index: Tensor | None = None  # token calls: the same as a tensor; None: a prefill

    def bind_prefill(self, row: int, rows: int) -> None:
        """The next call runs row `row`'s prompt (of `rows` rows held): its layers calibrate at their first write."""
        self.reserve(rows)
        self._call_rows, self._row_index = [row], None
        self.calibrated.clear()

    def bind_tokens(self, rows: list[int], row_index: Tensor) -> None:
        """The next call feeds one token to each of `rows` (also as `row_index` `[B]`)."""
        self._call_rows, self._row_index = rows, row_index

    def __call__(self, key: LayerKey, k: Tensor, v: Tensor) -> tuple[Codec, Codec]:
        base = SlotKVPool.base(key)
        return self._codec(base, "k", k), self._codec(base, "v", v)

    def _codec(self, base: tuple, role: str, x: Tensor) -> Codec:
        prefill = self._row_index is None
        if prefill and (base, role) not in self.calibrated:  # the row's first write of this layer
            self.calibrated.add((base, role))
            own = layer_codec(self.kv_quant, role, x.shape[-1], x)
            if getattr(own, "perm", None) is not None:
                if (base, role) not in self.orders:
                    self.orders[(base, role)] = own.perm.new_zeros(self.rows, *own.perm.shape)
                self.orders[(base, role)][self._call_rows[0]] = own.perm
                self._permuted.clear()
            return own
        order = self.orders.get((base, role))
        if order is None:  # a codec without calibration
            return layer_codec(self.kv_quant, role, x.shape[-1])
        name = (base, role, tuple(self._call_rows))
        codec = self._permuted.get(name)
        if codec is None:
            if len(self._permuted) >= 64:
                self._permuted.clear()
            rows = self._call_rows[0] if prefill else self._row_index
            codec = self._permuted[name] = layer_codec(self.kv_quant, role, x.shape[-1]).permuted(order[rows])
        return codec

    def reserve(self, rows: int) -> None:
        """Room for `rows` rows' orders (the pool grew)."""
        self.rows = max(self.rows, rows)
        for name, order in self.orders.items():
            if order.shape[0] < self.rows:
                self.orders[name] = torch.cat([order, order.new_zeros(self.rows - order.shape[0], *order.shape[1:])])

    def move(self, src: int, dst: int) -> None:
        for order in self.orders.values():
            order[dst] = order[src]
        self._permuted.clear()

    def state_nbytes(self) -> int:
        """Quantizer state, not per token: each row's outlier channels per calibrated (layer, side),
        priced as one D-bit mask per KV head (as `LayerCodecs.state_nbytes`)."""
        return sum(order[..., 0].numel() * math.ceil(order.shape[-1] / 8) for order in self.orders.values())


class QuantizedSlotKVPool(SlotKVPool):
    """`SlotKVPool(kv_quant=...)` under its own name: the pool holding the codec of `kv_quant` (see the
    module docstring and `RowCodecs`)."""

    def __init__(self, kv_quant: KVQuant | str, device: Any = "cpu", windows: Mapping[tuple, int] | None = None,
                 head_dim: int | None = None) -> None:
        super().__init__(device, kv_quant, windows, head_dim)


def make_pool(kv_quant: KVQuant | None, device: Any = "cpu", windows: Mapping[tuple, int] | None = None,
              head_dim: int | None = None) -> SlotKVPool:
    """The batch's KV pool: float entries, or code rows of `kv_quant`; sliding-window bases `windows` hold each
    row's recent columns only (code rows: at least the decode floor of `head_dim`, the model's)."""
    if kv_quant is None:
        return SlotKVPool(device, windows=windows, head_dim=head_dim)
    return QuantizedSlotKVPool(kv_quant, device, windows, head_dim)
