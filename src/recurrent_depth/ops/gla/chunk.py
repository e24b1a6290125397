"""Chunked GLA: one masked matmul per chunk, or sub-chunks when decays are too strong for that.

Within a chunk let G be the cumulative log decay (`[C, K]`, non-increasing for decays) and S the
entering state. Then

    O = (Q ⊙ e^G) S + A V,        A_ij = Σ_d q_id k_jd e^{G_id − G_jd}  (j ≤ i)
    S ← diag(e^{G_C}) S + (K ⊙ e^{G_C − G})ᵀ V

Intra-chunk scores A, two exact ways:

- factored (the fast path): A = (Q ⊙ e^G)(K ⊙ e^{−G})ᵀ, one matmul. The factors are e^{±G}, so it
  is used only while every |G| in the call is at most 60 (e^60 ≈ 1e26, far from float32's 3e38;
  rounding stays relative, so accuracy does not suffer). With fla's gates, logsigmoid(·)/16,
  a 64-token chunk needs a mean decay stronger than e^{-0.9} per token to leave this path.
- sub-chunked (any gate strength, as flash-linear-attention does it): cut the chunk into
  sub-chunks of 16; blocks on the diagonal are computed directly from the `[16, 16, K]` tensor of
  e^{G_i − G_j}; a block of queries in sub-chunk i against earlier keys factors through the
  reference point r = G at the end of sub-chunk i − 1: (Q ⊙ e^{G − r})(K ⊙ e^{r − G})ᵀ, with both
  exponents ≤ 0. Every exponent taken is a decay, so nothing can overflow.
"""

from __future__ import annotations

import torch

from recurrent_depth.ops._common import (
    acc_dtype,
    autocast_off,
    check_inputs,
    entering_states,
    fit_chunk_size,
    from_chunks,
    matmul_add_,
    steps,
    to_chunks,
)

SUB_CHUNK = 16
# Largest |cumulative log decay| in a chunk for which the factored scores stay in float range.
MAX_FACTORED_LOG_DECAY = 60.0


