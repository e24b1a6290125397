"""Chunked linear attention: parallel inside a chunk, a prefix sum of states across chunks.

For chunk n with queries Q, keys K, values V (each `[C, D]`) and the state S_n before it:

    O_n = Q S_n + tril(Q Kᵀ) V          S_{n+1} = S_n + Kᵀ V

The states are an (exclusive) cumulative sum over chunks, so no Python loop is needed at all.
The normaliser rides along as an extra value column of ones: its state column is z = Σ k.
"""

from __future__ import annotations

import torch

from recurrent_depth.ops._common import acc_dtype, check_chunk_size, check_inputs, from_chunks, to_chunks
from recurrent_depth.ops.linear_attn.utils import NORMALIZER_EPS, LinearAttnState, check_linear_attn_state


def chunk_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    initial_state: LinearAttnState | None = None,
    output_final_state: bool = False,
    normalize: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, LinearAttnState | None]:
    """Causal linear attention (Katharopoulos et al. 2020), chunked.

    Args:
        q, k: `[B, T, H, K]` queries and keys (feature maps are the caller's job).
        v: `[B, T, H, V]` values.
        scale: query scale; `None` means `K ** -0.5`.
        initial_state: `[B, H, K, V]`, or the pair `(S [B, H, K, V], z [B, H, K])` with `normalize`.
        output_final_state: also return the state after the last token (float32, or float64).
        normalize: divide by the normaliser `scale · q_t · Σ_{s≤t} k_s + 1e-10`.
        chunk_size: tokens per chunk, a power of two.

    Returns:
        `(o [B, T, H, V] in q's dtype, final_state or None)`.
    """
    B, T, H, K, V, scale = check_inputs(q, k, v, scale=scale)
    S0, z0 = check_linear_attn_state(initial_state, normalize, B, H, K, V, q)
    C = check_chunk_size(chunk_size)
    dt, out_dtype = acc_dtype(q, S0), q.dtype
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if normalize:
        v = torch.cat([v, v.new_ones(B, T, H, 1)], dim=-1)
        if S0 is not None or z0 is not None:
            S0 = q.new_zeros(B, H, K, V) if S0 is None else S0.to(dt)
            z0 = q.new_zeros(B, H, K) if z0 is None else z0.to(dt)
            S0 = torch.cat([S0, z0[..., None]], dim=-1)
    qc, kc, vc = to_chunks(q * scale, C), to_chunks(k, C), to_chunks(v, C)  # [B, H, N, C, D]

    dS = kc.transpose(-1, -2) @ vc  # [B, H, N, K, V]
    S_after = dS.cumsum(dim=2)
    if S0 is None:
        S_before = torch.cat([torch.zeros_like(dS[:, :, :1]), S_after[:, :, :-1]], dim=2)
    else:
        S_after = S0.to(dt)[:, :, None] + S_after
        S_before = torch.cat([S0.to(dt)[:, :, None], S_after[:, :, :-1]], dim=2)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    # In place is safe: the matmul's backward needs its inputs, not its output.
    scores = (qc @ kc.transpose(-1, -2)).masked_fill_(~causal, 0.0)  # [B, H, N, C, C]
    o = from_chunks(qc @ S_before + scores @ vc, T)  # [B, T, H, V(+1)]

    S = S_after[:, :, -1]
    if normalize:
        o = o[..., :V] / (o[..., V:] + NORMALIZER_EPS)
        final: LinearAttnState = (S[..., :V], S[..., V])
    else:
        final = S
    return o.to(out_dtype), final if output_final_state else None
