"""Generation caches keyed by (layer, recurrence step), with per-token depth.

Both storages follow one `KVPolicy` (`recurrent_depth.model.cache`: the slot rule per-step /
shared-K / last-step and the lookup rule deepest / skip, each written once there) and the
`StepCache` protocol (`seq_len`, `update_kv`/`update_heads`, `attend`/`attends_from_codes`, `key_mask`,
`get_state`/`set_state`, `advance`, `close`, `truncate`, `seek`, `nbytes`, `logical_nbytes`):

- `DynamicRecurrentCache`: the plain reference. Entries are stored per column (token position)
  and the deepest-entry lookup is resolved at read time, row by row. Slow, obviously right.
- `StaticRecurrentCache`: preallocated `[num_slots, B, Hkv, capacity, D]` per layer. When a token
  finishes (`close`), the lookup rule settles the slots it did not reach (`Deepest` copies its
  deepest entry into them), so every read is a plain slice. Tests compare the two.

`write_mask` (None or bool `[B, T]`): only those (row, new column) entries are written, the rest
keep their value (rows that already exited, frozen columns). Prelude and coda layers keep one
entry per token. Columns are cache positions; they equal token positions unless a batch has holes
(rejected speculative drafts of one row), which the attention mask hides.

`kv_quant` (a spec, see `recurrent_depth.inference.quant_cache`): the static cache holds the codec
(`kv_codec.CodeRows`) and stores code rows in the same layout; the dynamic reference stores each
entry's codec round trip.

`lookup_generators` (None, or one CPU `torch.Generator` per row; generation sets them from the seed):
the randomized lookup's draws. A row draws only at the reads where it runs and reads elsewhere, one
seed from its generator per read, then one uniform per column newest first, so a left-padded row in
a batch draws what it draws alone and both storages pick the same slots. None: torch's global RNG.

`windows` (base key -> W, from `layer_windows(model)`): sliding-window attention layers whose old columns
are dropped, so a windowed layer holds O(W) columns instead of the whole context. A query at column c of
such a layer sees only columns (c - W, c], so when a write at column `start` runs out of room the storage
keeps the columns from `start - W + 1` on (every query of this call and of later ones sees no older one),
widened down to a multiple of `WINDOW_ALIGN` (`REDUCED_WINDOW_ALIGN` in a bf16 / fp16 store, of a whole 512-column
SDPA block for W >= 512: `window_align`), and
drops the rest (`first[base]`: the first column it still
holds; reads return columns [first, end), from the start of CPU SDPA's key block where they cross one, or 16
columns earlier where they hold fewer (`MIN_READ_COLUMNS`), as zeros before first (`read_start`), and
`key_mask` and the attention's `window_mask` cut their columns to match); it
allocates W more columns than it holds then, so it drops once every ~W writes. Exact where a window
over a row's real tokens is a window over columns (no holes after its left padding) and no write goes back:
`window_back` (0 unless a mode sets it) widens every windowed base's reach (`_reach`) by that many columns for
the modes that write behind a `seek`: speculative decoding sets it each round to the lookahead - 1 drafts its
verify seeks back over, plus the hidden columns (other rows' rejected drafts) within a row's window and
`MULTI_QUERY_WINDOW_SLACK` (`speculative._window_back`); the parallel sampler to the slack alone (its wavefront
never seeks behind its last write's start). A quantized storage drops code rows the same way (each row codes one
vector; the bf16 recent-token window's entries are tagged with their columns and written back where they are held); its
windowed reads decode the held columns, so it keeps at least the fewest that decode bitwise as a longer read does
(`kv_codec.exact_decode_columns`: more than W only at tiny head dims). Kept in full: every layer of a cache built
without `windows`, a core base shared by layers with and without windows (compress-rN). A `seek` or
`truncate` that would read dropped columns is refused (RuntimeError). Slots of one base share its columns, so the
lookup rules (settling at `close`, new slots at growth, per-read picks) act on the held columns as they did on all
of them.
The serving batch's KV pool (`serving.kv_pool.SlotKVPool`, `windows=layer_windows(model)`) bounds its
windowed layers the same way, each row holding its own columns from its own first one (a quantized pool's code
rows too, at least `exact_decode_columns` of them, its window's entries read back at each row's held place).
`RDEPTH_FULL_WINDOW_CACHE=1` (any value but "", "0") turns the bound off: `layer_windows` then names no layer
and every column is kept, as before it (benchmarks/window_cache.py measures the two in one process).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from recurrent_depth.inference.kv_codec import (
    SMALL_MATMUL,
    CodeRows,
    KVQuant,
    LayerCodecs,
    attend_through_codec,
    exact_decode_columns,
    update_heads_through_codec,
    update_kv_head_major,
)
from recurrent_depth.model.cache import (
    DecodeViews,
    KVPolicy,
    attend_floats,
    grown_slot_count,
    no_decode_views,
    parse_kv_policy,
    settle_new_slots,
    update_heads_via_kv,
)

LayerKey = tuple


def _check_steps(num_steps: int) -> None:
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
        raise ValueError(f"num_steps={num_steps!r} is invalid: expected an integer >= 0")


def _masked_state(new: Any, old: Any, rows: Tensor) -> Any:
    """Keep `old` for rows not in `rows` (bool [B]) in every batch-first tensor of a state."""
    if old is None:
        return new
    if isinstance(new, Tensor):
        if new.dim() and new.shape[0] == rows.shape[0] and isinstance(old, Tensor) and old.shape == new.shape:
            return torch.where(rows.view(-1, *([1] * (new.dim() - 1))), new, old)
        return new
    if isinstance(new, list | tuple):
        items = [_masked_state(n, o, rows) for n, o in zip(new, old)]
        # a NamedTuple state (FalconState, TTTKVBState) takes its fields as arguments, not one iterable
        return type(new)(*items) if hasattr(new, "_fields") else type(new)(items)
    if isinstance(new, dict):
        return {k: _masked_state(v, old.get(k), rows) for k, v in new.items()}
    return new


def bind_policy(policy: KVPolicy | str | None, kv_budget: int | None = None,
                core_layers: int | None = None) -> KVPolicy:
    """The policy a cache follows: `policy` (a name or a `KVPolicy`) with `kv_budget`, bound to a model
    with `core_layers` core layers (needed by the official compress-sN / compress-rN)."""
    if isinstance(policy, KVPolicy) and kv_budget is None:
        resolved = policy
    else:
        resolved = parse_kv_policy(policy.name if isinstance(policy, KVPolicy) else policy, kv_budget)
    if resolved.bound:
        return resolved
    if core_layers is None:
        raise ValueError(
            f"kv_policy {resolved.name!r} is given on the official flat step index and needs the model's core "
            "layer count (core_layers=)"
        )
    return resolved.bind(core_layers)


def _gather_slots(store: Tensor, index: Tensor, end: int) -> Tensor:
    """`store` `[S, B, Hkv, C, D]` read at slot `index[b, c]` for each column c < end: `[B, Hkv, end, D]`."""
    cols = store[..., :end, :]
    full = index[None, :, None, :, None].expand(1, cols.shape[1], cols.shape[2], end, cols.shape[4])
    return torch.gather(cols, 0, full)[0]


# A windowed layer drops whole multiples of this many columns: the attention's reductions over the kept columns
# then keep their vector lanes and blocks, so its output is bitwise the full cache's (CPU SDPA; dropping any other
# count rounds its sums otherwise, ~1e-7 a call, which the recurrence amplifies into other logits and tokens).
WINDOW_ALIGN = 16
# A 2-byte float store (bf16, fp16) drops multiples of this many: with MKL's AVX-512 kernels (MKL_CBWR unset or
# AVX512), raw bf16 SDPA reads of 1 to 16 queries whose first held column is an odd multiple of 16 round 1 ulp
# otherwise than the full read in ~1 % of calls (head dims 8, 16, 64), none of 38,000 from a multiple of 32 (torch
# 2.13; MKL_CBWR=AVX2 none at either). MKL_CBWR=AVX2,STRICT (the tests') differs from multiples of 32 and 64 too
# (0.1-0.2 %), none of 12,000 from multiples of 128: bf16 there is not bitwise the full cache's in every read (a
# cost of 96 more columns not paid for a test-only mode; the tests' bitwise window checks run float32).
REDUCED_WINDOW_ALIGN = 32
# A write of several queries behind a seek (a speculative verify, a parallel wavefront) keeps this many columns more
# than its windows need: with MKL's AVX-512 kernels, CPU SDPA rounds a read of 8 to 11 held columns by 2 or more
# queries otherwise than the full read at head dim 8. Measured on torch 2.13 (windows 3 to 32, 1 to 24 queries, GQA
# and MHA): no such read differs at head dims 16, 32, 64 or 128, nor at any on MKL's AVX2 path (MKL_CBWR=AVX2, which
# the tests pin), nor a single-query decode read; the threshold does not grow with head dim, so one constant serves.
MULTI_QUERY_WINDOW_SLACK = 16
FULL_WINDOW_CACHE_ENV = "RDEPTH_FULL_WINDOW_CACHE"  # set: windowed layers keep every column (module docstring)


# CPU SDPA's fused kernel reduces a decode query's keys in blocks of this many columns from the first it is given,
# rescaling between blocks: a read whose held columns cross a block boundary of the full cache's reads is prefixed
# with zero columns (masked: outside every window) back to that block's start, so that its blocks are the full cache's
# (`read_start`; without this, logits differ ~1e-4 from the full cache's once a window crosses column 512).
SDPA_KV_BLOCK = 512
# A read returns at least this many columns where it holds fewer (zeros before `first`, as above): torch's CPU softmax
# sums a row shorter than its float vector (16 lanes with AVX-512, 8 with AVX2) in another order than a longer row,
# so a soft-capped layer's plain attention (`eager_attention`) over 3 to 15 held columns rounded ~30 % of its float32
# softmaxes otherwise than the full read (none of 12,500 over 16 to 40 held columns from a multiple of 16): a bf16
# retrofitted Gemma-2 (window 8) left the full cache's logits by 0.06 after one such read rounded 1 bf16 ulp otherwise.
# At head dims under 25 it is more (`read_floor`): that attention's two float32 matmuls (q @ k^T over D, probs @ v over
# the columns read) run through aten's small-bmm loop below `SMALL_MATMUL` multiply-adds per matrix and through MKL
# above, which round otherwise (a decode read of 24 columns at D = 16: loop; the full read's 25 and more: MKL).
MIN_READ_COLUMNS = 16


def read_floor(head_dim: int | None = None) -> int:
    """The fewest columns a read of a windowed base that dropped returns (`read_start`) at head dim `head_dim` (None:
    unknown): `MIN_READ_COLUMNS`, or enough for a single query's matmuls to take MKL's kernels as the full read's do
    (D x columns >= `SMALL_MATMUL`: 32 at D = 16, 64 at D = 8), a multiple of 16 (its columns keep their lanes)."""
    if head_dim is None:
        return MIN_READ_COLUMNS
    columns = -(-SMALL_MATMUL // head_dim)  # (rounded up)
    return max(MIN_READ_COLUMNS, -(-columns // 16) * 16)


def read_start(first: int, end: int, floor: int = MIN_READ_COLUMNS) -> int:
    """The first column a read of a windowed base holding columns [first, end) returns: `first`, or the start of its
    `SDPA_KV_BLOCK` block where [first, end) crosses a block boundary, or `floored_start` (`floor` columns earlier
    where it holds fewer); the columns before `first` read as zeros."""
    if first % SDPA_KV_BLOCK and first // SDPA_KV_BLOCK != (end - 1) // SDPA_KV_BLOCK:
        return first - first % SDPA_KV_BLOCK
    return floored_start(first, end, floor)


def floored_start(first: int, end: int, floor: int = MIN_READ_COLUMNS) -> int:
    """`first`, or where a read holding fewer than `floor` (`read_floor`) columns [first, end) after a drop starts:
    `floor` columns earlier (a multiple of 16, as `first`: `window_align`), or the start of the `SDPA_KV_BLOCK` block
    that column falls in where it falls before `first`'s (a whole block earlier where `first` starts one)."""
    if not first or end - first >= floor:
        return first
    start = max(first - floor, 0)
    return start if start // SDPA_KV_BLOCK == first // SDPA_KV_BLOCK else start - start % SDPA_KV_BLOCK