class _ChunkGLAFactored(torch.autograd.Function):
    """Chunked GLA with factored intra-chunk scores (|G| ≤ 60), hand-written backward.

    Inputs: q (already scaled), k `[BH, N, C, K]`, v `[BH, N, C, V]`, G `[BH, N, C, K]` (cumulative
    log decay inside each chunk), S0 `[BH, K, V]` or None. Outputs: o `[BH, N, C, V]`, final state
    `[BH, K, V]`. With Q̂ = Q ⊙ e^G, K̂ = K ⊙ e^{−G}, K̄ = K ⊙ e^{G_C − G}, a = e^{G_C}, P = tril(Q̂ K̂ᵀ):

        O = Q̂ S_n + P V                     S_{n+1} = diag(a) S_n + K̄ᵀ V
        dQ̂ = dO S_nᵀ + tril(dO Vᵀ) K̂       dK̂ = tril(dO Vᵀ)ᵀ Q̂
        dV = K̄ dS_n + Pᵀ dO                 dK̄ = V dS_nᵀ        da = Σ_V S_n ⊙ dS_n

    where dS_n is the cotangent of the state after chunk n (dS_{n−1} = a_n dS_n + Q̂_nᵀ dO_n), and
    each e^{±…} factor passes (cotangent × value) to G. Same 12 matmuls as autograd, but about
    half the elementwise passes and no stack/cat copies.
    """

    @staticmethod
    def forward(ctx, q, k, v, G, S0):  # noqa: ANN001, ANN205 (autograd.Function protocol)
        # One exp; |G| ≤ 60 keeps e^{±G} finite, so the other factors are a reciprocal and a
        # product (a few ulp each; an exp of this tensor costs ~8x a multiply).
        e_in = G.exp()
        e_neg = e_in.reciprocal()
        a_row = e_in[..., -1:, :]  # [BH, N, 1, K]: e^{G_C}, the chunk's decay per key channel
        e_out = e_neg * a_row  # e^{G_C − G}
        q_in = q * e_in  # queries decayed back to the chunk's start
        k_neg = k * e_neg  # keys grown back to the chunk's start
        k_out = k * e_out  # keys decayed to the chunk's end
        a = a_row.mT  # [BH, N, K, 1]
        dS = k_out.mT @ v  # [BH, N, K, V]
        # S_before[:, n] is the state entering chunk n, written in place (no list + stack copy).
        S_before = entering_states(dS, S0)
        for n in range(q.shape[1] - 1):
            torch.addcmul(dS[:, n], a[:, n], S_before[:, n], out=S_before[:, n + 1])
        S = torch.addcmul(dS[:, -1], a[:, -1], S_before[:, -1])
        P = (q_in @ k_neg.mT).tril_()
        o = matmul_add_(q_in @ S_before, P, v)
        ctx.has_S0 = S0 is not None
        ctx.save_for_backward(q, k, v, q_in, k_neg, k_out, e_in, e_neg, e_out, a, P, S_before)
        return o, S

    @staticmethod
    @autocast_off
    def backward(ctx, do, dS_final):  # noqa: ANN001, ANN205
        q, k, v, q_in, k_neg, k_out, e_in, e_neg, e_out, a, P, S_before = ctx.saved_tensors
        N = v.shape[1]
        # do arrives as a transposed view of the [B, T, H, V] cotangent; five matmuls read it and
        # each would copy it to fold its batch dims, so copy once.
        do = do.contiguous()
        dS_o = q_in.mT @ do  # [BH, N, K, V]
        # dS_after[:, n]: cotangent of the state after chunk n, written in place.
        dS_after = torch.empty_like(dS_o)
        dS_after[:, -1].copy_(dS_final)
        for n in range(N - 1, 0, -1):
            torch.addcmul(dS_o[:, n], a[:, n], dS_after[:, n], out=dS_after[:, n - 1])
        dP = (do @ v.mT).tril_()
        dq_in = matmul_add_(do @ S_before.mT, dP, k_neg)
        dk_neg = dP.mT @ q_in
        dk_out = v @ dS_after.mT  # [BH, N, C, K]
        dv = matmul_add_(k_out @ dS_after, P.mT, do)
        da = (S_before * dS_after).sum(-1)  # [BH, N, K]

        dq = dq_in * e_in
        dk = torch.addcmul(dk_neg * e_neg, dk_out, e_out)
        # Each factor e^{±(…)} passes (cotangent × value) to its exponent: +G for Q̂, −G for K̂ and
        # K̄, and +G_C for K̄ (every key of the chunk) and for a. The ±G terms sum to dQ⊙Q − dK⊙K.
        dG = torch.addcmul(dq * q, dk, k, value=-1.0)
        dG[..., -1, :] += (dk_out * k_out).sum(-2) + da * a[..., 0]
        dS0 = torch.addcmul(dS_o[:, 0], a[:, 0], dS_after[:, 0]) if ctx.has_S0 else None
        return dq, dk, dv, dG, dS0


