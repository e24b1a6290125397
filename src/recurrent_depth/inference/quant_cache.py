"""Quantized KV storage: the static cache's slots hold bit-packed codes instead of keys and values.

    rd.generate(model, ids, kv_quant="k=prod:3.5,v=mse:3.5")                  # TurboQuant, 3.5 bits
    rd.generate(model, ids, kv_quant="k=prod:2.5,v=mse:2.5", kv_policy="shared-4", exit_criterion="kl")

The spec is `parse_kv_quant`'s `k=METHOD:BITS,v=METHOD:BITS` (a side left out is stored raw bf16),
plus optional `attn=codes|dequantize` (how attention reads the codes, default `codes`), `seed=N`
(the rotations and sketches; default 0) and `outliers=keys|calibrated|first` (a channel split's
outlier channels: calibrated for the keys only (default), for keys and values, or the first n_out
channels). One key quantizer and one value quantizer per head dim serve every layer; a calibrated
side permutes each layer's KV heads' channels first, so that a head's outlier channels (the n_out
channels of largest mean square in the layer's first write: the prompt at prefill;
`select_outlier_channels`) are the split's high-bit group (`layer_codec`). The
permutation is quantizer state (a D-bit mask per head, `_Codecs.state_nbytes`), fixed for the
cache's life and shared by every step and slot of the layer, so lookups, growth, truncation and
seeks move rows as before.

Layout. Each (layer, slot) keeps one uint8 row per (batch row, KV head, column): that vector's code
(packed indices, packed sign bits, fp16 norms; `recurrent_depth.quant.rows`, whose `TurboRows`
runs TurboQuant in a few fused kernels per call) laid end to end. Every storage is
then a `[S, B, Hkv, capacity, bytes]` uint8 tensor, and the static cache's slot rules, lookups
(the deepest fill is a gather of rows along S), write masks, growth, truncation and seeks apply to
it unchanged. An entry's bytes are exactly its codes' bytes, every norm counted; nothing else per
token is kept (recurrent states of linear mixers, if any, are stored as they are).

Reads. A call encodes its new keys and values (prompt and generated tokens alike), writes their
codes, and the attention then reads every column from the codes, the new ones included, so no
full-precision entry outlives the call. Two read paths compute the same function (tests):
- `dequantize`: decode the columns' keys and values, then the usual SDPA;
- `codes`: score the queries against the key codes (asymmetric: queries stay full precision, and
  TurboQuant_prod's QJL part is ⟨S Πq, signs⟩ without a decoded key), softmax, and sum the values
  in the rotated basis (one inverse rotation per query instead of one per key). Softmax attention
  layers call it through `attend` (see the fast runner and the attention mixer); other mixers read
  through `update_kv`, the dequantize path. The fast runner's decode calls pass `torch.compile`d
  kernels of the same functions for TurboQuant codecs (`recurrent_depth.accel.quant`).
`codes` is the default because benchmarks/kv_memory.py measured it faster (docs/quant.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from recurrent_depth.inference.cache import DynamicRecurrentCache, LayerKey, StaticRecurrentCache
from recurrent_depth.model.cache import KVPolicy, combine_key_mask
from recurrent_depth.model.recurrent import all_attention
from recurrent_depth.ops.codes_attention import codes_attention
from recurrent_depth.quant import ChannelSplit, Quantizer, QuantSpec, parse_kv_quant, select_outlier_channels
from recurrent_depth.quant.rows import RowCodec, TurboRows, row_codec

ATTENTION_READS = ("codes", "dequantize")
# A split's outliers, per head from the first write: for the keys only, for keys and values; or channels 0..n_out-1.
OUTLIER_RULES = {"keys": ("k",), "calibrated": ("k", "v"), "first": ()}
DEFAULT_OUTLIERS = "keys"
Codec = RowCodec | TurboRows
UNQUANTIZED = QuantSpec("raw", 16)  # a side the spec leaves out: bf16 through the same packed path


@dataclass(frozen=True)
class KVQuant:
    """A key quantizer spec, a value quantizer spec, the attention read path, the seed and the outlier rule."""

    k: QuantSpec = UNQUANTIZED
    v: QuantSpec = UNQUANTIZED
    attention: str = "codes"
    seed: int = 0
    outliers: str = DEFAULT_OUTLIERS

    def __post_init__(self) -> None:
        if self.outliers not in OUTLIER_RULES:
            raise ValueError(f"outliers={self.outliers!r} is unknown: expected one of {', '.join(OUTLIER_RULES)}")

    @classmethod
    def parse(cls, spec: Any) -> KVQuant:
        """From `"k=prod:3.5,v=mse:3.5[,attn=codes|dequantize][,seed=N][,outliers=keys|calibrated|first]"`
        (or a KVQuant)."""
        if isinstance(spec, KVQuant):
            return spec
        if not isinstance(spec, str):
            raise ValueError(f"kv_quant={spec!r} is invalid: expected a string such as 'k=prod:3.5,v=mse:3.5'")
        attention, seed, outliers, sides = "codes", 0, DEFAULT_OUTLIERS, []
        try:
            for part in spec.split(","):
                name, _, value = part.partition("=")
                name, value = name.strip().lower(), value.strip()
                if name == "attn":
                    if value not in ATTENTION_READS:
                        raise ValueError(f"attn={value!r} is unknown: expected one of {', '.join(ATTENTION_READS)}")
                    attention = value
                elif name == "seed":
                    if not value.isdigit():
                        raise ValueError(f"seed={value!r} is invalid: expected an integer >= 0")
                    seed = int(value)
                elif name == "outliers":
                    outliers = value
                else:
                    sides.append(part)
            if not sides:
                raise ValueError("give k= and/or v=, e.g. k=prod:3.5,v=mse:3.5")
            specs = parse_kv_quant(",".join(sides))
            return cls(specs.get("k", UNQUANTIZED), specs.get("v", UNQUANTIZED), attention, seed, outliers)
        except ValueError as exc:
            raise ValueError(f"kv_quant={spec!r} is invalid: {exc}") from None

    @property
    def name(self) -> str:
        return (f"k={self.k},v={self.v},attn={self.attention}" + (f",seed={self.seed}" if self.seed else "")
                + (f",outliers={self.outliers}" if self.outliers != DEFAULT_OUTLIERS else ""))

    def build(self, role: str, dim: int) -> Quantizer:
        spec = self.k if role == "k" else self.v
        try:
            return spec.build(dim, self.seed)
        except ValueError as exc:
            raise ValueError(f"kv_quant {role}={spec} cannot code this model's head dim {dim}: {exc}") from None

    def bytes_per_token(self, head_dim: int, num_kv_heads: int, num_layers: int = 1) -> int:
        """Bytes one token's keys and values take in `num_layers` attention caches, every norm counted."""
        per_head = self.build("k", head_dim).bytes_per_vector + self.build("v", head_dim).bytes_per_vector
        return per_head * num_kv_heads * num_layers


