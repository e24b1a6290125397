"""Chunked linear attention: parallel inside a chunk, a prefix sum of states across chunks.

For chunk n with queries Q, keys K, values V (each `[C, D]`) and the state S_n before it:

    O_n = Q S_n + tril(Q Kᵀ) V          S_{n+1} = S_n + Kᵀ V

The states are an (exclusive) running sum over chunks; the backward pass is hand-written
(`_ChunkLinearAttn`). The normaliser rides along as an extra value column of ones: its state column is z = Σ k.
"""

from __future__ import annotations

import torch

from recurrent_depth.ops._common import (
    acc_dtype,
    autocast_off,
    check_inputs,
    fit_chunk_size,
    from_chunks,
    matmul_add_,
    to_chunks,
)
from recurrent_depth.ops.linear_attn.utils import NORMALIZER_EPS, LinearAttnState, check_linear_attn_state


class _ChunkLinearAttn(torch.autograd.Function):
    """Chunked linear attention on chunked tensors, heads folded into the batch, hand-written backward.

    Inputs: q (already scaled), k `[BH, N, C, K]`, v `[BH, N, C, V]`, S0 `[BH, K, V]` or None.
    Outputs: o `[BH, N, C, V]`, final state `[BH, K, V]`.

    With P = tril(Q Kᵀ), S_n the state before chunk n and dS_n the cotangent of the state after it
    (dS_{N−1} = the final state's cotangent, dS_{n−1} = dS_n + Q_nᵀ dO_n):

        dQ = dO S_nᵀ + tril(dO Vᵀ) K      dK = V dS_nᵀ + tril(dO Vᵀ)ᵀ Q      dV = K dS_n + Pᵀ dO

    Eight batched matmuls and two running sums over chunks (a loop of adds on `[BH, K, V]`,
    cheaper than `cumsum` along a strided dimension); autograd's version of the same adds cumsum
    and flip passes, a concatenation and mask passes over every `[C, C]` block.
    """

    @staticmethod
    def forward(ctx, q, k, v, S0):  # noqa: ANN001, ANN205 (autograd.Function protocol)
        BH, N, C, K = q.shape
        V = v.shape[-1]
        dS = k.mT @ v  # [BH, N, K, V]: each chunk's write k vᵀ
        S_before = torch.empty_like(dS)
        S = q.new_zeros(BH, K, V) if S0 is None else S0.clone()
        for n in range(N):
            S_before[:, n] = S
            S += dS[:, n]
        P = (q @ k.mT).tril_()  # [BH, N, C, C]
        o = matmul_add_(q @ S_before, P, v)
        ctx.has_S0 = S0 is not None
        ctx.save_for_backward(q, k, v, P, S_before)
        return o, S

    @staticmethod
    @autocast_off
    def backward(ctx, do, dS_final):  # noqa: ANN001, ANN205
        q, k, v, P, S_before = ctx.saved_tensors
        N = q.shape[1]
        # do arrives as a transposed view of the [B, T, H, V] cotangent; four matmuls read it and
        # each would copy it to fold its batch dims, so copy once.
        do = do.contiguous()
        dS_o = q.mT @ do  # [BH, N, K, V]: the outputs' pull on the state before each chunk
        dS_after = torch.empty_like(dS_o)
        dS = dS_final.clone()
        for n in range(N - 1, -1, -1):
            dS_after[:, n] = dS
            dS += dS_o[:, n]
        dP = (do @ v.mT).tril_()
        dq = matmul_add_(do @ S_before.mT, dP, k)
        dk = matmul_add_(v @ dS_after.mT, dP.mT, q)
        dv = matmul_add_(k @ dS_after, P.mT, do)
        return dq, dk, dv, dS if ctx.has_S0 else None


@autocast_off
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
    C = fit_chunk_size(chunk_size, T)
    dt, out_dtype = acc_dtype(q, S0), q.dtype
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if normalize:
        v = torch.cat([v, v.new_ones(B, T, H, 1)], dim=-1)
        if S0 is not None or z0 is not None:
            S0 = q.new_zeros(B, H, K, V) if S0 is None else S0.to(dt)
            z0 = q.new_zeros(B, H, K) if z0 is None else z0.to(dt)
            S0 = torch.cat([S0, z0[..., None]], dim=-1)
    qc, kc, vc = (to_chunks(x, C).flatten(0, 1) for x in (q * scale, k, v))  # [B·H, N, C, D]
    S0_flat = None if S0 is None else S0.to(dt).flatten(0, 1)
    o, S = _ChunkLinearAttn.apply(qc, kc, vc, S0_flat)
    o = from_chunks(o.unflatten(0, (B, H)), T)  # [B, T, H, V(+1)]
    S = S.unflatten(0, (B, H))
    if normalize:
        o = o[..., :V] / (o[..., V:] + NORMALIZER_EPS)
        final: LinearAttnState = (S[..., :V], S[..., V])
    else:
        final = S
    return o.to(out_dtype), final if output_final_state else None
