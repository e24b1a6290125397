"""Quantized KV storage: the static cache's slots hold bit-packed codes instead of keys and values.

    rd.generate(model, ids, kv_quant="k=prod:3.5,v=mse:3.5")                  # TurboQuant, 3.5 bits
    rd.generate(model, ids, kv_quant="k=prod:2.5,v=mse:2.5", kv_policy="shared-4", exit_criterion="kl")

The spec is `parse_kv_quant`'s `k=METHOD:BITS,v=METHOD:BITS` (a side left out is stored raw bf16),
plus optional `attn=codes|dequantize` (how attention reads the codes, default `codes`) and `seed=N`
(the rotations and sketches; default 0). One key quantizer and one value quantizer per head dim
serve every layer.

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

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from recurrent_depth.inference.cache import DynamicRecurrentCache, LayerKey, StaticRecurrentCache
from recurrent_depth.model.cache import KVPolicy, combine_key_mask
from recurrent_depth.quant import Quantizer, QuantSpec, parse_kv_quant
from recurrent_depth.quant.rows import RowCodec, TurboRows, row_codec

ATTENTION_READS = ("codes", "dequantize")
Codec = RowCodec | TurboRows
UNQUANTIZED = QuantSpec("raw", 16)  # a side the spec leaves out: bf16 through the same packed path


@dataclass(frozen=True)
class KVQuant:
    """A key quantizer spec, a value quantizer spec, the attention read path and the seed."""

    k: QuantSpec = UNQUANTIZED
    v: QuantSpec = UNQUANTIZED
    attention: str = "codes"
    seed: int = 0

    @classmethod
    def parse(cls, spec: Any) -> KVQuant:
        """From `"k=prod:3.5,v=mse:3.5[,attn=codes|dequantize][,seed=N]"` (or a KVQuant)."""
        if isinstance(spec, KVQuant):
            return spec
        if not isinstance(spec, str):
            raise ValueError(f"kv_quant={spec!r} is invalid: expected a string such as 'k=prod:3.5,v=mse:3.5'")
        attention, seed, sides = "codes", 0, []
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
                else:
                    sides.append(part)
            if not sides:
                raise ValueError("give k= and/or v=, e.g. k=prod:3.5,v=mse:3.5")
            specs = parse_kv_quant(",".join(sides))
        except ValueError as exc:
            raise ValueError(f"kv_quant={spec!r} is invalid: {exc}") from None
        return cls(specs.get("k", UNQUANTIZED), specs.get("v", UNQUANTIZED), attention, seed)

    @property
    def name(self) -> str:
        return f"k={self.k},v={self.v},attn={self.attention}" + (f",seed={self.seed}" if self.seed else "")

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


class _Codecs:
    """The key and value codecs of one cache, built once per head dim."""

    def __init__(self, kv_quant: Any) -> None:
        self.kv_quant = KVQuant.parse(kv_quant)
        self._codecs: dict[tuple[str, int], RowCodec | TurboRows] = {}

    def __call__(self, role: str, dim: int) -> RowCodec | TurboRows:
        codec = self._codecs.get((role, dim))
        if codec is None:
            codec = self._codecs[(role, dim)] = row_codec(self.kv_quant.build(role, dim))
        return codec


def causal_scores_mask(scores: Tensor, mask: Tensor | None, is_causal: bool) -> Tensor:
    """Scores `[B, H, T, S]` with SDPA's mask rules applied: a bool mask keeps True, a float mask
    adds, `is_causal` (no mask) keeps the lower triangle aligned at the top left, as SDPA does."""
    if mask is None and is_causal:
        T, S = scores.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool, device=scores.device).tril()
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask


class QuantizedRecurrentCache(StaticRecurrentCache):
    """`StaticRecurrentCache` over code rows (see the module docstring)."""

    def __init__(
        self, batch_size: int, num_steps: int, kv_budget: int | None = None, capacity: int = 256,
        device: Any = None, policy: KVPolicy | str | None = None, kv_quant: Any = "k=prod:3.5,v=mse:3.5",
        core_layers: int | None = None,
    ) -> None:
        super().__init__(batch_size, num_steps, kv_budget, capacity=capacity, device=device, policy=policy,
                         core_layers=core_layers)
        self.codecs = _Codecs(kv_quant)
        self.kv_quant = self.codecs.kv_quant
        self.attends_from_codes = self.kv_quant.attention == "codes"  # softmax attention calls `attend`

    def _store(self, key: LayerKey, k: Tensor, v: Tensor, kernels: Any = None) -> tuple[Tensor, Tensor, Codec, Codec]:
        """Encode and write k, v `[B, Hkv, T, D]`; return every column's code rows and the codecs.
        kernels: fused encode and attention for some codecs (`recurrent_depth.accel.quant`), or None."""
        ck, cv = self.codecs("k", k.shape[-1]), self.codecs("v", v.shape[-1])
        if kernels is not None and kernels.fits(ck, cv, k):
            new_k, new_v = kernels.encode(ck, cv, k, v)
        else:
            new_k, new_v = ck.encode(k), cv.encode(v)
        rows_k, rows_v = super().update_heads(key, new_k, new_v)
        return rows_k, rows_v, ck, cv

    def update_heads(self, key: LayerKey, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The dequantize read: `[B, Hkv, T, D]` in, every column decoded `[B, Hkv, seq_len + T, D]` out."""
        rows_k, rows_v, ck, cv = self._store(key, k, v)
        return ck.decode(rows_k, k.dtype), cv.decode(rows_v, v.dtype)

    def attend(self, key: LayerKey, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None,
               is_causal: bool, kernels: Any = None) -> Tensor:
        """Softmax attention of q `[B, H, T, D]` over every column's codes, the new k, v `[B, Hkv, T, D]`
        written first; the result `[B, H, T, Dv]` equals SDPA over the decoded columns (GQA included).
        kernels: as `_store`'s (the fast runner passes compiled ones; None: these eager functions)."""
        rows_k, rows_v, ck, cv = self._store(key, k, v, kernels)
        key_mask = self.key_mask(key)
        if key_mask is not None:
            attn_mask, is_causal = combine_key_mask(attn_mask, key_mask, q.shape[2]), False
        if kernels is not None and kernels.fits(ck, cv, q):
            return kernels.attend(ck, cv, q, rows_k, rows_v, attn_mask, is_causal)
        return codes_attention(q, rows_k, rows_v, ck.score, cv.combine, attn_mask, is_causal)


