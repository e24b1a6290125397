"""Softmax attention read from quantized code rows: the plain reference.

The fused forms of the same function live with the hardware tuning (`recurrent_depth.accel.quant`:
`torch.compile`d, and `accel.quant_cpp`: hand-written C++ for CPUs); tests compare them with this one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# score(queries [B, Hkv, G T, D], key rows [B, Hkv, S, bytes]) -> [B, Hkv, G T, S];
# combine(weights [B, Hkv, G T, S], value rows [B, Hkv, S, bytes]) -> [B, Hkv, G T, Dv]
Score = Callable[[Tensor, Tensor], Tensor]
Combine = Callable[[Tensor, Tensor], Tensor]


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


def codes_attention(q: Tensor, rows_k: Tensor, rows_v: Tensor, score: Score, combine: Combine,
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
