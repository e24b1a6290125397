"""Log-linear attention references: the step-by-step Fenwick recurrence and the O(T²) definition.

Definition (Guo et al. 2025), with a scalar log decay g and per-query level weights λ:

    o_t = Σ_{s ≤ t} λ_t[ℓ(t, s)] · exp(G_t − G_s) · (scale · q_t · k_s) · v_s,
    ℓ(t, s) = bit_length(t XOR s),   G_t = Σ_{r ≤ t} g_r

Recurrence: keep one state per level. Moving from token t−1 to t, with c = trailing ones of t−1,
levels 0..c merge into level c+1 (which was empty) and levels 0..c are cleared; then every level
decays by exp(g_t) and level 0 becomes k_t v_tᵀ. The read-out is o_t = Σ_ℓ λ_t[ℓ] S_ℓᵀ (scale·q_t).
"""

from __future__ import annotations

import torch

from recurrent_depth.ops._common import acc_dtype, autocast_off, heads_first, steps
from recurrent_depth.ops.log_linear_attn.utils import (
    LogLinearState,
    check_log_linear_inputs,
    level_matrix,
    trailing_ones,
)


@autocast_off
def naive_recurrent_log_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    level_scales: torch.Tensor,
    scale: float | None = None,
    initial_state: LogLinearState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, LogLinearState | None]:
    """Log-linear attention, one token at a time (same signature as `chunk_log_linear_attn`)."""
    B, T, H, K, V, L, scale, levels0, offset = check_log_linear_inputs(q, k, v, g, level_scales, scale, initial_state)
    dt, out_dtype = acc_dtype(q, levels0), q.dtype
    q, k, v, g, lam = (heads_first(x, dt) for x in (q, k, v, g, level_scales))  # [B, H, T, *]
    num_levels = L if levels0 is None else max(L, levels0.shape[2])
    levels = [] if levels0 is None else list(levels0.to(dt).unbind(2))  # grows as positions need
    zero = q.new_zeros(B, H, K, V)
    outs = []
    per_step = zip(steps(q * scale, 2), steps(k, 2), steps(v, 2), steps(g, 2), steps(lam, 2))
    for t, (q_t, k_t, v_t, g_t, lam_t) in enumerate(per_step):
        pos = offset + t
        if pos > 0:
            c = trailing_ones(pos - 1)
            levels = [zero] * (c + 1) + [sum(levels[: c + 2])] + levels[c + 2 :]
        alpha = g_t.exp()[..., None, None]
        levels = [S * alpha for S in levels]
        kv = torch.einsum("bhk,bhv->bhkv", k_t, v_t)
        levels = [kv] + levels[1:]
        # a carried state may hold more levels than λ has (L0 > L): those weigh 0, as in the other forms
        o_t = sum(lam_t[..., ell, None] * torch.einsum("bhkv,bhk->bhv", S, q_t) for ell, S in enumerate(levels[:L]))
        outs.append(o_t)
    o = torch.stack(outs, dim=1).to(out_dtype)  # [B, T, H, V]
    levels += [zero] * (num_levels - len(levels))
    final = LogLinearState(torch.stack(levels, dim=2), offset + T)
    return o, final if output_final_state else None


@autocast_off
def naive_parallel_log_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    level_scales: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Log-linear attention from its definition: the masked `[T, T]` matrix, no state, O(T²).

    An oracle that shares nothing with the Fenwick recurrence (positions start at 0).
    Returns `o [B, T, H, V]` in q's dtype.
    """
    B, T, H, K, V, L, scale, _, _ = check_log_linear_inputs(q, k, v, g, level_scales, scale, None)
    dt, out_dtype = acc_dtype(q), q.dtype
    q, k, v, g, lam = (heads_first(x, dt) for x in (q, k, v, g, level_scales))  # [B, H, T, *]
    G = g.cumsum(-1)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [B, H, T, T]
    levels = level_matrix(T, q.device).clamp(max=L - 1)  # clamped entries lie above the diagonal
    weights = lam.gather(-1, levels.expand(B, H, T, T))  # λ_t[ℓ(t, s)]
    scores = (q * scale) @ k.transpose(-1, -2) * decay * weights
    return (scores @ v).transpose(1, 2).to(out_dtype)  # [B, T, H, V]
