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
permutation is quantizer state (a D-bit mask per head, `LayerCodecs.state_nbytes`), fixed for the
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

Storage. Quantization is a codec a storage holds (`recurrent_depth.inference.kv_codec.CodeRows`),
not a kind of storage: `StaticRecurrentCache(kv_quant=...)` keeps its layout and holds code rows,
`DynamicRecurrentCache(kv_quant=...)` (the plain reference) stores each entry's codec round trip,
and the serving pool does the same (`serving.kv_pool`). `QuantizedRecurrentCache` and
`DequantizedDynamicCache` are those two with a default spec.
"""

from __future__ import annotations

from typing import Any

from recurrent_depth.inference.cache import DynamicRecurrentCache, StaticRecurrentCache
from recurrent_depth.inference.kv_codec import (
    ATTENTION_READS,
    DEFAULT_OUTLIERS,
    OUTLIER_RULES,
    Codec,
    CodeRows,
    KVQuant,
    LayerCodecs,
    layer_codec,
    outlier_permutation,
    parse_kv_quant_option,
    shared_codec,
)
from recurrent_depth.model.cache import KVPolicy
from recurrent_depth.model.recurrent import all_attention
from recurrent_depth.ops.codes_attention import codes_attention

DEFAULT_KV_QUANT = "k=prod:3.5,v=mse:3.5"


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


class QuantizedRecurrentCache(StaticRecurrentCache):
    """`StaticRecurrentCache` holding the codec of `kv_quant` (default TurboQuant 3.5 bits; see the module
    docstring)."""

    def __init__(
        self, batch_size: int, num_steps: int, kv_budget: int | None = None, capacity: int = 256,
        device: Any = None, policy: KVPolicy | str | None = None, kv_quant: Any = DEFAULT_KV_QUANT,
        core_layers: int | None = None,
    ) -> None:
        super().__init__(batch_size, num_steps, kv_budget, capacity=capacity, device=device, policy=policy,
                         core_layers=core_layers, kv_quant=kv_quant)


class DequantizedDynamicCache(DynamicRecurrentCache):
    """The plain reference for quantized caches: `DynamicRecurrentCache` storing each entry as its
    codec round trip (encode then decode), with the same quantizers as `QuantizedRecurrentCache`."""

    def __init__(self, batch_size: int, num_steps: int, kv_budget: int | None = None, device: Any = None,
                 policy: KVPolicy | str | None = None, kv_quant: Any = DEFAULT_KV_QUANT,
                 core_layers: int | None = None, **_: Any) -> None:
        super().__init__(batch_size, num_steps, kv_budget, device=device, policy=policy, core_layers=core_layers,
                         kv_quant=kv_quant)


__all__ = [
    "ATTENTION_READS",
    "DEFAULT_OUTLIERS",
    "OUTLIER_RULES",
    "Codec",
    "CodeRows",
    "DequantizedDynamicCache",
    "KVQuant",
    "LayerCodecs",
    "QuantizedRecurrentCache",
    "codes_attention",
    "kv_quant_for_model",
    "layer_codec",
    "outlier_permutation",
    "parse_kv_quant_option",
    "shared_codec",
]