def parse_kv_quant_option(spec: Any) -> KVQuant | None:
    """`kv_quant` as the interfaces take it: None (off) or a spec string (see `KVQuant.parse`)."""
    return None if spec is None else KVQuant.parse(spec)


def kv_quant_for_model(model: Any, spec: Any, name: str = "kv_quant") -> KVQuant:
    """`spec` parsed and checked against the model before any work: every layer softmax attention
    (other mixers' caches hold other tensors) and a head dim the quantizers take; else a ValueError
    naming `name` (the option as the caller spells it)."""
    kv_quant = KVQuant.parse(spec)
    cfg = model.config
    if not all_attention(model):
        raise ValueError(f"{name}={spec!r} quantizes softmax-attention keys and values; this model's mixer is "
                         f"{cfg.mixer!r}, whose cache holds other tensors (drop {name})")
    kv_quant.bytes_per_token(cfg.head_dim, cfg.num_kv_heads)
    return kv_quant


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


def layer_codec(kv_quant: Any, role: str, dim: int, calibration: Tensor | None = None,
                ) -> Codec:
    """One layer's codec for `role` ("k" or "v"): for a channel split on a side the `outliers` rule
    calibrates (keys under `keys`, both under `calibrated`), given calibration data `[B, Hkv, T, dim]`
    (the layer's first keys or values), the shared codec with each head's channels permuted by
    `outlier_permutation` (`TurboRows.permuted`: outliers first, folded into its matrices); else the
    shared codec, whose outliers are channels 0..n_out-1. (A storage that calibrates each batch row
    on its own can stack rows' permutations `[B, Hkv, D]` into one `permuted` codec.)"""
    kv_quant = KVQuant.parse(kv_quant)
    codec = shared_codec(kv_quant, role, dim)
    split = codec.quantizer
    if role not in OUTLIER_RULES[kv_quant.outliers] or calibration is None or not isinstance(split, ChannelSplit):
        return codec
    return codec.permuted(outlier_permutation(calibration, len(split.outlier_channels)))


