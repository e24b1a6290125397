"""Step-by-step gated delta rule (Gated DeltaNet): the ground truth for the other forms.

    S'_t = exp(g_t) S_{t−1}                 (decay first, as in flash-linear-attention)
    u_t  = β_t (v_t − S'_tᵀ k_t)            S_t = S'_t + k_t u_tᵀ         o_t = S_tᵀ (scale · q_t)

equivalently S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ with α_t = exp(g_t).
"""

from __future__ import annotations

import torch

from recurrent_depth.ops._common import acc_dtype, autocast_off, check_inputs, heads_first, steps


@autocast_off
def naive_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule, one token at a time (same signature as `chunk_gated_delta_rule`).

    Note the argument order `g, beta` (as `chunk_gated_delta_rule`); fla's own naive recurrent
    reference takes `beta, g`.
    """
    B, T, H, K, V, scale = check_inputs(q, k, v, scale=scale, g=g, beta=beta, initial_state=initial_state)
    dt, out_dtype = acc_dtype(q, initial_state), q.dtype
    q, k, v, g, beta = (heads_first(x, dt) for x in (q, k, v, g, beta))  # [B, H, T, *]
    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    outs = []
    per_step = zip(steps(q * scale, 2), steps(k, 2), steps(v, 2), steps(g, 2), steps(beta[..., None], 2))
    for q_t, k_t, v_t, g_t, b_t in per_step:
        S = S * g_t.exp()[..., None, None]
        u_t = b_t * (v_t - torch.einsum("bhkv,bhk->bhv", S, k_t))
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, u_t)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q_t))
    o = torch.stack(outs, dim=1).to(out_dtype)  # [B, T, H, V]
    return o, S if output_final_state else None