def _from_read_start(columns: Tensor, first: int, end: int, dim: int, floor: int = MIN_READ_COLUMNS) -> Tensor:
    """Columns [first, end) along `dim`, prefixed with zero columns back to `read_start(first, end, floor)`."""
    pad = first - read_start(first, end, floor)
    if not pad:
        return columns
    shape = list(columns.shape)
    shape[dim] = pad
    return torch.cat([columns.new_zeros(shape), columns], dim=dim)


def window_align(window: int, dtype: torch.dtype | None = None) -> int:
    """The multiple a windowed layer's first held column is rounded down to: `WINDOW_ALIGN` (`REDUCED_WINDOW_ALIGN`
    for a store of 2-byte floats `dtype`; None: float32), or a whole `SDPA_KV_BLOCK` for a window of at least one
    block. Such a window crosses a block boundary at nearly every read, so `read_start` would copy its held columns
    behind zeros at every read; starting on a block costs at most 511 more columns held (a quarter of 2W at
    W = 1024, 6 % at Mistral's 4096) and no copy."""
    if window >= SDPA_KV_BLOCK:
        return SDPA_KV_BLOCK
    reduced = dtype is not None and dtype.is_floating_point and dtype.itemsize < 4
    return REDUCED_WINDOW_ALIGN if reduced else WINDOW_ALIGN


