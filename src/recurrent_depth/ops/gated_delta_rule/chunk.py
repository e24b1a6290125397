"""Chunked (gated) delta rule in the WY / UT-transform representation.

Inside a chunk with entering state S, let G_i be the cumulative log decay up to token i (0 for
the plain delta rule), Γ_i = exp(G_i) and D_ij = exp(G_i − G_j) for j ≤ i. Unrolling the
recurrence, the pseudo-values u_i = β_i (v_i − S'_iᵀ k_i) satisfy one unit-lower-triangular system

    (I + A) U = diag(β) V − diag(β Γ) K S,      A_ij = β_i D_ij k_i·k_j   (j < i)

so with T = (I + A)⁻¹ (the UT transform, one batched triangular solve for all chunks at once):

    Ũ = T diag(β) V,   W = T diag(β Γ) K,   U = Ũ − W S
    O = diag(Γ) Q S + (Q Kᵀ ⊙ D ⊙ causal) U
    S ← Γ_C S + (K ⊙ exp(G_C − G))ᵀ U

Everything but the two small matmuls that carry S from chunk to chunk is batched over chunks.
Every exponent is a decay (≤ 0), so nothing can overflow however strong the gates are.
"""

from __future__ import annotations

import torch

from recurrent_depth.ops._common import acc_dtype, check_chunk_size, check_inputs, from_chunks, steps, to_chunks


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
    qc = to_chunks(q.to(dt) * scale, C)  # [B, H, N, C, K]
    kc = to_chunks(k.to(dt), C)  # [B, H, N, C, K]
    vc = to_chunks(v.to(dt), C)  # [B, H, N, C, V]
    bc = to_chunks(beta.to(dt), C)[..., None]  # [B, H, N, C, 1]
    N = qc.shape[2]

    kk = kc @ kc.transpose(-1, -2)  # [B, H, N, C, C]
    qk = qc @ kc.transpose(-1, -2)
    if g is None:
        qk = qk.masked_fill_(~torch.ones(C, C, dtype=torch.bool, device=q.device).tril(), 0.0)  # bmm keeps inputs
        rhs_k = bc * kc
        q_in, k_out, chunk_decay = qc, kc, None
    else:
        G = to_chunks(g.to(dt), C).cumsum(-1)  # [B, H, N, C]
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        # Mask before exp: above the diagonal G_i - G_j > 0 could overflow. The zeros it leaves
        # there make qk causal without another mask.
        decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        kk, qk = kk * decay, qk * decay
        gamma = G.exp()[..., None]  # [B, H, N, C, 1]
        rhs_k = bc * gamma * kc
        q_in = qc * gamma
        k_out = kc * (G[..., -1:] - G).exp()[..., None]  # keys decayed to the chunk's end
        chunk_decay = G[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    # (I + A) X = rhs with A = StrictLower(diag(β) kk). No mask needed: with unitriangular=True the
    # solver reads only the strictly lower triangle of its matrix, and its gradient is zero elsewhere.
    X = torch.linalg.solve_triangular(bc * kk, torch.cat([bc * vc, rhs_k], dim=-1), upper=False, unitriangular=True)
    U_tilde, W = X.split([V, K], dim=-1)  # split, not slicing: its backward is one cat, no zero-fill

    S = q.new_zeros(B, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    states, pseudo_values = [], []
    decays = [None] * N if chunk_decay is None else steps(chunk_decay, 2)
    for U_tilde_n, W_n, k_n, a_n in zip(steps(U_tilde, 2), steps(W, 2), steps(k_out, 2), decays):
        U_n = U_tilde_n - W_n @ S  # [B, H, C, V]
        states.append(S)
        pseudo_values.append(U_n)
        S = (S if a_n is None else a_n * S) + k_n.transpose(-1, -2) @ U_n
    S_before = torch.stack(states, dim=2)  # [B, H, N, K, V]
    U = torch.stack(pseudo_values, dim=2)  # [B, H, N, C, V]
    o = q_in @ S_before + qk @ U
    return from_chunks(o, T), S


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
    o, S = chunk_delta_rule_fwd(q, k, v, beta, g, scale, initial_state, check_chunk_size(chunk_size))
    return o.to(q.dtype), S if output_final_state else None