class _Codecs:
    """The key and value codecs of one cache, one pair per layer (`layer_codec`), made at the layer's
    first write from that write's keys and values `[B, Hkv, T, D]`, and kept for the cache's life."""

    def __init__(self, kv_quant: Any) -> None:
        self.kv_quant = KVQuant.parse(kv_quant)
        self._layers: dict[tuple, tuple[Codec, Codec]] = {}  # base (layer) -> (key codec, value codec)
        self._keys: dict[LayerKey, tuple[Codec, Codec]] = {}  # each key seen -> its layer's pair

    def __call__(self, key: LayerKey, split: Callable[[LayerKey], tuple[tuple, int]], k: Tensor, v: Tensor,
                 ) -> tuple[Codec, Codec]:
        """The (key, value) codecs of `key`'s layer (`split(key)` = (layer, slot)), made from k, v if new."""
        pair = self._keys.get(key)
        if pair is None:
            base = split(key)[0]
            pair = self._layers.get(base)
            if pair is None:
                pair = self._layers[base] = (layer_codec(self.kv_quant, "k", k.shape[-1], k),
                                             layer_codec(self.kv_quant, "v", v.shape[-1], v))
            self._keys[key] = pair
        return pair

    def nbytes(self, role: str, dim: int) -> int:
        """Bytes of one vector's row (the same for every layer)."""
        return shared_codec(self.kv_quant, role, dim).nbytes

    def state_nbytes(self) -> int:
        """Quantizer state, not per token: the seed, plus each calibrated layer's per-head outlier masks."""
        return 8 + sum(getattr(codec, "state_nbytes", 0) for pair in self._layers.values() for codec in pair)


