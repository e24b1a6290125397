"""Softmax attention read from quantized code rows: the plain reference.

The fused forms of the same function live with the hardware tuning (`recurrent_depth.accel.quant`:
`torch.compile`d, and `accel.quant_cpp`: hand-written C++ for CPUs); tests compare them with this one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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


def windowed_scores(q: Tensor, rows_k: Tensor, score: Score, attn_mask: Tensor | None, is_causal: bool,
                    window: Any) -> Tensor:
    """The scores `[B, H, T, S + E]` (SDPA's scale, masks as -inf) of queries q `[B, H, T, D]` over the code
    columns `[B, Hkv, S, bytes]` and then `window`'s E exact entries (an `ExactWindow`: k, v `[B, Hkv, E, D]`
    at storage columns `cols` `[B, E]`, queries at columns `qcols` `[B, T]`): for query t, the columns in
    its window (after qcol − size) are read from their entries and hidden among the codes; an entry takes
    its column's mask (SDPA's rules, as the codes). Query head h reads KV head h // (H / Hkv)."""
    B, H, T, D = q.shape
    Hkv, S = rows_k.shape[1], rows_k.shape[2]
    G, E = H // Hkv, window.cols.shape[1]
    grouped = q.reshape(B, Hkv, G * T, D)
    mask = causal_scores_mask(q.new_zeros(B, H, T, S, dtype=torch.float32), attn_mask, is_causal)  # 0 / -inf
    codes = score(grouped, rows_k).view(B, H, T, S) * D**-0.5 + mask
    exact = (grouped.to(torch.float32) @ window.k.to(torch.float32).transpose(-1, -2)).view(B, H, T, E) * D**-0.5
    at = window.cols.clamp(0, S - 1)  # [B, E]
    exact = exact + mask.gather(-1, at[:, None, None, :].expand(B, H, T, E))
    reads = window.in_window() & (window.cols < S)[:, None, :]  # [B, T, E]
    covered = torch.zeros(B, T, S, dtype=torch.float32, device=q.device)  # (not torch's default dtype)
    covered = covered.scatter_add_(2, at[:, None, :].expand(B, T, E), reads.float())
    codes = codes.masked_fill(covered[:, None] > 0, float("-inf"))
    return torch.cat([codes, exact.masked_fill(~reads[:, None], float("-inf"))], dim=-1)


def windowed_codes_attention(q: Tensor, rows_k: Tensor, rows_v: Tensor, score: Score, combine: Combine,
                             attn_mask: Tensor | None, is_causal: bool, window: Any) -> Tensor:
    """`codes_attention` where each query reads the columns of its recent-token window from `window`'s exact
    entries (`windowed_scores`): one softmax over both kinds of column, values summed from each."""
    B, H, T, _ = q.shape
    Hkv, S = rows_k.shape[1], rows_k.shape[2]
    G, E = H // Hkv, window.cols.shape[1]
    weights = torch.softmax(windowed_scores(q, rows_k, score, attn_mask, is_causal, window), dim=-1)
    w_codes, w_exact = weights.split([S, E], dim=-1)
    out = combine(w_codes.reshape(B, Hkv, G * T, S).contiguous(), rows_v)
    out = out + w_exact.reshape(B, Hkv, G * T, E) @ window.v.to(torch.float32)
    return out.view(B, H, T, -1).to(q.dtype)