def window_start(column: int, window: int, dtype: torch.dtype | None = None) -> int:
    """The first column a windowed layer (a store of `dtype`) keeps for a write at `column`: its first query's
    window, from column - window + 1, widened down to a multiple of `window_align(window, dtype)`."""
    align = window_align(window, dtype)
    return max(0, column - window + 1) // align * align


def window_capacity(held: int, window: int) -> int:
    """Columns a windowed base allocates when a write leaves it holding `held` columns: those and `window` more,
    so that it drops columns once every `window` writes or so (capped by the caller at a full store's)."""
    return held + window


def decoding_window_columns(window: int, dtype: torch.dtype | None = None) -> int:
    """The most columns a windowed base of window `window` (a store of `dtype`, None: float32) allocates in
    autoregressive decoding (one column per write, from a prompt of at most `window + window_align(window, dtype) - 1`
    tokens; a longer prompt P allocates P + window until the first drop): `window_capacity` at the write of a column
    c, holding from `window_start(c, window, dtype)`, largest over one alignment period (2 W + align - 1: 2W + 15,
    2W + 31 in bf16 / fp16, or 2W + 511 from W = 512 on; reached at a drop on a period's last column: drops come
    every W + 1 writes). What `rdepth info` prices a windowed layer at."""
    align = window_align(window, dtype)
    return max(window_capacity(column + 1 - window_start(column, window, dtype), window)
               for column in range(window - 1, window - 1 + align))


def layer_windows(model: Any) -> dict[tuple, int]:
    """The window W of each base key (`KVPolicy.split`) whose layers are sliding-window softmax attention:
    `("prelude", i)`, `("core", j)`, `("coda", c)`, and `("core",)` (compress-rN's one store) when every
    core layer has a window (its largest). Empty for a model without windows, or where `RDEPTH_FULL_WINDOW_CACHE`
    says to keep every column (see the module docstring)."""
    if os.environ.get(FULL_WINDOW_CACHE_ENV, "") not in ("", "0"):
        return {}
    from recurrent_depth.model.mixers.attention import Attention  # (only the 'attention' mixer takes a window)

    parts = getattr(model, "transformer", None)
    if parts is None:
        return {}
    windows: dict[tuple, int] = {}
    core: list[int | None] = []
    for part, blocks in (("prelude", "prelude"), ("core", "core_block"), ("coda", "coda")):
        for i, block in enumerate(getattr(parts, blocks, ())):
            attn = getattr(block, "attn", None)
            window = attn.window if type(attn) is Attention else None
            if window is not None:
                windows[(part, i)] = window
            if part == "core":
                core.append(window)
    if core and all(w is not None for w in core):
        windows[("core",)] = max(w for w in core if w is not None)
    return windows


