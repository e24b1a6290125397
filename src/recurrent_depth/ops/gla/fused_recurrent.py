"""Recurrent GLA for decoding: one decay, one batched outer product and one matvec per token."""

from __future__ import annotations

import torch

from recurrent_depth.ops._common import acc_dtype, autocast_off, check_inputs, steps


@autocast_off
def fused_recurrent_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GLA token by token; same arguments and results as `chunk_gla`."""
    B, T, H, K, V, scale = check_inputs(q, k, v, scale=scale, g=g, g_per_key=True, initial_state=initial_state)
    dt, out_dtype = acc_dtype(q, initial_state), q.dtype

    def flat(x: torch.Tensor, *step_shape: int) -> torch.Tensor:  # [B, T, H, D] -> [B·H, T, *step_shape]
        return x.to(dt).transpose(1, 2).reshape(B * H, T, *step_shape)

    qs, ks, vs, alpha = flat(q * scale, 1, K), flat(k, K, 1), flat(v, 1, V), flat(g, K, 1).exp()
    S = qs.new_zeros(B * H, K, V) if initial_state is None else initial_state.to(dt).reshape(B * H, K, V)
    outs = []
    for q_t, k_t, v_t, a_t in zip(steps(qs, 1), steps(ks, 1), steps(vs, 1), steps(alpha, 1)):
        S = torch.baddbmm(S * a_t, k_t, v_t)
        outs.append(torch.bmm(q_t, S))  # [B·H, 1, V]
    o = torch.cat(outs, dim=1).reshape(B, H, T, V).transpose(1, 2)  # [B, T, H, V]
    return o.to(out_dtype), S.reshape(B, H, K, V) if output_final_state else None
