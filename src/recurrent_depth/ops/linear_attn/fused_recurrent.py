"""Recurrent linear attention for decoding: one batched outer product and one matvec per token.

Heads are folded into the batch (`[B·H, K, V]` states) so each step is two `bmm`-class calls; the
normaliser rides along as an extra value column of ones, as in the chunked form.
"""

from __future__ import annotations

import torch

from recurrent_depth.ops._common import acc_dtype, autocast_off, check_inputs, steps
from recurrent_depth.ops.linear_attn.utils import NORMALIZER_EPS, LinearAttnState, check_linear_attn_state


@autocast_off
def fused_recurrent_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: LinearAttnState | None = None,
    output_final_state: bool = False,
    normalize: bool = False,
) -> tuple[torch.Tensor, LinearAttnState | None]:
    """Linear attention token by token; same arguments and results as `chunk_linear_attn`."""
    B, T, H, K, V, scale = check_inputs(q, k, v, scale=scale)
    S0, z0 = check_linear_attn_state(initial_state, normalize, B, H, K, V, q)
    dt, out_dtype = acc_dtype(q, S0), q.dtype
    if normalize:
        v = torch.cat([v.to(dt), v.new_ones(B, T, H, 1, dtype=dt)], dim=-1)
    Vx = v.shape[-1]
    # Per-step slices shaped for bmm: q_t [B·H, 1, K], k_t [B·H, K, 1], v_t [B·H, 1, V].
    qs = (q.to(dt) * scale).transpose(1, 2).reshape(B * H, T, 1, K)
    ks = k.to(dt).transpose(1, 2).reshape(B * H, T, K, 1)
    vs = v.to(dt).transpose(1, 2).reshape(B * H, T, 1, Vx)
    S = qs.new_zeros(B, H, K, V) if S0 is None else S0.to(dt)
    if normalize:
        z = qs.new_zeros(B, H, K) if z0 is None else z0.to(dt)
        S = torch.cat([S, z[..., None]], dim=-1)
    S = S.reshape(B * H, K, Vx)
    outs = []
    for q_t, k_t, v_t in zip(steps(qs, 1), steps(ks, 1), steps(vs, 1)):
        S = torch.baddbmm(S, k_t, v_t)
        outs.append(torch.bmm(q_t, S))  # [B·H, 1, V]
    o = torch.cat(outs, dim=1).reshape(B, H, T, Vx).transpose(1, 2)  # [B, T, H, V(+1)]
    S = S.reshape(B, H, K, Vx)
    if normalize:
        o = o[..., :V] / (o[..., V:] + NORMALIZER_EPS)
        final: LinearAttnState = (S[..., :V], S[..., V])
    else:
        final = S
    return o.to(out_dtype), final if output_final_state else None