class _CacheBase:
    """What both caches share: policy, states, depth bookkeeping and byte accounting."""

    def __init__(self, batch_size: int, num_steps: int, kv_budget: int | None, device: Any,
                 policy: KVPolicy | str | None = None, core_layers: int | None = None,
                 kv_quant: KVQuant | str | None = None, windows: Mapping[tuple, int] | None = None) -> None:
        _check_steps(num_steps)
        self.policy = bind_policy(policy, kv_budget, core_layers)
        # Quantized entries: one key and one value codec per layer, held by the storage (None: floats).
        self.codecs = LayerCodecs(kv_quant, self.split) if kv_quant is not None else None
        self.codes = CodeRows(kv_quant, self.codecs) if self.codecs is not None else None
        self.kv_quant = self.codes.kv_quant if self.codes is not None else None
        if self.kv_quant is not None and self.kv_quant.window and self.policy.lookup.reads_per_step:
            raise ValueError(f"kv_quant window={self.kv_quant.window} keeps each slot's recent tokens; kv_policy "
                             f"{self.policy.name!r} reads other slots' entries at every read (drop window=)")
        self.num_steps = num_steps
        # Per-step needs one slot per step; a budget never more than the steps run.
        self.core_slots = self.policy.slots.num_slots(num_steps)
        self.batch_size = batch_size
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.seq_len = 0
        self.write_mask: Tensor | None = None
        self.states: dict[tuple, Any] = {}
        self._state_before: dict[tuple, tuple[int, Any]] = {}  # (columns' start, state before them) per non-core key
        self.depth = torch.zeros(batch_size, 0, dtype=torch.long, device=self.device)
        self._entry_bytes: dict[tuple, int] = {}
        self._skips = self.policy.lookup.hides_columns
        self._reads_per_step = self.policy.lookup.reads_per_step
        self._written_end = 0
        self.lookup_generators: list[torch.Generator] | None = None  # see the module docstring
        # Sliding-window bases that drop old columns (module docstring)
        self.windows: dict[tuple, int] = dict(windows or {})
        self.first: dict[tuple, int] = {}  # per windowed base with a storage: the first column it holds
        self._decode_floor: dict[tuple, int] = {}  # per windowed quantized base: the columns it keeps at least
        self._read_floor: dict[tuple, int] = {}  # per windowed base: `read_floor` of its head dim (first write)
        # Columns a later write may start behind a write's start (a speculative round's drafts, then the verify
        # that seeks back over them): each windowed base keeps that many more (module docstring).
        self.window_back = 0

    decode_views = no_decode_views  # (the static cache hands out its stores)

    @property
    def kv_budget(self) -> int | None:
        return self.policy.budget

    @property
    def num_core_slots(self) -> int:
        return self.core_slots

    def split(self, key: LayerKey) -> tuple[tuple, int]:
        return self.policy.split(key, self.core_slots)

    def _uniforms(self, rows: Tensor, n: int) -> Tensor:
        """`[B, n]` draws in [0, 1) for the randomized lookup from `lookup_generators`: rows in `rows` that
        run this step (`write_mask`) draw, the others get zeros (their read is their own slot or discarded)."""
        out = torch.zeros(self.batch_size, n, dtype=torch.float32)  # (float32 draws whatever torch's default dtype)
        drawing = rows if self.write_mask is None else rows & self.write_mask.any(dim=1)
        for b in drawing.nonzero().flatten().tolist():
            # One seed per read, then the columns newest first: left padding only adds draws at the end.
            seed = int(torch.randint(2**62, (), generator=self.lookup_generators[b]))
            out[b] = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).flip(0)
        return out.to(self.device)

    def key_mask(self, key: LayerKey) -> Tensor | None:
        """Bool `[B, seq_len + T]` for a core key under a lookup that hides columns, else None."""
        if not self._skips or key[0] != "core":
            return None
        end = self._written_end
        visible = torch.ones(self.batch_size, end, dtype=torch.bool, device=self.device)
        old = min(self.seq_len, self.depth.shape[1])
        visible[:, :old] = self.policy.visible(key, self.depth[:, :old])
        if not self.first:  # (no windowed base: every column held)
            return visible
        return visible[:, self.first_column(key):]  # the columns the storage returned

    # ------------------------------------------------------------------ protocol
    def get_state(self, key: LayerKey) -> Any:
        skey = self.split(key)
        before = self._state_before.get(skey)
        if before is not None and before[0] == self.seq_len:  # these columns ran it already: read past them
            return before[1]
        return self.states.get(skey)

    def set_state(self, key: LayerKey, value: Any) -> None:
        skey = self.split(key)
        # A prelude / coda layer runs the same columns again at every exit check's readout: each run starts from the
        # state before those columns (see get_state), so a column enters the state once, as its KV entry is
        # rewritten in place. (A core slot that several steps share absorbs each of them: not tracked.)
        if key[0] != "core":
            before = self._state_before.get(skey)
            if before is None or before[0] != self.seq_len:
                self._state_before[skey] = (self.seq_len, self.states.get(skey))
        if self.write_mask is not None:
            value = _masked_state(value, self.states.get(skey), self.write_mask.any(dim=1))
        self.states[skey] = value

    def advance(self, num_tokens: int) -> None:
        self.seq_len += num_tokens
        self._state_before.clear()

    def mark_prompt(self, valid: Tensor) -> None:
        """The prompt's real columns (bool `[B, T]`, False: left padding): quantized entries whose spec
        calibrates outlier channels take each row's from its own real tokens, as when it runs alone."""
        if self.codecs is not None:
            self.codecs.prompt_valid = valid

    def truncate(self, num_columns: int) -> None:
        """Forget every column from `num_columns` on (their storage is reused by later writes)."""
        if not 0 <= num_columns <= self.seq_len:
            raise ValueError(f"cannot truncate a cache of {self.seq_len} columns to {num_columns}")
        self._check_window_reach(num_columns)
        self.seq_len = num_columns
        if self.codes is not None:
            self.codes.forget_columns(num_columns)

    def _check_window_reach(self, column: int) -> None:
        """A write at `column` reads a windowed base from column - W + 1 on: refuse one that needs dropped columns."""
        for base, first in self.first.items():
            if first and column - self.windows[base] + 1 < first:
                raise RuntimeError(
                    f"cannot move a cache to column {column}: layer {base} (window {self.windows[base]}) dropped the "
                    f"columns before {first}; build the cache without windows= to go back this far"
                )

    def _reach(self, base: tuple) -> int:
        """The columns up to a write that a windowed base keeps: its window W (for code rows at least the fewest
        that decode bitwise as a longer read does, `exact_decode_columns`: tiny head dims only), and `window_back`
        more for a write that later seeks back behind this one."""
        return max(self.windows[base], self._decode_floor.get(base, 0)) + self.window_back

    def first_column(self, key: LayerKey) -> int:
        """The first column `key`'s reads return (0 but for a windowed base that dropped): `read_start` of the
        columns its storage holds, up to the last write's end."""
        base = self.split(key)[0]
        return read_start(self.first.get(base, 0), self._written_end, self._floor(base))

    def _floor(self, base: tuple) -> int:
        return self._read_floor.get(base, MIN_READ_COLUMNS)

    def _note_head_dim(self, base: tuple, head_dim: int) -> None:
        """A windowed base's first write: its reads after a drop hold at least `read_floor(head_dim)` columns."""
        if base in self.windows and base not in self._read_floor:
            self._read_floor[base] = read_floor(head_dim)

    def window_positions(self, key: LayerKey, num_tokens: int) -> tuple[list[tuple[Any, int]], Tensor, Tensor | None]:
        """A quantized window's lanes `(layer slot, row)`, the call's columns `[B, T]` and `write_mask`."""
        split = self.split(key)
        cols = torch.arange(self.seq_len, self.seq_len + num_tokens, device=self.device)
        return [(split, b) for b in range(self.batch_size)], cols.expand(self.batch_size, -1), self.write_mask

    def seek(self, num_columns: int) -> None:
        """Make the next write start at column `num_columns`, keeping every entry: used to run more
        steps on columns already written (speculative verification, the parallel wavefront)."""
        if num_columns < 0:
            raise ValueError(f"cannot seek a cache to column {num_columns}")
        self._check_window_reach(num_columns)
        self.seq_len = num_columns

    # ------------------------------------------------------------------ depth and bytes
    def _record_depth(self, depth: Tensor) -> None:
        start, end = self.seq_len, self.seq_len + depth.shape[1]
        if self.depth.shape[1] < end:
            grown = torch.zeros(self.batch_size, max(end, 2 * self.depth.shape[1]), dtype=torch.long,
                                device=self.device)
            grown[:, : self.depth.shape[1]] = self.depth
            self.depth = grown
        self.depth[:, start:end] = depth

    def logical_nbytes(self, valid: Tensor | None = None, core_only: bool = False, end: int | None = None) -> Tensor:
        """Bytes per row `[B]` of the KV entries the policy keeps for columns [0, end) (default seq_len).

        valid: bool `[B, >= end]` marking real columns (None: all). Core layers keep
        min(depth, num_slots) entries per column (a lookup reads those, it stores nothing more),
        prelude and coda layers one; a windowed base only the columns it still holds (from `first`).
        """
        n = self.seq_len if end is None else end
        depth = self.depth[:, :n]
        if depth.shape[1] < n:
            depth = torch.cat([depth, depth.new_zeros(self.batch_size, n - depth.shape[1])], dim=1)
        if valid is None:
            valid = torch.ones_like(depth, dtype=torch.bool)
        valid = valid[:, :n].to(depth.device)
        # (bytes summed per kind of layer and first held column: this runs once a decoded token, for the bytes
        # it reports)
        groups: dict[tuple[bool, int], int] = {}
        for base, nbytes in self._entry_bytes.items():
            core = base[0] == "core"
            if core or not core_only:
                group = (core, self.first.get(base, 0))
                groups[group] = groups.get(group, 0) + nbytes
        total = torch.zeros(self.batch_size, dtype=torch.long, device=self.device)
        per_col = self.policy.slots.entries(depth).clamp(max=self.core_slots)
        for (core, first), nbytes in groups.items():
            held = valid[:, first:]
            total += ((per_col[:, first:] * held) if core else held).sum(dim=1) * nbytes
        if self.codes is not None and self.codes.window is not None:  # the recent tokens' bf16 entries
            total += self.codes.window.logical_nbytes(self.batch_size, valid, n, core_only).to(total.device)
        return total

    def _note_entry(self, base: tuple, k: Tensor, v: Tensor) -> None:
        if base not in self._entry_bytes:
            self._entry_bytes[base] = (k[0, 0].numel() * k.element_size() + v[0, 0].numel() * v.element_size())