@autocast_off
def chunk_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated linear attention (Yang et al. 2023), chunked.

    `S_t = diag(exp(g_t)) S_{t−1} + k_t v_tᵀ`, `o_t = S_tᵀ (scale · q_t)`.

    Args:
        q, k: `[B, T, H, K]`.
        v: `[B, T, H, V]`.
        g: `[B, T, H, K]` per-channel log decay (≤ 0; fla layers use logsigmoid(·) / 16).
        scale: query scale; `None` means `K ** -0.5`.
        initial_state: `[B, H, K, V]`.
        output_final_state: also return the state after the last token (float32, or float64).
        chunk_size: tokens per chunk, a power of two (sub-chunks are min(16, chunk_size)).

    Returns:
        `(o [B, T, H, V] in q's dtype, final_state [B, H, K, V] or None)`.
    """
    B, T, H, K, V, scale = check_inputs(q, k, v, scale=scale, g=g, g_per_key=True, initial_state=initial_state)
    C = fit_chunk_size(chunk_size, T)
    dt, out_dtype = acc_dtype(q, initial_state), q.dtype
    qc = to_chunks(q.to(dt) * scale, C)  # [B, H, N, C, K]
    kc = to_chunks(k.to(dt), C)  # [B, H, N, C, K]
    vc = to_chunks(v.to(dt), C)  # [B, H, N, C, V]
    G = to_chunks(g.to(dt), C).cumsum(dim=-2)  # [B, H, N, C, K]

    if G.abs().amax() <= MAX_FACTORED_LOG_DECAY:
        S0 = None if initial_state is None else initial_state.to(dt).flatten(0, 1)
        o, S = _ChunkGLAFactored.apply(*(x.flatten(0, 1) for x in (qc, kc, vc, G)), S0)
        final = S.unflatten(0, (B, H)) if output_final_state else None
        return from_chunks(o.unflatten(0, (B, H)), T).to(out_dtype), final

    # Inter-chunk: a diagonal linear recurrence on the states, one cheap step per chunk.
    G_end = G[..., -1:, :]  # [B, H, N, 1, K]
    dS = (kc * (G_end - G).exp()).transpose(-1, -2) @ vc  # [B, H, N, K, V]
    chunk_decay = G_end.exp().transpose(-1, -2)  # [B, H, N, K, 1]
    S = qc.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(dt)
    states = []
    for a_n, dS_n in zip(steps(chunk_decay, 2), steps(dS, 2)):
        states.append(S)
        S = a_n * S + dS_n
    q_in = qc * G.exp()  # queries decayed back to the chunk's start
    o = q_in @ torch.stack(states, dim=2)  # [B, H, N, C, V]
    o = o + intra_chunk_subchunked(qc, kc, vc, G, min(SUB_CHUNK, C))
    return from_chunks(o, T).to(out_dtype), S if output_final_state else None


def intra_chunk_factored(q_in: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """Intra-chunk outputs `[B, H, N, C, V]` as ((Q ⊙ e^G)(K ⊙ e^{−G})ᵀ ⊙ causal) V; needs |G| ≤ 60.

    q_in: `Q ⊙ e^G [B, H, N, C, K]`, kc: `[B, H, N, C, K]`, vc: `[B, H, N, C, V]`, G: `[B, H, N, C, K]`.
    """
    C = G.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()
    scores = (q_in @ (kc * (-G).exp()).transpose(-1, -2)).masked_fill_(~causal, 0.0)  # in place: bmm keeps inputs
    return scores @ vc


def intra_chunk_subchunked(
    qc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, G: torch.Tensor, c: int
) -> torch.Tensor:
    """Intra-chunk outputs `[B, H, N, C, V]` for any decay strength, through sub-chunks of `c`.

    qc, kc: `[B, H, N, C, K]`, vc: `[B, H, N, C, V]`, G: `[B, H, N, C, K]` (in-chunk cumsum).
    """
    C = G.shape[-2]
    m = C // c
    dev = G.device
    # Diagonal blocks: direct, with exponents masked before exp.
    qs, ks, vs, Gs = (x.unflatten(3, (m, c)) for x in (qc, kc, vc, G))  # [B, H, N, m, c, D]
    sub_causal = torch.ones(c, c, dtype=torch.bool, device=dev).tril()[..., None]  # [c, c, 1]
    pair_decay = (Gs[..., :, None, :] - Gs[..., None, :, :]).masked_fill(~sub_causal, float("-inf")).exp()
    A_diag = (qs[..., :, None, :] * ks[..., None, :, :] * pair_decay).sum(-1)  # [B, H, N, m, c, c]
    o = A_diag @ vs  # [B, H, N, m, c, V]
    # Keys in earlier sub-chunks, factored through each query sub-chunk's start r.
    if m > 1:
        ends = Gs[..., -1, :]  # [B, H, N, m, K]: G at the last token of each sub-chunk
        r = torch.cat([torch.zeros_like(ends[..., :1, :]), ends[..., :-1, :]], dim=-2)  # [B, H, N, m, K]
        q_off = qs * (Gs - r[..., None, :]).exp()  # [B, H, N, m, c, K]
        earlier = torch.arange(C, device=dev)[None, :] < (torch.arange(m, device=dev) * c)[:, None]
        k_expo = (r[..., :, None, :] - G[..., None, :, :]).masked_fill(~earlier[..., None], float("-inf"))
        k_off = kc[..., None, :, :] * k_expo.exp()  # [B, H, N, m, C, K]
        o = o + (q_off @ k_off.transpose(-1, -2)) @ vc[..., None, :, :]
    return o.flatten(3, 4)
