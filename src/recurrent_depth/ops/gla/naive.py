"""Step-by-step gated linear attention (GLA): the ground truth for the chunked and fused forms.

    S_t = diag(exp(g_t)) S_{t−1} + k_t v_tᵀ      o_t = S_tᵀ (scale · q_t)

with `g_t ∈ R^K` a per-key-channel log decay.
"""

from __future__ import annotations

import torch

from recurrent_depth.ops._common import acc_dtype, autocast_off, check_inputs, heads_first, steps


@autocast_off
def naive_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GLA, one token at a time (same signature as `chunk_gla`)."""
    B, T, H, K, V, scale = check_inputs(q, k, v, scale=scale, g=g, g_per_key=True, initial_state=initial_state)
    dt, out_dtype = acc_dtype(q, initial_state), q.dtype
    q, k, v, g = (heads_first(x, dt) for x in (q, k, v, g))  # [B, H, T, *]
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    outs = []
    for q_t, k_t, v_t, g_t in zip(steps(q * scale, 2), steps(k, 2), steps(v, 2), steps(g, 2)):
        S = S * g_t.exp()[..., None] + torch.einsum("bhk,bhv->bhkv", k_t, v_t)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q_t))
    o = torch.stack(outs, dim=1).to(out_dtype)  # [B, T, H, V]
    return o, S if output_final_state else None
