"""Recurrent (gated) delta rule for decoding: a handful of batched products per token.

Heads are folded into the batch (`[B·H, K, V]` states); decays, β·k and scaled queries are
computed for the whole sequence before the loop, so each step is a decay, two `bmm`-class calls
for the delta update and one for the read-out.
"""

from __future__ import annotations

import torch

from recurrent_depth.ops._common import acc_dtype, autocast_off, check_inputs, steps


def fused_recurrent_delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    scale: float,
    initial_state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared loop of the delta rule (g=None) and the gated delta rule, inputs validated.

    Returns `(o [B, T, H, V] in the accumulation dtype, final state [B, H, K, V])`.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = acc_dtype(q, initial_state)

    def flat(x: torch.Tensor, *step_shape: int) -> torch.Tensor:  # [B, T, H, *D] -> [B·H, T, *step_shape]
        return x.to(dt).transpose(1, 2).reshape(B * H, T, *step_shape)

    # Per-step slices shaped for bmm: q_t, (β k)_t [B·H, 1, K], k_t [B·H, K, 1], (β v)_t [B·H, 1, V].
    bs = flat(beta, 1, 1)
    qs, ks, bk, bv = flat(q * scale, 1, K), flat(k, K, 1), flat(k, 1, K) * bs, flat(v, 1, V) * bs
    alphas = [None] * T if g is None else steps(flat(g, 1, 1).exp(), 1)
    S = qs.new_zeros(B * H, K, V) if initial_state is None else initial_state.to(dt).reshape(B * H, K, V)
    outs = []
    for q_t, k_t, bk_t, bv_t, a_t in zip(steps(qs, 1), steps(ks, 1), steps(bk, 1), steps(bv, 1), alphas):
        if a_t is not None:
            S = S * a_t
        # u_t = β_t (v_t − Sᵀ k_t), written as β_t v_t − (β_t k_t)ᵀ S: one product, no transpose.
        u = torch.baddbmm(bv_t, bk_t, S, alpha=-1.0)  # [B·H, 1, V]
        S = torch.baddbmm(S, k_t, u)
        outs.append(torch.bmm(q_t, S))
    o = torch.cat(outs, dim=1).reshape(B, H, T, V).transpose(1, 2)  # [B, T, H, V]
    return o, S.reshape(B, H, K, V)


@autocast_off
def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule token by token; same arguments and results as `chunk_gated_delta_rule`."""
    scale = check_inputs(q, k, v, scale=scale, g=g, beta=beta, initial_state=initial_state)[-1]
    o, S = fused_recurrent_delta_rule_fwd(q, k, v, beta, g, scale, initial_state)
    return o.to(q.dtype), S if output_final_state else None
