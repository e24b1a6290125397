"""Step-by-step linear attention: the ground truth for the chunked and fused forms.

    S_t = S_{t−1} + k_t v_tᵀ      o_t = S_tᵀ (scale · q_t)

and with normalize, z_t = z_{t−1} + k_t and o_t ← o_t / (scale · q_t · z_t + 1e-10).
"""

from __future__ import annotations

import torch

from recurrent_depth.ops._common import acc_dtype, autocast_off, check_inputs, heads_first, steps
from recurrent_depth.ops.linear_attn.utils import NORMALIZER_EPS, LinearAttnState, check_linear_attn_state


@autocast_off
def naive_recurrent_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: LinearAttnState | None = None,
    output_final_state: bool = False,
    normalize: bool = False,
) -> tuple[torch.Tensor, LinearAttnState | None]:
    """Linear attention, one token at a time (same signature as `chunk_linear_attn`)."""
    B, T, H, K, V, scale = check_inputs(q, k, v, scale=scale)
    S0, z0 = check_linear_attn_state(initial_state, normalize, B, H, K, V, q)
    dt, out_dtype = acc_dtype(q, S0), q.dtype
    q, k, v = (heads_first(x, dt) for x in (q, k, v))  # [B, H, T, D]
    S = q.new_zeros(B, H, K, V) if S0 is None else S0.to(dt)
    z = q.new_zeros(B, H, K) if z0 is None else z0.to(dt)
    outs = []
    for q_t, k_t, v_t in zip(steps(q * scale, 2), steps(k, 2), steps(v, 2)):
        S = S + torch.einsum("bhk,bhv->bhkv", k_t, v_t)
        o_t = torch.einsum("bhk,bhkv->bhv", q_t, S)
        if normalize:
            z = z + k_t
            o_t = o_t / ((q_t * z).sum(-1, keepdim=True) + NORMALIZER_EPS)
        outs.append(o_t)
    o = torch.stack(outs, dim=1).to(out_dtype)  # [B, T, H, V]
    final = (S, z) if normalize else S
    return o, final if output_final_state else None
