"""Quantization as a codec a KV storage holds: the spec (`KVQuant`), the row codecs it builds, and
`CodeRows`, which encodes keys and values into code rows before a storage writes them and reads
attention from those rows (see `recurrent_depth.inference.quant_cache` for the whole feature).

A storage (the static generation cache, the serving slot pool) keeps one layout and holds a
`CodeRows` or None: with one, its tensors hold uint8 code rows `[..., bytes]` that it gathers,
copies and grows as it would floats; its `update_heads` returns the decoded columns and its
`attend` reads from the codes (`attends_from_codes`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from recurrent_depth.inference.kv_window import ExactWindow, RecentWindow
from recurrent_depth.model.cache import LayerKey, attend_floats, combine_key_mask
from recurrent_depth.ops.codes_attention import codes_attention, windowed_codes_attention
from recurrent_depth.quant import QJL, ChannelSplit, Quantizer, QuantSpec, parse_kv_quant, select_outlier_channels
from recurrent_depth.quant.rows import RowCodec, TurboRows, row_codec
from recurrent_depth.quant.spec import check_spec_text

ATTENTION_READS = ("codes", "dequantize")
# A split's outliers, per head from the first write: for the keys only, for keys and values; or channels 0..n_out-1.
OUTLIER_RULES = {"keys": ("k",), "calibrated": ("k", "v"), "first": ()}
DEFAULT_OUTLIERS = "keys"
Codec = RowCodec | TurboRows
UNQUANTIZED = QuantSpec("raw", 16)  # a side the spec leaves out: bf16 through the same packed path
MAX_WINDOW = 4096  # window=W's W: recent tokens kept in bf16 (a spec is client text; W bounds its floats)
WINDOW_BYTES = 2  # a window entry's number: bf16


@dataclass(frozen=True)
class KVQuant:
    """A key quantizer spec, a value quantizer spec, the attention read path, the seed, the outlier rule
    and the recent-token window (the last `window` tokens of each sequence kept in bf16; 0: none)."""

    k: QuantSpec = UNQUANTIZED
    v: QuantSpec = UNQUANTIZED
    attention: str = "codes"
    seed: int = 0
    outliers: str = DEFAULT_OUTLIERS
    window: int = 0

    def __post_init__(self) -> None:
        if self.outliers not in OUTLIER_RULES:
            raise ValueError(f"outliers={self.outliers!r} is unknown: expected one of {', '.join(OUTLIER_RULES)}")
        w = self.window
        if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= MAX_WINDOW:
            raise ValueError(f"window={w!r} is invalid: expected an integer in [0, {MAX_WINDOW}] (recent tokens "
                             "kept in bf16)")

    @classmethod
    def parse(cls, spec: Any) -> KVQuant:
        """From `"k=prod:3.5,v=mse:3.5[,attn=codes|dequantize][,seed=N][,outliers=keys|calibrated|first]
        [,window=W]"` (or a KVQuant)."""
        if isinstance(spec, KVQuant):
            return spec
        if not isinstance(spec, str):
            raise ValueError(f"kv_quant={spec!r} is invalid: expected a string such as 'k=prod:3.5,v=mse:3.5'")
        attention, seed, outliers, window, sides = "codes", 0, DEFAULT_OUTLIERS, 0, []
        try:
            check_spec_text(spec, "kv_quant spec")
        except ValueError as exc:
            raise ValueError(f"kv_quant is invalid: {exc}") from None
        try:
            given: set[str] = set()
            for part in spec.split(","):
                name, _, value = part.partition("=")
                name, value = name.strip().lower(), value.strip()
                if name in ("attn", "seed", "outliers", "window"):
                    if name in given:  # as k= and v= twice: the last one silently winning hides a typo
                        raise ValueError(f"{name}= is given twice")
                    given.add(name)
                    value = value.lower()  # as the method and side names
                if name == "attn":
                    if value not in ATTENTION_READS:
                        raise ValueError(f"attn={value!r} is unknown: expected one of {', '.join(ATTENTION_READS)}")
                    attention = value
                elif name == "seed":
                    if not (value.isascii() and value.isdigit()) or len(value) > 19 or int(value) >= 2**63:
                        raise ValueError(f"the spec's seed {value!r} is invalid: expected an integer in [0, 2**63)")
                    seed = int(value)
                elif name == "outliers":
                    outliers = value
                elif name == "window":
                    if not (value.isascii() and value.isdigit()) or len(value) > 5 or int(value) > MAX_WINDOW:
                        raise ValueError(f"window={value!r} is invalid: expected an integer in [0, {MAX_WINDOW}] "
                                         "(recent tokens kept in bf16)")
                    window = int(value)
                else:
                    sides.append(part)
            if not sides:
                raise ValueError("give k= and/or v=, e.g. k=prod:3.5,v=mse:3.5")
            specs = parse_kv_quant(",".join(sides))
            return cls(specs.get("k", UNQUANTIZED), specs.get("v", UNQUANTIZED), attention, seed, outliers, window)
        except ValueError as exc:
            raise ValueError(f"kv_quant={spec!r} is invalid: {exc}") from None

    @property
    def name(self) -> str:
        return (f"k={self.k},v={self.v},attn={self.attention}" + (f",seed={self.seed}" if self.seed else "")
                + (f",outliers={self.outliers}" if self.outliers != DEFAULT_OUTLIERS else "")
                + (f",window={self.window}" if self.window else ""))

    def build(self, role: str, dim: int) -> Quantizer:
        spec = self.k if role == "k" else self.v
        try:
            return spec.build(dim, self.seed)
        except ValueError as exc:
            raise ValueError(f"kv_quant {role}={spec} cannot code this model's head dim {dim}: {exc}") from None

    def bits_per_coordinate(self, head_dim: int, context: int | None = None) -> dict[str, float]:
        """What each side really stores per coordinate at `head_dim`, norms and residual bytes counted:
        bytes per vector x 8 / head_dim (`prod:2.5` is 2.875 at 128: a spec's label is its nominal bits).
        With a window and a `context` (tokens per sequence), the window's bf16 entries are spread over
        the context's tokens: + 16 x min(W, context) / context; without a context, the codes alone."""
        window = self.window_share(context)
        return {role: self.build(role, head_dim).bytes_per_vector * 8 / head_dim + 8 * WINDOW_BYTES * window
                for role in ("k", "v")}

    def window_share(self, context: int | None) -> float:
        """The window's entries per token of a `context`-token sequence: min(W, context) / context (0 without
        a window or a context)."""
        if not self.window or context is None:
            return 0.0
        if isinstance(context, bool) or not isinstance(context, int) or context < 1:
            raise ValueError(f"context={context!r} is invalid: expected an integer >= 1 (tokens per sequence)")
        return min(self.window, context) / context

    def label(self, head_dim: int) -> str:
        """`name` with the true bits per coordinate at `head_dim`, as every interface shows a spec."""
        bits = self.bits_per_coordinate(head_dim)
        window = (f"; + a {self.window}-token bf16 window, {self.window * 2 * WINDOW_BYTES * head_dim} B per layer, "
                  "KV head and sequence") if self.window else ""
        return (f"{self.name} (true bits per coordinate at head dim {head_dim}: k {bits['k']:g}, v {bits['v']:g}"
                f"{window})")

    def bytes_per_token(self, head_dim: int, num_kv_heads: int, num_layers: int = 1,
                        context: int | None = None) -> float:
        """Bytes one token's keys and values take in `num_layers` attention caches, every norm counted (an
        int); with a window and a `context`, its bf16 entries spread over the context's tokens."""
        per_head = self.build("k", head_dim).bytes_per_vector + self.build("v", head_dim).bytes_per_vector
        window = self.window_share(context) * 2 * WINDOW_BYTES * head_dim
        return (per_head + window if window else per_head) * num_kv_heads * num_layers


# torch's CPU matmul runs a one-row product, and a batched one of fewer multiply-adds per matrix than this (aten's
# small-bmm loop), with other kernels than longer ones, which round each column's sums differently.
SMALL_MATMUL = 400


def exact_decode_columns(codecs: tuple[Codec, Codec]) -> int:
    """The fewest columns a decode of these codecs' rows reads so that every column decodes bitwise as in any longer
    read (CPU): 2, and E·D·S >= `SMALL_MATMUL` for the [S, E] @ [E, D] back-projection of a calibrated (per-head)
    codec, E >= D entries per row. A cache that drops columns keeps at least this many (`inference.cache`)."""
    dim = min(codec.quantizer.dim for codec in codecs)
    return max(2, -(-SMALL_MATMUL // (dim * dim)))


def parse_kv_quant_option(spec: Any) -> KVQuant | None:
    """`kv_quant` as the interfaces take it: None (off) or a spec string (see `KVQuant.parse`)."""
    return None if spec is None else KVQuant.parse(spec)


@functools.lru_cache(maxsize=64)
def shared_codec(kv_quant: KVQuant, role: str, dim: int) -> Codec:
    """The row codec of `role` ("k" or "v") at head dim `dim`, built once per spec (split: channels 0..n_out-1
    are the outliers)."""
    return row_codec(kv_quant.build(role, dim))


def outlier_permutation(calibration: Tensor, n_out: int) -> Tensor:
    """`[Hkv, D]` int64: for each KV head of calibration data `[B, Hkv, T, D]`, its `n_out` outlier
    channels (`select_outlier_channels` over the head's B·T vectors) in increasing order, then the rest."""
    dim = calibration.shape[-1]
    perm = []
    for h in range(calibration.shape[1]):
        outliers = select_outlier_channels(calibration[:, h], n_out)
        perm.append(outliers + sorted(set(range(dim)) - set(outliers)))
    return torch.tensor(perm, dtype=torch.long, device=calibration.device)


def row_outlier_permutations(calibration: Tensor, n_out: int, valid: Tensor | None = None) -> Tensor:
    """`[B, Hkv, D]`: each batch row's own `outlier_permutation`, from its real columns only (`valid`
    bool `[B, T]`, None: all), so that a row of a batch keeps the channels it would choose alone."""
    orders = []
    for b in range(calibration.shape[0]):
        row = calibration[b : b + 1]
        if valid is not None and bool(valid[b].any()):
            row = row[:, :, valid[b]]
        orders.append(outlier_permutation(row, n_out))
    return torch.stack(orders)


def layer_codec(kv_quant: Any, role: str, dim: int, calibration: Tensor | None = None,
                valid: Tensor | None = None) -> Codec:
    """One layer's codec for `role` ("k" or "v"): for a channel split on a side the `outliers` rule
    calibrates (keys under `keys`, both under `calibrated`), given calibration data `[B, Hkv, T, dim]`
    (the layer's first keys or values; `valid` bool `[B, T]`: its real columns, None: all), the
    shared codec with each head's channels permuted (`TurboRows.permuted`: outliers first, folded into
    its matrices): by one order `[Hkv, D]` for a single row, by each row's own (`row_outlier_permutations`,
    stacked `[B, Hkv, D]`; one order where they all agree) for a batch, so no row's choice depends on
    the others or on padding. Else the shared codec, whose outliers are channels 0..n_out-1."""
    kv_quant = KVQuant.parse(kv_quant)
    codec = shared_codec(kv_quant, role, dim)
    n_out = calibrated_channels(codec.quantizer)
    if role not in OUTLIER_RULES[kv_quant.outliers] or calibration is None or not n_out:
        return codec
    orders = row_outlier_permutations(calibration, n_out, valid)  # (one row: its one order)
    return codec.permuted(orders[0] if bool((orders == orders[:1]).all()) else orders)


def calibrated_channels(quantizer: Quantizer) -> int:
    """How many outlier channels a quantizer keeps apart (its first ones, unless calibrated): a channel
    split's high-bit group, QJL's bf16 outliers (`qjl:b:outN`); 0 for the others."""
    if isinstance(quantizer, ChannelSplit):
        return len(quantizer.outlier_channels)
    return quantizer.outliers if isinstance(quantizer, QJL) else 0


class LayerCodecs:
    """The key and value codecs of one cache, one pair per layer (`layer_codec`), made at the layer's
    first write from that write's keys and values `[B, Hkv, T, D]`, and kept for the cache's life.
    split: the storage's `(layer key) -> (layer, slot)`."""

    def __init__(self, kv_quant: Any, split: Callable[[LayerKey], tuple[tuple, int]]) -> None:
        self.kv_quant = KVQuant.parse(kv_quant)
        self.split = split
        self._layers: dict[tuple, tuple[Codec, Codec]] = {}  # base (layer) -> (key codec, value codec)
        self._keys: dict[LayerKey, tuple[Codec, Codec]] = {}  # each key seen -> its layer's pair
        self.prompt_valid: Tensor | None = None  # bool [B, T]: the first writes' real columns (None: all)

    def __call__(self, key: LayerKey, k: Tensor, v: Tensor) -> tuple[Codec, Codec]:
        """The (key, value) codecs of `key`'s layer, made from k, v if new (each batch row calibrated
        on its own real columns: see `layer_codec`)."""
        pair = self._keys.get(key)
        if pair is None:
            base = self.split(key)[0]
            pair = self._layers.get(base)
            if pair is None:
                valid = self.prompt_valid
                if valid is not None and tuple(valid.shape) != (k.shape[0], k.shape[2]):
                    valid = None  # a first write that is not the prompt's
                pair = self._layers[base] = (layer_codec(self.kv_quant, "k", k.shape[-1], k, valid),
                                             layer_codec(self.kv_quant, "v", v.shape[-1], v, valid))
            self._keys[key] = pair
        return pair

    def made(self, key: LayerKey) -> tuple[Codec, Codec] | None:
        """The (key, value) codecs of `key`'s layer where its first write made them, else None."""
        pair = self._keys.get(key)
        if pair is None:
            pair = self._layers.get(self.split(key)[0])
            if pair is not None:
                self._keys[key] = pair
        return pair

    def nbytes(self, role: str, dim: int) -> int:
        """Bytes of one vector's row (the same for every layer)."""
        return shared_codec(self.kv_quant, role, dim).nbytes

    def state_nbytes(self) -> int:
        """Quantizer state, not per token: the seed, plus each calibrated layer's per-head outlier masks."""
        return 8 + sum(getattr(codec, "state_nbytes", 0) for pair in self._layers.values() for codec in pair)


# The (key, value) codecs that code one call's k, v `[B, Hkv, T, D]` at a layer key: the one place a
# storage chooses them (`LayerCodecs`: one pair per layer; the serving pool: per-row calibration).
ChooseCodecs = Callable[[LayerKey, Tensor, Tensor], tuple[Codec, Codec]]


class RowStorage(Protocol):
    """What `CodeRows` needs of the storage holding it (and `codes`: the codec it holds, or None)."""

    codes: CodeRows | None

    def write_rows(self, key: LayerKey, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]: ...
    def key_mask(self, key: LayerKey) -> Tensor | None: ...

    def window_positions(self, key: LayerKey, num_tokens: int) -> tuple[list[tuple[Any, int]], Tensor, Tensor | None]:
        """For a window (`kv_quant=...,window=W`): each batch row's lane `(layer slot, storage row)`, the
        columns `[B, T]` the call's tokens are written at, and which it writes (bool `[B, T]`, None: all)."""
        ...


class CodeRows:
    """The codec a KV storage holds when its entries are quantized (see the module docstring).

    The storage's `write_rows(key, k, v)` writes the rows it is given (`[B, Hkv, T, width]`) and returns
    every visible column's; `key_mask` names the columns a lookup hides (after the write)."""

    def __init__(self, kv_quant: Any, choose: ChooseCodecs) -> None:
        self.kv_quant = KVQuant.parse(kv_quant)
        self.choose = choose
        # The last W tokens of each lane in bf16 (`kv_window`), read per query by `attend`.
        self.window = RecentWindow(self.kv_quant.window) if self.kv_quant.window else None
        # softmax attention calls `attend` (always with a window: its reads are per query)
        self.attends_from_codes = self.kv_quant.attention == "codes" or self.window is not None

    def store(self, storage: RowStorage, key: LayerKey, k: Tensor, v: Tensor, kernels: Any = None,
              ) -> tuple[Tensor, Tensor, Codec, Codec]:
        """Encode and write k, v `[B, Hkv, T, D]`; return every column's code rows and the codecs.
        kernels: fused encode and attention for some codecs (`recurrent_depth.accel.quant`), or None."""
        ck, cv = self.choose(key, k, v)
        if kernels is not None and kernels.fits(ck, cv, k):
            new_k, new_v = kernels.encode(ck, cv, k, v)
        else:
            new_k, new_v = ck.encode(k), cv.encode(v)
        rows_k, rows_v = storage.write_rows(key, new_k, new_v)
        return rows_k, rows_v, ck, cv

    def update_heads(self, storage: RowStorage, key: LayerKey, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The dequantize read: `[B, Hkv, T, D]` in, every visible column decoded `[B, Hkv, S, D]` out. With a
        window, the columns in the call's last query's window hold their bf16 entries (the same columns
        `attend` reads exactly for that query; earlier queries of a longer call read theirs only there)."""
        window = self._window(storage, key, k, v)
        rows_k, rows_v, ck, cv = self.store(storage, key, k, v)
        K, V = ck.decode(rows_k, k.dtype), cv.decode(rows_v, v.dtype)
        if window is not None:
            # (the returned columns start at the storage's first held one: a sliding-window layer drops older ones;
            # an int, or `[B]` each row's own where rows hold different columns: the serving pool)
            first = storage.first_column(key) if hasattr(storage, "first_column") else 0
            cols = window.cols - torch.as_tensor(first, device=window.cols.device).reshape(-1, 1)  # [B, E] returned
            last = window._replace(qcols=window.qcols[:, -1:])
            held = (cols >= 0) & (cols < K.shape[2])
            reads = last.in_window()[:, 0] & held  # [B, E]
            for b, e in reads.nonzero().tolist():
                col = int(cols[b, e])
                K[b, :, col] = window.k[b, :, e].to(K.dtype)
                V[b, :, col] = window.v[b, :, e].to(V.dtype)
        return K, V

    def _window(self, storage: RowStorage, key: LayerKey, k: Tensor, v: Tensor) -> ExactWindow | None:
        """The call's exact entries, the new tokens entering the window (None without a window)."""
        if self.window is None:
            return None
        lanes, cols, written = storage.window_positions(key, k.shape[2])
        return self.window.read_and_write(lanes, cols, written, k, v)

    def attend(self, storage: RowStorage, key: LayerKey, q: Tensor, k: Tensor, v: Tensor,
               attn_mask: Tensor | None, is_causal: bool, kernels: Any = None) -> Tensor:
        """Softmax attention of q `[B, H, T, D]` over every visible column's codes, the new k, v
        `[B, Hkv, T, D]` written first; the result `[B, H, T, Dv]` equals SDPA over the decoded
        columns (GQA included), the storage's `key_mask` applied. kernels: as `store`'s (the fast
        runner passes compiled ones; None: these eager functions)."""
        window = self._window(storage, key, k, v)
        if window is None and kernels is not None:
            fused = self._encode_and_attend(storage, key, q, k, v, attn_mask, is_causal, kernels)
            if fused is not None:
                return fused
        rows_k, rows_v, ck, cv = self.store(storage, key, k, v, kernels)
        key_mask = storage.key_mask(key)
        if key_mask is not None:
            attn_mask, is_causal = combine_key_mask(attn_mask, key_mask, q.shape[2]), False
        if window is not None:  # the eager read (the fused kernels read codes only)
            if self.kv_quant.attention == "codes":
                score, combine = ck.score, cv.combine
            else:
                def score(x: Tensor, rows: Tensor) -> Tensor:
                    return x.float() @ ck.decode(rows).transpose(-1, -2)

                def combine(w: Tensor, rows: Tensor) -> Tensor:
                    return w @ cv.decode(rows)
            return windowed_codes_attention(q, rows_k, rows_v, score, combine, attn_mask, is_causal, window)
        if kernels is not None and kernels.fits(ck, cv, q):
            return kernels.attend(ck, cv, q, rows_k, rows_v, attn_mask, is_causal)
        return codes_attention(q, rows_k, rows_v, ck.score, cv.combine, attn_mask, is_causal)

    def _encode_and_attend(self, storage: RowStorage, key: LayerKey, q: Tensor, k: Tensor, v: Tensor,
                           attn_mask: Tensor | None, is_causal: bool, kernels: Any) -> Tensor | None:
        """A decode call as one kernel call where the kernels fuse it and the storage writes plainly
        (`code_target`): the new codes written into the storage's rows, then read with every column's;
        the same bytes and result as `store` then `kernels.attend`. None: not here (nothing written)."""
        fuses, target = getattr(kernels, "fuses", None), getattr(storage, "code_target", None)
        if fuses is None or target is None:
            return None
        ck, cv = self.choose(key, k, v)
        if not fuses(ck, cv, q, k, is_causal):
            return None
        found = target(key, k.shape[2])
        if found is None:
            return None
        key_mask = storage.key_mask(key)
        if key_mask is not None:
            attn_mask = combine_key_mask(attn_mask, key_mask, q.shape[2])
        store_k, store_v, start = found
        return kernels.decode_attend(ck, cv, q, k, v, store_k, store_v, start, attn_mask)

    # The window's life follows the storage's rows and columns.
    def forget_columns(self, num_columns: int) -> None:
        if self.window is not None:
            self.window.forget_columns(num_columns)

    def forget_row(self, row: int) -> None:
        if self.window is not None:
            self.window.forget_row(row)

    def move_row(self, src: int, dst: int) -> None:
        if self.window is not None:
            self.window.move_row(src, dst)

    def window_nbytes(self) -> int:
        """Allocated bytes of the window's bf16 entries (0 without one)."""
        return self.window.nbytes() if self.window is not None else 0

    def round_trip(self, key: LayerKey, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v `[B, Hkv, T, D]` as their codes decode (the plain reference's entries)."""
        ck, cv = self.choose(key, k, v)
        return ck.decode(ck.encode(k), k.dtype), cv.decode(cv.encode(v), v.dtype)


# A storage holding a codec or None uses these three as its `update_kv`, `update_heads` and `attend`.
def update_kv_head_major(storage: RowStorage, key: LayerKey, k: Tensor, v: Tensor, ctx: Any = None,
                         ) -> tuple[Tensor, Tensor]:
    """`update_kv` of a storage that keeps head-major rows: k, v `[B, T, Hkv, D]` stored through its
    `update_heads`; every visible column `[B, S, Hkv, D]` returned."""
    K, V = storage.update_heads(key, k.transpose(1, 2), v.transpose(1, 2))
    return K.transpose(1, 2), V.transpose(1, 2)


def update_heads_through_codec(storage: RowStorage, key: LayerKey, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """`update_heads` of a storage that may hold a codec: k, v `[B, Hkv, T, D]` written (as code rows when it
    holds one), every visible column `[B, Hkv, S, D]` returned (decoded)."""
    if storage.codes is not None:
        return storage.codes.update_heads(storage, key, k, v)
    return storage.write_rows(key, k, v)


def attend_through_codec(storage: RowStorage, key: LayerKey, q: Tensor, k: Tensor, v: Tensor,
                         attn_mask: Tensor | None, is_causal: bool, kernels: Any = None) -> Tensor:
    """`attend` of a storage that may hold a codec: from the codes (`CodeRows.attend`), else SDPA."""
    if storage.codes is not None:
        return storage.codes.attend(storage, key, q, k, v, attn_mask, is_causal, kernels)
    return attend_floats(storage, key, q, k, v, attn_mask, is_causal)
