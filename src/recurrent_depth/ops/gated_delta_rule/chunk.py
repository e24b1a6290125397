"""Chunked (gated) delta rule in the WY / UT-transform representation, with a hand-written backward.

Inside a chunk with entering state S, let G_i be the cumulative log decay up to token i (0 for
the plain delta rule), Γ_i = exp(G_i) and D_ij = exp(G_i − G_j) for j ≤ i (0 above the diagonal).
Unrolling the recurrence, the pseudo-values u_i = β_i (v_i − S'_iᵀ k_i) satisfy one
unit-lower-triangular system

    L U = diag(β) V − diag(β Γ) K S,      L = I + A,   A_ij = β_i D_ij k_i·k_j   (j < i)

With the explicit inverse L⁻¹ (the UT transform; block recursion, see `unit_lower_inverse`):

    Ũ = L⁻¹ diag(β) V,   W = L⁻¹ diag(β Γ) K,   U = Ũ − W S
    O = (Q ⊙ Γ) S + P U,                  P = Q Kᵀ ⊙ D   (j ≤ i)
    S ← a S + K̄ᵀ U,                       a = Γ_C,  K̄ = K ⊙ exp(G_C − G)

Everything but the two small products that carry S from chunk to chunk is batched over chunks.
Every exponent is a decay (≤ 0), or a factor e^{±G} while every |G| ≤ 60 (then D is an outer
product, see `MAX_FACTORED_LOG_DECAY`), so nothing can overflow however strong the gates are.

Backward (`_ChunkDeltaRule.backward`), with dO the output cotangent and dS the cotangent of the
state after the current chunk (the final state's cotangent, or zeros, to start with):

    dU = Pᵀ dO + K̄ dS      (the second term inside the reverse loop over chunks)
    dS ← a dS + (Q ⊙ Γ)ᵀ dO − Wᵀ dU
    then, batched over chunks: dK̄ = U dSᵀ, dP = dO Uᵀ (j ≤ i), and for the right-hand sides
    dRv = L⁻ᵀ dU, dRk = −dRv Sᵀ, dA = −dRv Uᵀ (j < i)  (since Ũ − W S = U, no second solve),
    and the chain rule through the elementwise products and the in-chunk cumsum of g.

autograd gets the same numbers through ~10 small nodes per chunk in its loop, a triangular
solve's backward and copies for every split and stack; the hand-written pass is one short loop
of two products and 14 batched matmuls, about 2x less time for forward+backward.
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
    to_chunks,
)

# Leaf size of the block inversion: small enough that LAPACK's unblocked triangular solve is cheap,
# big enough that the Python recursion stays shallow (C = 64: two levels, four leaf solves).
INVERSE_LEAF = 16

# Largest |cumulative log decay| inside a chunk for which D = e^{G} e^{−G}ᵀ is formed as an outer
# product: e^60 ≈ 1e26 is far from float32's 3e38. Beyond it the exact exp(G_i − G_j) is used.
MAX_FACTORED_LOG_DECAY = 60.0


def unit_lower_inverse(A: torch.Tensor) -> torch.Tensor:
    """`(I + strict_lower(A))⁻¹` for `A [.., C, C]`; A's diagonal and upper part are never read.

    2×2 block recursion, the inverse of [[L₁₁, 0], [L₂₁, L₂₂]] being [[T₁₁, 0], [−T₂₂ L₂₁ T₁₁, T₂₂]],
    down to leaves of `INVERSE_LEAF` solved by LAPACK. Measured at C = 64 this is 1.9x faster than one
    triangular solve of the whole matrix (the off-diagonal blocks become plain matmuls), and the
    explicit inverse turns the solves of the forward and backward passes into matmuls too.
    """
    C = A.shape[-1]
    if C <= INVERSE_LEAF:
        eye = torch.eye(C, dtype=A.dtype, device=A.device).expand(A.shape)
        # Right-sided form: on row-major tensors LAPACK then gets the column-major layout it wants
        # (measured 2.5x faster than the left-sided solve).
        return torch.linalg.solve_triangular(A.mT, eye, upper=True, left=False, unitriangular=True).mT
    h = C // 2
    T11 = unit_lower_inverse(A[..., :h, :h])
    T22 = unit_lower_inverse(A[..., h:, h:])
    T = A.new_zeros(A.shape)
    T[..., :h, :h] = T11
    T[..., h:, h:] = T22
    T[..., h:, :h] = (T22 @ A[..., h:, :h] @ T11).neg_()
    return T


class _ChunkDeltaRule(torch.autograd.Function):
    """The chunked (gated) delta rule on chunked tensors, heads folded into the batch.

    Inputs: q (already scaled), k `[BH, N, C, K]`, v `[BH, N, C, V]`, beta `[BH, N, C]`, g `[BH, N, C]`
    log decays or None (the plain delta rule), S0 `[BH, K, V]` or None.
    Outputs: o `[BH, N, C, V]`, final state `[BH, K, V]`.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, g, S0):  # noqa: ANN001, ANN205 (autograd.Function protocol)
        BH, N, C, K = q.shape
        V = v.shape[-1]
        b = beta[..., None]  # [BH, N, C, 1]
        KD = k @ k.mT  # [BH, N, C, C]; becomes k kᵀ ⊙ D
        P = q @ k.mT  # becomes q kᵀ ⊙ D, causal
        if g is None:
            D = gamma = end_decay = a = None
            P.tril_()  # KD needs no mask: only its strict lower triangle is ever read
            q_s = k_o = k_in = None
        else:
            G = g.cumsum(-1)  # [BH, N, C]
            Gamma = G.exp()  # [BH, N, C]
            if G.abs().amax() <= MAX_FACTORED_LOG_DECAY:
                # D_ij = e^{G_i} · e^{−G_j}: an outer product of two [C] vectors instead of an exp
                # of the whole [C, C] block (~8x dearer than a multiply); both factors are finite
                # and the product is exact to a few ulp.
                D = (Gamma[..., :, None] * Gamma.reciprocal()[..., None, :]).tril_()
            else:
                # Strong decays: D_ij = exp(G_i − G_j) for j ≤ i, else 0. Zero the exponent above
                # the diagonal first: there G_i − G_j > 0 could overflow. (tril_ is ~15x faster
                # than masked_fill_ here.)
                D = (G[..., :, None] - G[..., None, :]).tril_().exp_().tril_()
            P.mul_(D)
            KD.mul_(D)
            gamma = Gamma[..., None]  # [BH, N, C, 1]
            k_in = gamma * k  # keys decayed back to the chunk's start
            q_s = q * gamma  # queries decayed back to the chunk's start
            end_decay = (G[..., -1:] - G).exp_()[..., None]  # [BH, N, C, 1]
            k_o = k * end_decay  # keys decayed to the chunk's end
            a = G[..., -1].exp()  # [BH, N]: the chunk's total decay
        Tinv = unit_lower_inverse(KD * b)  # (I + A)⁻¹, A_ij = β_i k_i·k_j D_ij
        U_tilde = Tinv @ (b * v)  # [BH, N, C, V]
        W = Tinv @ (b * (k if k_in is None else k_in))  # [BH, N, C, K]

        # The only sequential part. Each step writes straight into S_before[:, n + 1] and U[:, n]
        # (out= views: no per-step lists and no stack copies afterwards).
        S_before = entering_states(q.new_empty(BH, N, K, V), S0)  # [:, n]: the state entering chunk n
        U = torch.empty_like(U_tilde)  # [BH, N, C, V]: pseudo-values
        k_end = k if k_o is None else k_o
        for n in range(N):
            S_n = S_before[:, n]
            U_n = torch.baddbmm(U_tilde[:, n], W[:, n], S_n, alpha=-1.0, out=U[:, n])  # [BH, C, V]
            S_next = S_before[:, n + 1] if n + 1 < N else torch.empty_like(S_n)
            if a is None:
                torch.baddbmm(S_n, k_end[:, n].mT, U_n, out=S_next)
            else:
                torch.mul(S_n, a[:, n, None, None], out=S_next).baddbmm_(k_end[:, n].mT, U_n)
        S = S_next
        o = matmul_add_((q if q_s is None else q_s) @ S_before, P, U)  # [BH, N, C, V]

        ctx.has_S0 = S0 is not None
        ctx.save_for_backward(q, k, v, beta, KD, P, D, Tinv, W, U, S_before, gamma, end_decay, a, q_s, k_o, k_in)
        return o, S

    @staticmethod
    @autocast_off
    def backward(ctx, do, dS_final):  # noqa: ANN001, ANN205
        q, k, v, beta, KD, P, D, Tinv, W, U, S_before, gamma, end_decay, a, q_s, k_o, k_in = ctx.saved_tensors
        gated = D is not None
        N = q.shape[1]
        b = beta[..., None]
        q_dec = q if q_s is None else q_s
        k_end = k if k_o is None else k_o

        # do arrives as a transposed view of the [B, T, H, V] cotangent; four matmuls read it and
        # each would copy it to fold its batch dims, so copy once.
        do = do.contiguous()
        dU_o = P.mT @ do  # [BH, N, C, V]: dU from the outputs
        dq_s = do @ S_before.mT  # [BH, N, C, K]
        dS_o = q_dec.mT @ do  # [BH, N, K, V]: dS from the outputs
        # Reverse loop, written in place like the forward one: dS_after[:, n] is the cotangent of
        # the state after chunk n, dU[:, n] that of the pseudo-values U_n.
        dS_after = torch.empty_like(dS_o)  # [BH, N, K, V]
        dU = torch.empty_like(dU_o)  # [BH, N, C, V]
        dS_after[:, -1].copy_(dS_final)
        for n in range(N - 1, -1, -1):
            dS_n = dS_after[:, n]
            dU_n = torch.baddbmm(dU_o[:, n], k_end[:, n], dS_n, out=dU[:, n])
            dS_prev = dS_after[:, n - 1] if n > 0 else torch.empty_like(dS_n)
            if gated:
                torch.addcmul(dS_o[:, n], dS_n, a[:, n, None, None], out=dS_prev)
            else:
                torch.add(dS_n, dS_o[:, n], out=dS_prev)
            dS_prev.baddbmm_(W[:, n].mT, dU_n, alpha=-1.0)
        dS0 = dS_prev if ctx.has_S0 else None

        dk_end = U @ dS_after.mT  # [BH, N, C, K]
        # U = Ũ − W S with [Ũ, W] = L⁻¹ [βV, βΓK]: the right-hand sides get dRv = L⁻ᵀ dU and
        # dRk = L⁻ᵀ dW = −dRv Sᵀ, and L gets −dRv Ũᵀ − dRk Wᵀ = −dRv Uᵀ (strictly lower part only).
        dRv = Tinv.mT @ dU
        dRk = (dRv @ S_before.mT).neg_()
        dA = (dRv @ U.mT).neg_().tril_(-1)
        dP = (do @ U.mT).tril_()

        # A = diag(β) (k kᵀ ⊙ D) and P = q kᵀ ⊙ D: k kᵀ gets dA·β ⊙ D, q kᵀ gets dP ⊙ D.
        E = dA * KD  # dA ⊙ (A / β): row sums give dβ, times β the decay pairs below
        dbeta = E.sum(-1) + (v * dRv).sum(-1)
        dv = b * dRv
        dkk = dA.mul_(b)
        dqk = dP
        if gated:
            pairs = torch.addcmul(dP * P, E, b)  # Σ cotangent × value of every D_ij-weighted term
            dkk.mul_(D)
            dqk = dP * D
        dq = dqk @ k
        # k kᵀ is symmetric, so its cotangent reaches k from both sides: (dkk + dkkᵀ) k. The
        # transposed add is one elementwise pass, cheaper than a second [C, C] @ [C, K] matmul.
        dk = matmul_add_((dkk + dkk.mT) @ k, dqk.mT, q)
        if gated:
            rhs_k = (k_in * dRk).sum(-1)  # Σ_K Γk ⊙ d(βΓk): feeds dβ and dG
            dk.add_((b * gamma) * dRk).add_(dk_end * end_decay)
            dq.add_(dq_s * gamma)
        else:
            rhs_k = (k * dRk).sum(-1)
            dk.add_(b * dRk).add_(dk_end)
            dq.add_(dq_s)
        dbeta = dbeta.add_(rhs_k)
        dg = None
        if gated:
            # Each D_ij = exp(G_i − G_j) passes its (cotangent × value) to G_i and, negated, to G_j.
            dG = pairs.sum(-1) - pairs.sum(-2)
            dG += beta * rhs_k  # rhs keys β Γ k
            dG += (dq_s * q_s).sum(-1)  # decayed queries q Γ
            dko = (dk_end * k_o).sum(-1)  # decayed keys K̄ = K exp(G_C − G)
            dG -= dko
            dG[..., -1] += dko.sum(-1) + (S_before * dS_after).sum((-1, -2)) * a  # G_C, also in a = exp(G_C)
            dg = dG.flip(-1).cumsum(-1).flip(-1)  # G = cumsum(g) inside the chunk
        return dq, dk, dv, dbeta, dg, dS0