class StaticRecurrentCache(_CacheBase):
    """Preallocated KV storage `[num_slots, B, Hkv, capacity, D]` per layer (fast path).

    Capacity doubles when a write runs past it, and so do the core slots: storage starts with
    `INITIAL_SLOTS` of the policy's `num_core_slots` and grows when a step beyond them is written,
    so a deep request only holds the steps it reached (10^5 steps would otherwise zero gigabytes
    before the first step, and a deadline could not stop that). After a forward, `close(depth)`
    fills the slots a token did not reach with its deepest entry, so reads are plain slices.
    """

    INITIAL_SLOTS = 64

    def __init__(
        self, batch_size: int, num_steps: int, kv_budget: int | None = None, capacity: int = 256,
        device: Any = None, policy: KVPolicy | str | None = None, core_layers: int | None = None,
        kv_quant: KVQuant | str | None = None, windows: Mapping[tuple, int] | None = None,
    ) -> None:
        super().__init__(batch_size, num_steps, kv_budget, device, policy, core_layers, kv_quant, windows)
        self.attends_from_codes = self.codes is not None and self.codes.attends_from_codes
        if capacity < 1:
            raise ValueError(f"capacity={capacity} is invalid: expected an integer >= 1")
        self.capacity = capacity
        self.slot_capacity = min(self.core_slots, self.INITIAL_SLOTS)  # core slots allocated
        self.kv: dict[tuple, tuple[Tensor, Tensor]] = {}
        self._views: dict[LayerKey, tuple[Tensor, Tensor]] = {}
        self._decode_lists: dict[tuple, DecodeViews] = {}  # `decode_views` by key tuple

    def _storage(self, base: tuple, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if base not in self.kv:
            S = self.slot_capacity if base[0] == "core" else 1
            B, _, Hkv, D = k.shape
            Dv = v.shape[-1]
            capacity = self.capacity
            if base in self.windows:  # columns before the first query's window are never read
                first = self.first[base] = window_start(self.seq_len, self._reach(base), k.dtype)
                capacity = self._window_capacity(base, first)
            self.kv[base] = (
                torch.zeros(S, B, Hkv, capacity, D, dtype=k.dtype, device=k.device),
                torch.zeros(S, B, Hkv, capacity, Dv, dtype=v.dtype, device=v.device),
            )
            self._note_entry(base, k, v)
        return self.kv[base]

    def _window_capacity(self, base: tuple, first: int) -> int:
        """Columns a windowed base holding columns from `first` allocates: this write's (to `_written_end`) and
        W more, so that it drops columns once every W writes or so; never more than a full store would hold."""
        return min(window_capacity(self._written_end - first, self._reach(base)), self.capacity - first)

    def _held_from(self, base: tuple) -> int:
        """The first column `base` holds, after dropping (a windowed base) the columns no query of the write
        at `seq_len` .. `_written_end` sees, where the write would not fit otherwise."""
        first = self.first.get(base, 0)
        if base not in self.windows or base not in self.kv:
            return first
        K, V = self.kv[base]
        start, end = self.seq_len, self._written_end
        if end - first <= K.shape[3]:
            return first
        # the queries of this write and later ones see columns from start - W + 1 on
        new_first = max(first, window_start(start, self._reach(base), K.dtype))
        capacity = self._window_capacity(base, new_first)
        kept = []
        for store in (K, V):
            fresh = store.new_zeros(*store.shape[:3], capacity, store.shape[-1])
            # every held column from new_first, those this write rewrites too: a write behind the end (a verify
            # over its drafts, a wavefront under a write mask) keeps what it does not rewrite
            fresh[..., : first + store.shape[3] - new_first, :] = store[..., new_first - first :, :]
            kept.append(fresh)
        self.kv[base] = (kept[0], kept[1])
        self.first[base] = new_first
        self._views.clear()
        self._decode_lists.clear()
        return new_first

    def _grow(self, needed: int) -> None:
        capacity = self.capacity
        while capacity < needed:
            capacity *= 2
        for base, (K, V) in self.kv.items():
            if base in self.windows:  # (sized by `_held_from`)
                continue
            newK = K.new_zeros(*K.shape[:3], capacity, K.shape[-1])
            newV = V.new_zeros(*V.shape[:3], capacity, V.shape[-1])
            newK[..., : self.capacity, :] = K
            newV[..., : self.capacity, :] = V
            self.kv[base] = (newK, newV)
        self.capacity = capacity
        self._views.clear()
        self._decode_lists.clear()

    def _grow_slots(self, slot: int) -> None:
        """Allocate core slots up to `slot` (doubling, at most `num_core_slots`). A closed column's new
        slots take what the lookup rule settles them to, from the slots already held."""
        old = self.slot_capacity
        new = grown_slot_count(old, slot, self.core_slots)
        closed = min(self.seq_len, self.depth.shape[1])
        fill = self.policy.lookup.fill_index(self.depth[:, :closed], new) if closed else None
        for base, (K, V) in self.kv.items():
            if base[0] != "core":
                continue
            grown = []
            held = None if fill is None else fill[:, :, self.first.get(base, 0):]  # the columns the base holds
            for store in (K, V):
                bigger = store.new_zeros(new, *store.shape[1:])
                bigger[:old] = store
                if held is not None and held.shape[2]:
                    settle_new_slots(bigger, old, held)
                grown.append(bigger)
            self.kv[base] = (grown[0], grown[1])
        self.slot_capacity = new
        self._views.clear()
        self._decode_lists.clear()

    # `update_kv` (k, v `[B, T, Hkv, D]` written at the next columns, every visible column returned), the
    # same in head-major layout (`[B, Hkv, T, D]` in, `[B, Hkv, S, D]` out) and softmax attention, through
    # the codec the storage holds (None: floats straight to `write_rows`).
    update_kv = update_kv_head_major
    update_heads = update_heads_through_codec
    attend = attend_through_codec

    def write_rows(self, key: LayerKey, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write rows `[B, Hkv, T, width]` (floats, or a codec's code rows) at columns [seq_len, seq_len + T);
        return every column's `[B, Hkv, seq_len + T, width]`."""
        start = self.seq_len
        end = self._written_end = start + k.shape[2]
        if end > self.capacity:
            self._grow(end)
        base = self.split(key)[0]
        if self.codecs is not None and base in self.windows and base not in self._decode_floor:
            codecs = self.codecs.made(key)  # (made by this write's encode; the floor is the base's first write's)
            if codecs is not None:
                self._decode_floor[base] = exact_decode_columns(codecs)
        if self.codecs is None:
            self._note_head_dim(base, min(k.shape[-1], v.shape[-1]))
        elif base in self.windows and base not in self._read_floor:
            codecs = self.codecs.made(key)  # (code rows: the head dim its codecs code)
            if codecs is not None:
                self._note_head_dim(base, min(codec.quantizer.dim for codec in codecs))
        first = self._held_from(base) if self.windows else 0  # (may drop old columns)
        views = self._views.get(key)
        if views is None:
            base, slot = self.split(key)
            if base[0] == "core" and slot >= self.slot_capacity:
                self._grow_slots(slot)
            K, V = self._storage(base, k.transpose(1, 2), v.transpose(1, 2))
            first = self.first.get(base, 0)
            views = self._views[key] = (K[slot], V[slot])  # [B, Hkv, capacity, D]
        Ks, Vs = views
        T = end - start
        new_k, new_v = Ks.narrow(2, start - first, T), Vs.narrow(2, start - first, T)
        if self.write_mask is None:
            new_k.copy_(k)
            new_v.copy_(v)
        else:
            keep = self.write_mask[:, None, :, None]  # [B, 1, T, 1]
            new_k.copy_(torch.where(keep, k, new_k))
            new_v.copy_(torch.where(keep, v, new_v))
        if self._reads_per_step and key[0] == "core":
            closed = min(start, self.depth.shape[1])
            uniform = self._uniforms if self.lookup_generators is not None else None
            index = self.policy.read_slots(key, self.depth[:, :closed], end - closed, uniform)  # [B, end]
            if index is not None:
                base = self.split(key)[0]
                return tuple(_from_read_start(_gather_slots(store, index[:, first:], end - first), first, end, 2,
                                              self._floor(base)) for store in self.kv[base])
        floor = self._floor(self.split(key)[0])
        return (_from_read_start(Ks.narrow(2, 0, end - first), first, end, 2, floor),
                _from_read_start(Vs.narrow(2, 0, end - first), first, end, 2, floor))

    def decode_views(self, keys: Sequence[LayerKey]) -> DecodeViews | None:
        """The stores `[B, Hkv, capacity, width]` of `keys` for a fused decode that writes column `seq_len` of
        every row itself (see `ModelCache.decode_views`): float entries, or code rows with their layers'
        codecs (a read from codes without a window). None under a write mask, for a lookup that hides or
        re-picks columns, or while a key's storage or codecs are not made yet."""
        codes = self.codes
        if codes is not None and (codes.window is not None or codes.kv_quant.attention != "codes"):
            return None
        if self.write_mask is not None or self._skips or self._reads_per_step or self.windows:
            return None  # (a windowed base's columns start at its `first`: the fused decode writes at seq_len)
        found = self._decode_lists.get(keys) if isinstance(keys, tuple) else None
        end = self.seq_len + 1
        if found is None or end > self.capacity:
            splits = [self.split(key) for key in keys]
            if any(base not in self.kv for base, _ in splits):
                return None  # (the first write makes a storage, in the shape of its entries)
            codecs = None if self.codecs is None else [self.codecs.made(key) for key in keys]
            if codecs is not None and any(pair is None for pair in codecs):
                return None
            if end > self.capacity:
                self._grow(end)
            top = max((slot for base, slot in splits if base[0] == "core"), default=-1)
            if top >= self.slot_capacity:
                self._grow_slots(top)
            found = DecodeViews(*([self.kv[base][i][slot] for base, slot in splits] for i in (0, 1)), codecs)
            if isinstance(keys, tuple):
                self._decode_lists[keys] = found
        self._written_end = end
        return found

    def code_target(self, key: LayerKey, num_tokens: int) -> tuple[Tensor, Tensor, int] | None:
        """For a quantized decode call that encodes straight into the storage (`CodeRows.attend`): the
        slot's row stores `[B, Hkv, capacity, bytes]` and the first of the `num_tokens` columns a plain
        write fills, with `write_rows`'s bookkeeping done; None where a write is not plain (a write mask,
        per-step reads, growth, a slot not written yet): then `write_rows` runs."""
        views = self._views.get(key)
        end = self.seq_len + num_tokens
        if (views is None or end > self.capacity or self.write_mask is not None
                or (self._reads_per_step and key[0] == "core") or self.split(key)[0] in self.windows):
            return None  # (a windowed base's columns start at its `first`)
        self._written_end = end
        return views[0], views[1], self.seq_len

    def close(self, depth: Tensor | int, num_tokens: int | None = None) -> None:
        """The columns [seq_len, seq_len + T) ran `depth` ([B, T] or an int) steps; the lookup rule
        settles the slots they did not reach."""
        S = self.slot_capacity
        if isinstance(depth, int):
            value = depth
            depth = torch.full((self.batch_size, num_tokens or 1), value, dtype=torch.long, device=self.device)
            if value >= S:  # every slot written: nothing to settle (and no host sync)
                self._record_depth(depth)
                return
        self._record_depth(depth)
        src = self.policy.lookup.fill_index(depth, S)  # [S, B, T] or None (nothing to copy)
        if src is None or not bool((depth < S).any()):
            return
        for base, (K, V) in self.kv.items():
            if base[0] != "core":
                continue
            start = self.seq_len - self.first.get(base, 0)  # (a windowed base's columns start at its first)
            end = start + depth.shape[1]
            for store in (K, V):
                cols = store[..., start:end, :]  # [S, B, Hkv, T, D]
                index = src[:, :, None, :, None].expand_as(cols)
                store[..., start:end, :] = torch.gather(cols, 0, index)

    def nbytes(self) -> int:
        """Allocated bytes (KV storage plus recurrent states)."""
        total = sum(K.nbytes + V.nbytes for K, V in self.kv.values())
        window = self.codes.window_nbytes() if self.codes is not None else 0
        return total + window + _state_bytes(self.states)

    def core_nbytes(self) -> int:
        window = self.codes.window.nbytes(core_only=True) if self.codes is not None and self.codes.window else 0
        return window + sum(K.nbytes + V.nbytes for base, (K, V) in self.kv.items() if base[0] == "core")


class DynamicRecurrentCache(_CacheBase):
    """The plain reference: per-column entries, the deepest-entry fallback resolved at read time.

    `entries[(base, slot)][col]` is a pair `[B, Hkv, D]`; `written[(base, slot)][col]` is bool `[B]`;
    `deepest[base][col]` is the slot of the deepest step each row wrote (-1 if none). A windowed base's
    entries before its `first` column are None (dropped; the bookkeeping lists keep every column).
    """

    def __init__(
        self, batch_size: int, num_steps: int, kv_budget: int | None = None, device: Any = None,
        policy: KVPolicy | str | None = None, core_layers: int | None = None, kv_quant: KVQuant | str | None = None,
        windows: Mapping[tuple, int] | None = None, **_: Any,
    ) -> None:
        super().__init__(batch_size, num_steps, kv_budget, device, policy, core_layers, kv_quant, windows)
        if self.kv_quant is not None and self.kv_quant.window:
            raise ValueError(f"kv_quant window={self.kv_quant.window} is read per query from the static cache's "
                             "codes; the dynamic reference cache keeps no window (use cache_implementation='static')")
        self.attends_from_codes = False  # a quantized reference stores each entry's round trip and reads floats
        self.entries: dict[tuple, list[tuple[Tensor, Tensor] | None]] = {}
        self.written: dict[tuple, list[Tensor]] = {}
        self.deepest: dict[tuple, list[Tensor]] = {}  # slot of the last step each row wrote
        self.highest: dict[tuple, list[Tensor]] = {}  # the highest slot each row wrote

    def update_kv(self, key: LayerKey, k: Tensor, v: Tensor, ctx: Any = None) -> tuple[Tensor, Tensor]:
        if self.codes is not None:  # the quantized storage's plain reference: each entry as its codec round trip
            k, v = (x.transpose(1, 2) for x in self.codes.round_trip(key, k.transpose(1, 2), v.transpose(1, 2)))
        base, slot = self.split(key)
        self._note_entry(base, k, v)
        self._note_head_dim(base, min(k.shape[-1], v.shape[-1]))
        B, T = k.shape[:2]
        self._written_end = self.seq_len + T
        if base in self.windows:
            # (a quantized reference aligns as the static cache's code rows do: `window_align` of no float dtype)
            dtype = None if self.codes is not None else k.dtype
            self._drop_before(base, window_start(self.seq_len, self._reach(base), dtype))
        entries = self.entries.setdefault((base, slot), [])
        written = self.written.setdefault((base, slot), [])
        deepest = self.deepest.setdefault(base, [])
        highest = self.highest.setdefault(base, [])
        for t in range(T):
            col = self.seq_len + t
            if self.write_mask is None:
                rows = torch.ones(B, dtype=torch.bool, device=k.device)
            else:
                rows = self.write_mask[:, t]
            while len(entries) <= col:  # (a windowed base holds nothing before its first column)
                dropped = len(entries) < self.first.get(base, 0)
                entries.append(None if dropped else (torch.zeros_like(k[:, 0]), torch.zeros_like(v[:, 0])))
                written.append(torch.zeros(B, dtype=torch.bool, device=k.device))
            while len(deepest) <= col:
                deepest.append(torch.full((B,), -1, dtype=torch.long, device=k.device))
                highest.append(torch.full((B,), -1, dtype=torch.long, device=k.device))
            old_k, old_v = entries[col]
            m = rows[:, None, None]
            entries[col] = (torch.where(m, k[:, t], old_k), torch.where(m, v[:, t], old_v))
            written[col] = written[col] | rows
            deepest[col] = torch.where(rows, torch.full_like(deepest[col], slot), deepest[col])
            highest[col] = torch.where(rows, highest[col].clamp(min=slot), highest[col])
        return self._read(base, slot, self.seq_len + T)

    update_heads = update_heads_via_kv
    attend = attend_floats

    def _note_entry(self, base: tuple, k: Tensor, v: Tensor) -> None:
        if self.codecs is None:
            super()._note_entry(base, k, v)
        elif base not in self._entry_bytes:  # the bytes a quantized storage holds
            Hk, Hv = k[0, 0].shape[0], v[0, 0].shape[0]
            self._entry_bytes[base] = (Hk * self.codecs.nbytes("k", k.shape[-1])
                                       + Hv * self.codecs.nbytes("v", v.shape[-1]))

    def _drop_before(self, base: tuple, column: int) -> None:
        """A windowed base: no query from here on sees its columns before `column` (module docstring)."""
        first = self.first.get(base, 0)
        if column <= first and base in self.first:
            return
        for (held_base, _), cols in self.entries.items():
            if held_base == base:
                for col in range(first, min(column, len(cols))):
                    cols[col] = None
        self.first[base] = max(first, column)

    def _has(self, base: tuple, slot: int, col: int, row: int) -> bool:
        written = self.written.get((base, slot), [])
        return col < len(written) and bool(written[col][row])

    def _read(self, base: tuple, slot: int, end: int) -> tuple[Tensor, Tensor]:
        out_k, out_v = [], []
        lookup = self.policy.lookup
        # always-last / randomized: rows with an earlier column that lacks this slot read elsewhere
        lacking = [lookup.reads_per_step and base[0] == "core"
                   and not all(self._has(base, slot, c, b) for c in range(self.seq_len))
                   for b in range(self.batch_size)]
        draws = None  # randomized: the static cache's draws, when the generation's generators are set
        if lookup.name == "randomized" and self.lookup_generators is not None:
            draws = self._uniforms(torch.tensor(lacking, device=self.device), end).cpu()
        for col in range(self.first.get(base, 0), end):  # (a windowed base holds columns from its first)
            k_rows, v_rows = [], []
            for b in range(self.batch_size):
                use = slot
                if lacking[b] and lookup.name == "always-last":
                    use = int(self.highest[base][col][b])
                elif lacking[b]:  # randomized: a slot of this layer at or below this one that the column wrote
                    held = [s for s in range(slot + 1) if self._has(base, s, col, b)]
                    if not held:  # a column the row never wrote (fed after it stopped): hidden, as below
                        use = -1
                    else:  # (the float32 product, as the static cache rounds it)
                        pick = int(torch.randint(len(held), ())) if draws is None else int(draws[b, col] * len(held))
                        use = held[min(pick, len(held) - 1)]
                elif not self._has(base, slot, col, b):
                    # remark 6.1: the deepest entry of this layer (under `Skip` it is hidden by key_mask)
                    use = int(self.deepest[base][col][b])
                stored = self.entries.get((base, use), [])
                if use < 0 or col >= len(stored):  # never written for this row: a hidden column
                    use, stored = slot, self.entries[(base, slot)]
                k_e, v_e = stored[col]
                k_rows.append(k_e[b])
                v_rows.append(v_e[b])
            out_k.append(torch.stack(k_rows))
            out_v.append(torch.stack(v_rows))
        first = self.first.get(base, 0)  # (zero columns before a windowed read that crosses a block: `read_start`)
        K, V = torch.stack(out_k, dim=1), torch.stack(out_v, dim=1)  # [B, end - first, Hkv, D]
        floor = self._floor(base)
        return _from_read_start(K, first, end, 1, floor), _from_read_start(V, first, end, 1, floor)

    def close(self, depth: Tensor | int, num_tokens: int | None = None) -> None:
        if isinstance(depth, int):
            depth = torch.full((self.batch_size, num_tokens or 1), depth, dtype=torch.long, device=self.device)
        self._record_depth(depth)

    def truncate(self, num_columns: int) -> None:
        super().truncate(num_columns)
        for store in (self.entries, self.written, self.deepest, self.highest):
            for key, cols in store.items():
                store[key] = cols[:num_columns]

    def nbytes(self) -> int:
        total = sum(k.nbytes + v.nbytes for cols in self.entries.values() for k, v in filter(None, cols))
        return total + _state_bytes(self.states)

    def core_nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for (base, _), cols in self.entries.items() if base[0] == "core"
                   for k, v in filter(None, cols))


def _state_bytes(states: dict) -> int:
    def walk(value: Any) -> int:
        if isinstance(value, Tensor):
            return value.nbytes
        if isinstance(value, list | tuple):
            return sum(walk(v) for v in value)
        if isinstance(value, dict):
            return sum(walk(v) for v in value.values())
        return 0

    return sum(walk(v) for v in states.values())


CACHE_IMPLEMENTATIONS = ("static", "dynamic")


def make_cache(
    implementation: str, batch_size: int, num_steps: int, kv_budget: int | None = None,
    capacity: int = 256, device: Any = None, policy: KVPolicy | str | None = None, core_layers: int | None = None,
    kv_quant: Any = None, windows: Mapping[tuple, int] | None = None,
) -> StaticRecurrentCache | DynamicRecurrentCache:
    """Build a generation cache: "static" (preallocated, fast) or "dynamic" (plain reference).
    core_layers: the model's core layer count (binds an official compress-sN / compress-rN policy).
    windows: `layer_windows(model)` to drop the columns sliding-window layers no longer see, where every write
    starts at the cache's end (see the module docstring); None: every column is kept.
    kv_quant: None, or a spec (see `recurrent_depth.inference.quant_cache`): the static cache stores code
    rows, the dynamic one (its reference) each entry's codec round trip."""
    if implementation == "static":
        return StaticRecurrentCache(batch_size, num_steps, kv_budget, capacity=capacity, device=device, policy=policy,
                                    core_layers=core_layers, kv_quant=kv_quant, windows=windows)
    if implementation == "dynamic":
        return DynamicRecurrentCache(batch_size, num_steps, kv_budget, device=device, policy=policy,
                                     core_layers=core_layers, kv_quant=kv_quant, windows=windows)
    raise ValueError(f"cache_implementation={implementation!r} is invalid: expected one of {CACHE_IMPLEMENTATIONS}")
