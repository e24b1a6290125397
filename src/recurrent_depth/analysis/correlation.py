"""Token correlation: the representation-collapse signal of the paper's figure 5.

When a recurrence mixes the sequence until every position holds the same state, the mean
pairwise cosine similarity between the hidden states of different positions goes to 1.0 (the
paper's "Bad Run 1" stalled this way). The trainer logs it as a health monitor and the analysis
report plots it over recurrence steps, so it lives here as a pure function of a tensor; this
module imports nothing else from the package.

The fast form uses the identity, for unit vectors u_1..u_T,

    sum_{t != t'} <u_t, u_t'> = ||sum_t u_t||^2 - sum_t ||u_t||^2,

which is O(T h) instead of the O(T^2 h) pairwise matrix; `token_correlation_reference` computes
that matrix and is what the tests compare against.
"""

from __future__ import annotations

import torch
from torch import Tensor

# A zero vector has no direction: dividing by max(norm, eps) maps it to zero, so it contributes
# 0 to every pair (as the reference does) instead of NaN; s_0 = 0 (init_scale 0) reads as 0.
_EPS = 1e-12


def _prepare(hidden: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor | None, bool]:
    """-> (hidden [B, T, h], mask [B, T] or None, whether the input was a single [T, h])."""
    if not isinstance(hidden, Tensor) or hidden.dim() not in (2, 3):
        shape = tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__
        raise ValueError(f"hidden must have shape [batch, seq_len, hidden] or [seq_len, hidden], got {shape}")
    single = hidden.dim() == 2
    x = hidden.unsqueeze(0) if single else hidden
    if mask is not None:
        m = mask.unsqueeze(0) if single and mask.dim() == 1 else mask
        if tuple(m.shape) != tuple(x.shape[:2]):
            raise ValueError(f"mask must have shape [batch, seq_len] = {tuple(x.shape[:2])}, got {tuple(mask.shape)}")
        mask = m
    return x, mask, single


def _units(x: Tensor) -> Tensor:
    x = x.float()
    return x / x.norm(dim=-1, keepdim=True).clamp_min(_EPS)


def token_correlation(hidden: Tensor, mask: Tensor | None = None) -> Tensor:
    """Mean pairwise cosine similarity between the states of different positions, per sequence.

    Args:
        hidden: [B, T, h] (or one sequence [T, h]); any float dtype, computed in float32.
        mask: optional [B, T] (or [T]), true / 1 for positions to include (e.g. the attention
            mask, to leave out padding).
    Returns:
        [B] float32 (a 0-dim tensor for [T, h] input) in [-1, 1]: the average of cos(h_t, h_t')
        over ordered pairs t != t' of included positions; 1.0 means every position holds the same
        direction (collapse). NaN for a sequence with fewer than two included positions.
        Differentiable; reduce over the batch with `torch.nanmean` or `.mean()`.
    """
    x, mask, single = _prepare(hidden, mask)
    units = _units(x)  # [B, T, h]
    if mask is not None:
        weights = mask.to(units.dtype)
        units = units * weights.unsqueeze(-1)
        count = weights.sum(-1)  # [B]
    else:
        count = torch.full(units.shape[:1], float(units.shape[1]), device=units.device)
    total = units.sum(dim=1)  # [B, h]
    self_pairs = units.pow(2).sum(dim=(1, 2))  # [B]: 1 per included non-zero state
    pairs = count * (count - 1)
    out = (total.pow(2).sum(-1) - self_pairs) / pairs.clamp_min(1)
    out = torch.where(pairs > 0, out, torch.full_like(out, float("nan")))
    return out[0] if single else out


def token_correlation_reference(hidden: Tensor, mask: Tensor | None = None) -> Tensor:
    """The same quantity from the explicit [B, T, T] cosine matrix (the test oracle; O(T^2 h))."""
    x, mask, single = _prepare(hidden, mask)
    units = _units(x)
    cos = units @ units.transpose(1, 2)  # [B, T, T]
    T = x.shape[1]
    keep = ~torch.eye(T, dtype=torch.bool, device=x.device)[None]  # [1, T, T]: off-diagonal pairs
    if mask is not None:
        real = mask.bool()
        keep = keep & real[:, :, None] & real[:, None, :]
    keep = keep.expand_as(cos)
    rows = []
    for b in range(x.shape[0]):
        chosen = cos[b][keep[b]]
        rows.append(chosen.mean() if chosen.numel() else torch.tensor(float("nan"), device=x.device))
    out = torch.stack(rows)
    return out[0] if single else out
