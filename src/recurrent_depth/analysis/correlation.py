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

# A zero vector has no direction: F.normalize-style division by max(norm, eps) maps it to zero,
# so it contributes 0 to every pair (as the reference does) instead of NaN.
_EPS = 1e-12


def _check(hidden: Tensor, attention_mask: Tensor | None) -> None:
    if not isinstance(hidden, Tensor) or hidden.dim() != 3:
        shape = tuple(hidden.shape) if isinstance(hidden, Tensor) else type(hidden).__name__
        raise ValueError(f"hidden must be a tensor [batch, seq_len, hidden], got {shape}")
    if hidden.shape[1] < 2:
        raise ValueError(f"hidden must have seq_len >= 2 to correlate positions, got seq_len={hidden.shape[1]}")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(hidden.shape[:2]):
        raise ValueError(
            f"attention_mask must have shape [batch, seq_len] = {tuple(hidden.shape[:2])}, "
            f"got {tuple(attention_mask.shape)}"
        )


def _reduce(per_row: Tensor, per_sequence: bool) -> Tensor:
    if per_sequence:
        return per_row
    valid = ~torch.isnan(per_row)
    if not bool(valid.any()):
        raise ValueError("attention_mask leaves no sequence with at least 2 real tokens to correlate")
    return per_row[valid].mean()


def token_correlation(
    hidden: Tensor, attention_mask: Tensor | None = None, *, per_sequence: bool = False
) -> Tensor:
    """Mean pairwise cosine similarity between the states of different positions.

    Args:
        hidden: [B, T, h] states (any float dtype; computed in float32). T >= 2.
        attention_mask: optional [B, T], 1 for real tokens and 0 for padding; padded positions
            are left out of the pairs.
        per_sequence: return one value per sequence [B] instead of their mean.
    Returns:
        a 0-dim tensor (or [B]) in [-1, 1]; 1.0 means every position holds the same direction
        (collapse). A sequence with fewer than 2 real tokens gives NaN in the per-sequence
        output and is skipped by the mean. Differentiable.
    """
    _check(hidden, attention_mask)
    x = hidden.float()
    units = x / x.norm(dim=-1, keepdim=True).clamp_min(_EPS)  # [B, T, h]
    if attention_mask is not None:
        units = units * attention_mask.to(units.dtype).unsqueeze(-1)
        count = attention_mask.to(units.dtype).sum(-1)  # [B]
    else:
        count = torch.full(units.shape[:1], float(units.shape[1]), device=units.device)
    total = units.sum(dim=1)  # [B, h]
    self_pairs = units.pow(2).sum(dim=(1, 2))  # [B]: 1 per real non-zero token
    pair_sum = total.pow(2).sum(-1) - self_pairs
    pairs = count * (count - 1)
    per_row = torch.where(pairs > 0, pair_sum / pairs.clamp_min(1), torch.full_like(pair_sum, float("nan")))
    return _reduce(per_row, per_sequence)


def token_correlation_reference(
    hidden: Tensor, attention_mask: Tensor | None = None, *, per_sequence: bool = False
) -> Tensor:
    """The same quantity from the explicit [B, T, T] cosine matrix (the test oracle; O(T^2 h))."""
    _check(hidden, attention_mask)
    x = hidden.float()
    units = x / x.norm(dim=-1, keepdim=True).clamp_min(_EPS)
    cos = units @ units.transpose(1, 2)  # [B, T, T]
    T = x.shape[1]
    keep = ~torch.eye(T, dtype=torch.bool, device=x.device)[None]  # [1, T, T]: off-diagonal pairs
    if attention_mask is not None:
        real = attention_mask.bool()
        keep = keep & real[:, :, None] & real[:, None, :]
    keep = keep.expand_as(cos)
    rows = []
    for b in range(x.shape[0]):
        chosen = cos[b][keep[b]]
        rows.append(chosen.mean() if chosen.numel() else torch.tensor(float("nan"), device=x.device))
    return _reduce(torch.stack(rows), per_sequence)
