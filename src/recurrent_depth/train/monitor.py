"""Training health monitors that analysis code can reuse.

`token_correlation` is the paper's collapse monitor: a failed recurrent-depth run shows its
hidden states becoming the same vector at every position ("token correlation" rising towards 1),
after which the model can no longer tell tokens apart. A healthy run stays well below 1.
"""

from __future__ import annotations

import torch
from torch import Tensor


def token_correlation(hidden: Tensor, mask: Tensor | None = None) -> Tensor:
    """Mean pairwise cosine similarity between the hidden states of different positions.

    hidden: [B, T, h] (or [T, h]); mask: optional [B, T] bool, True for positions to include.
    Returns a [B] float32 tensor (a scalar for [T, h] input): for each sequence the average of
    cos(h_i, h_j) over all ordered pairs i != j of included positions (NaN with fewer than two).

    Uses |sum_i u_i|^2 = sum_ij u_i.u_j with u_i = h_i / |h_i|, so the cost is O(B T h), not O(B T^2 h).
    """
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must have shape [B, T, h] or [T, h], got {tuple(hidden.shape)}")
    single = hidden.dim() == 2
    x = hidden.unsqueeze(0) if single else hidden
    u = torch.nn.functional.normalize(x.float(), dim=-1)  # [B, T, h]
    if mask is not None:
        m = mask.unsqueeze(0) if single and mask.dim() == 1 else mask
        if tuple(m.shape) != tuple(x.shape[:2]):
            raise ValueError(f"mask must have shape {tuple(x.shape[:2])}, got {tuple(m.shape)}")
        u = u * m.to(u.dtype).unsqueeze(-1)
        count = m.sum(-1).to(torch.float32)
    else:
        count = torch.full((x.shape[0],), float(x.shape[1]))
    total = u.sum(dim=1)  # [B, h]
    diag = (u * u).sum(dim=(1, 2))  # [B]: number of non-zero unit vectors
    pairs = count * (count - 1)
    out = (total.pow(2).sum(-1) - diag) / pairs
    out = torch.where(pairs > 0, out, torch.full_like(out, float("nan")))
    return out[0] if single else out


def token_correlation_reference(hidden: Tensor) -> Tensor:
    """The O(T^2) definition (tests compare `token_correlation` against it): hidden [B, T, h] -> [B]."""
    u = torch.nn.functional.normalize(hidden.float(), dim=-1)
    sims = u @ u.transpose(1, 2)  # [B, T, T]
    T = hidden.shape[1]
    off = ~torch.eye(T, dtype=torch.bool)
    return sims[:, off].mean(-1)
