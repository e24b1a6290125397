"""Recurrent log-linear attention for decoding: the Fenwick recurrence on one `[B·H, L, K, V]` state.

Each step rebuilds the level stack with a single concatenation (new token, cleared levels, the
merged level, the decayed higher levels), mixes the levels with the query's level weights and
reads the mix with one matvec. A step costs O(log T · K · V).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recurrent_depth.ops._common import acc_dtype, autocast_off, steps
from recurrent_depth.ops.log_linear_attn.utils import LogLinearState, check_log_linear_inputs, trailing_ones


@autocast_off
def fused_recurrent_log_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    level_scales: torch.Tensor,
    scale: float | None = None,
    initial_state: LogLinearState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, LogLinearState | None]:
    """Log-linear attention token by token; same arguments and results as `chunk_log_linear_attn`."""
    B, T, H, K, V, L, scale, levels0, offset = check_log_linear_inputs(q, k, v, g, level_scales, scale, initial_state)
    dt, out_dtype = acc_dtype(q, levels0), q.dtype
    num_levels = L if levels0 is None else max(L, levels0.shape[2])

    n = B * H

    def flat(x: torch.Tensor, *step_shape: int) -> torch.Tensor:  # [B, T, H, *D] -> [B·H, T, *step_shape]
        return x.to(dt).transpose(1, 2).reshape(n, T, *step_shape)

    # Per-step slices shaped for bmm: q_t [B·H, 1, K], k_t [B·H, K, 1], v_t [B·H, 1, V], λ_t [B·H, 1, L].
    qs, ks, vs = flat(q * scale, 1, K), flat(k, K, 1), flat(v, 1, V)
    alpha = flat(g, 1, 1, 1).exp()  # [B·H, T, 1, 1, 1]
    lam = F.pad(flat(level_scales, 1, L), (0, num_levels - L))  # [B·H, T, 1, L_state]
    # Only levels that can hold tokens are stored; the stack grows by one level at each power of 2.
    X = qs.new_zeros(n, 0, K, V) if levels0 is None else levels0.to(dt).reshape(n, -1, K, V)
    outs = []
    per_step = zip(steps(qs, 1), steps(ks, 1), steps(vs, 1), steps(alpha, 1), steps(lam, 1))
    for t, (q_t, k_t, v_t, a_t, lam_t) in enumerate(per_step):
        pos = offset + t
        kv = torch.bmm(k_t, v_t)[:, None]  # [B·H, 1, K, V]
        if pos == 0:
            X = kv
        else:
            c = trailing_ones(pos - 1)
            merged = X[:, : c + 2].sum(1, keepdim=True)
            X = torch.cat([kv, X.new_zeros(n, c, K, V), merged * a_t, X[:, c + 2 :] * a_t], dim=1)
        # o_t = (Σ_ℓ λ_t[ℓ] X_ℓ)ᵀ q_t: mix the levels first (one bmm over contiguous K·V), then read.
        mixed = torch.bmm(lam_t[..., : X.shape[1]], X.flatten(2)).view(n, K, V)
        outs.append(torch.bmm(q_t, mixed))  # [B·H, 1, V]
    o = torch.cat(outs, dim=1).reshape(B, H, T, V).transpose(1, 2)  # [B, T, H, V]
    X = F.pad(X, (0, 0, 0, 0, 0, num_levels - X.shape[1]))
    final = LogLinearState(X.reshape(B, H, num_levels, K, V), offset + T)
    return o.to(out_dtype), final if output_final_state else None