def codes_attention(q: Tensor, rows_k: Tensor, rows_v: Tensor, score: Any, combine: Any,
                    attn_mask: Tensor | None, is_causal: bool) -> Tensor:
    """Softmax attention of q `[B, H, T, D]` over code rows `[B, Hkv, S, bytes]`: `score(q, rows_k)`,
    SDPA's mask rules and scale, then `combine(weights, rows_v)`; query head h reads KV head h // (H / Hkv)."""
    B, H, T, D = q.shape
    Hkv, S = rows_k.shape[1], rows_k.shape[2]
    grouped = q.reshape(B, Hkv, (H // Hkv) * T, D)
    scores = score(grouped, rows_k).view(B, H, T, S) * D**-0.5
    weights = torch.softmax(causal_scores_mask(scores, attn_mask, is_causal), dim=-1)
    out = combine(weights.view(B, Hkv, (H // Hkv) * T, S), rows_v)
    return out.view(B, H, T, -1).to(q.dtype)


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
        ck, cv = self.codecs("k", k.shape[-1]), self.codecs("v", v.shape[-1])
        k, v = ck.decode(ck.encode(k), k.dtype), cv.decode(cv.encode(v), v.dtype)
        return super().update_kv(key, k, v, ctx)

    def _note_entry(self, base: tuple, k: Tensor, v: Tensor) -> None:
        if base not in self._entry_bytes:  # the bytes a quantized storage would hold
            Hk, Hv = k[0, 0].shape[0], v[0, 0].shape[0]
            self._entry_bytes[base] = (Hk * self.codecs("k", k.shape[-1]).nbytes
                                       + Hv * self.codecs("v", v.shape[-1]).nbytes)


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