def chunk_delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    scale: float,
    initial_state: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared core of `chunk_delta_rule` (g=None) and `chunk_gated_delta_rule`, inputs validated.

    Returns `(o [B, T, H, V] in the accumulation dtype, final state [B, H, K, V])`.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    dt = acc_dtype(q, initial_state)

    def chunked(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, *D] -> [B·H, N, C, *D]
        x = to_chunks(x.to(dt), C)
        return x.flatten(0, 1)

    qc = chunked(q * scale)
    S0 = None if initial_state is None else initial_state.to(dt).reshape(B * H, K, V)
    gc = None if g is None else chunked(g)
    o, S = _ChunkDeltaRule.apply(qc, chunked(k), chunked(v), chunked(beta), gc, S0)
    o = from_chunks(o.unflatten(0, (B, H)), T)
    return o, S.reshape(B, H, K, V)


@autocast_off
def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule (Gated DeltaNet, Yang et al. 2024), chunked.

    `S_t = exp(g_t) (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ`, `o_t = S_tᵀ (scale · q_t)`.

    Args:
        q, k: `[B, T, H, K]`. Not normalised here: layers L2-normalise keys so that
            `I − β k kᵀ` stays a contraction.
        v: `[B, T, H, V]`.
        g: `[B, T, H]` log decay (≤ 0 for a decay; any real value is computed as given).
        beta: `[B, T, H]` write strength, usually a sigmoid in (0, 1).
        scale: query scale; `None` means `K ** -0.5`.
        initial_state: `[B, H, K, V]`.
        output_final_state: also return the state after the last token (float32, or float64).
        chunk_size: tokens per chunk, a power of two.

    Returns:
        `(o [B, T, H, V] in q's dtype, final_state [B, H, K, V] or None)`.
    """
    scale = check_inputs(q, k, v, scale=scale, g=g, beta=beta, initial_state=initial_state)[-1]
    o, S = chunk_delta_rule_fwd(q, k, v, beta, g, scale, initial_state,
                                fit_chunk_size(chunk_size, q.shape[1]))
    return o.to(q.dtype), S if output_final_state else None