class CodeRowStorage:
    """What makes a float KV storage a quantized one, for any storage whose `update_heads` writes
    the rows it is given and returns every visible column, with `key_mask` for the columns a
    lookup hides: the static cache (`QuantizedRecurrentCache`) and the serving pool
    (`serving.kv_pool.QuantizedSlotKVPool`). Put it first among the bases; `use_codes` in `__init__`.

    Keys and values are encoded into code rows before the storage sees them, so it holds uint8
    rows `[..., bytes]` and gathers, copies and grows them as it would floats."""

    codecs: _Codecs
    kv_quant: KVQuant
    attends_from_codes: bool  # softmax attention calls `attend` (see the fast runner and the attention mixer)

    def use_codes(self, kv_quant: Any) -> None:
        self.codecs = _Codecs(kv_quant)
        self.kv_quant = self.codecs.kv_quant
        self.attends_from_codes = self.kv_quant.attention == "codes"

    def layer_codecs(self, key: LayerKey, k: Tensor, v: Tensor) -> tuple[Codec, Codec]:
        """The (key, value) codecs that code this call's k, v `[B, Hkv, T, D]` at `key`: the one place
        a storage chooses them (here one pair per layer, calibrated from its first write)."""
        return self.codecs(key, self.split, k, v)

    def _store(self, key: LayerKey, k: Tensor, v: Tensor, kernels: Any = None) -> tuple[Tensor, Tensor, Codec, Codec]:
        """Encode and write k, v `[B, Hkv, T, D]`; return every column's code rows and the codecs.
        kernels: fused encode and attention for some codecs (`recurrent_depth.accel.quant`), or None."""
        ck, cv = self.layer_codecs(key, k, v)
        if kernels is not None and kernels.fits(ck, cv, k):
            new_k, new_v = kernels.encode(ck, cv, k, v)
        else:
            new_k, new_v = ck.encode(k), cv.encode(v)
        rows_k, rows_v = super().update_heads(key, new_k, new_v)
        return rows_k, rows_v, ck, cv

    def update_heads(self, key: LayerKey, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The dequantize read: `[B, Hkv, T, D]` in, every visible column decoded `[B, Hkv, S, D]` out."""
        rows_k, rows_v, ck, cv = self._store(key, k, v)
        return ck.decode(rows_k, k.dtype), cv.decode(rows_v, v.dtype)

    def attend(self, key: LayerKey, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None,
               is_causal: bool, kernels: Any = None) -> Tensor:
        """Softmax attention of q `[B, H, T, D]` over every visible column's codes, the new k, v
        `[B, Hkv, T, D]` written first; the result `[B, H, T, Dv]` equals SDPA over the decoded
        columns (GQA included), the storage's `key_mask` applied. kernels: as `_store`'s (the fast
        runner passes compiled ones; None: these eager functions)."""
        rows_k, rows_v, ck, cv = self._store(key, k, v, kernels)
        key_mask = self.key_mask(key)
        if key_mask is not None:
            attn_mask, is_causal = combine_key_mask(attn_mask, key_mask, q.shape[2]), False
        if kernels is not None and kernels.fits(ck, cv, q):
            return kernels.attend(ck, cv, q, rows_k, rows_v, attn_mask, is_causal)
        return codes_attention(q, rows_k, rows_v, ck.score, cv.combine, attn_mask, is_causal)


class QuantizedRecurrentCache(CodeRowStorage, StaticRecurrentCache):
    """`StaticRecurrentCache` over code rows (see the module docstring)."""

    def __init__(
        self, batch_size: int, num_steps: int, kv_budget: int | None = None, capacity: int = 256,
        device: Any = None, policy: KVPolicy | str | None = None, kv_quant: Any = "k=prod:3.5,v=mse:3.5",
        core_layers: int | None = None,
    ) -> None:
        super().__init__(batch_size, num_steps, kv_budget, capacity=capacity, device=device, policy=policy,
                         core_layers=core_layers)
        self.use_codes(kv_quant)


class DequantizedDynamicCache(DynamicRecurrentCache):
    """The plain reference for quantized caches: `DynamicRecurrentCache` storing each entry as its
    codec round trip (encode then decode), with the same quantizers as `QuantizedRecurrentCache`."""

    def __init__(self, batch_size: int, num_steps: int, kv_budget: int | None = None, device: Any = None,
                 policy: KVPolicy | str | None = None, kv_quant: Any = "k=prod:3.5,v=mse:3.5",
                 core_layers: int | None = None, **_: Any) -> None:
        super().__init__(batch_size, num_steps, kv_budget, device=device, policy=policy, core_layers=core_layers)
        self.codecs = _Codecs(kv_quant)
        self.kv_quant = self.codecs.kv_quant

    def update_kv(self, key: LayerKey, k: Tensor, v: Tensor, ctx: Any = None) -> tuple[Tensor, Tensor]:
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, T, Hkv, D] -> the codecs' head-major layout
        ck, cv = self.codecs(key, self.split, k, v)
        k, v = ck.decode(ck.encode(k), k.dtype), cv.decode(cv.encode(v), v.dtype)
        return super().update_kv(key, k.transpose(1, 2), v.transpose(1, 2), ctx)

    def _note_entry(self, base: tuple, k: Tensor, v: Tensor) -> None:
        if base not in self._entry_bytes:  # the bytes a quantized storage would hold
            Hk, Hv = k[0, 0].shape[0], v[0, 0].shape[0]
            self._entry_bytes[base] = (Hk * self.codecs.nbytes("k", k.shape[-1])
                                       + Hv * self.codecs.nbytes("v", v.shape[-1]))


def make_quantized_cache(implementation: str, batch_size: int, num_steps: int, kv_budget: int | None = None,
                         capacity: int = 256, device: Any = None, policy: KVPolicy | str | None = None,
                         kv_quant: Any = None, core_layers: int | None = None,
                         ) -> QuantizedRecurrentCache | DequantizedDynamicCache:
    """`make_cache` with `kv_quant`: "static" stores codes, "dynamic" is its dequantized reference."""
    if implementation == "static":
        return QuantizedRecurrentCache(batch_size, num_steps, kv_budget, capacity=capacity, device=device,
                                       policy=policy, kv_quant=kv_quant, core_layers=core_layers)
    return DequantizedDynamicCache(batch_size, num_steps, kv_budget, device=device, policy=policy, kv_quant=kv_quant,
                                   core_layers=core_layers)
