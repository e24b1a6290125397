"""Chunked log-linear attention: masked matmuls inside chunks, a chunk-level Fenwick tree across.

Chunks are aligned to absolute positions (multiples of C = 2^c), so for t and s in one chunk
the level ℓ(t, s) = bit_length(t XOR s) ≤ c depends only on their offsets in the chunk, and for s
in an earlier chunk m < n it is c + bit_length(n XOR m). Hence:

- intra-chunk (levels 0..c): one masked `[C, C]` score matrix per chunk, weighted by λ_t[ℓ(i, j)];
- inter-chunk (levels > c): the Fenwick recurrence run over *chunks* (each chunk's k vᵀ summed),
  giving for chunk n the level states H_n^{ℓ'} (ℓ' ≥ 1) entering it; queries read them with
  weights λ_t[c + ℓ'] in one matmul over the stacked levels.

A carried state (the Fenwick levels X^ℓ of token t0 = offset − 1) is read in closed form: for a
later token t with h = bit_length(t XOR t0), the tokens of X^ℓ are at level max(ℓ, h) from t.
So their contribution is one more matmul for all t, and a level regrouping for the final state.
Cost: O(T·C) inside chunks plus O(T·log(T/C)·K·V) across them; the loop runs over chunks only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recurrent_depth.ops._common import acc_dtype, autocast_off, fit_chunk_size, from_chunks, steps, to_chunks
from recurrent_depth.ops.log_linear_attn.utils import (
    LogLinearState,
    bit_length,
    check_log_linear_inputs,
    level_matrix,
    levels_needed,
    trailing_ones,
)


@autocast_off
def chunk_log_linear_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    level_scales: torch.Tensor,
    scale: float | None = None,
    initial_state: LogLinearState | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, LogLinearState | None]:
    """Log-linear attention (Guo et al. 2025) over a scalar-gate (Mamba-2 style) base, chunked.

    `o_t = Σ_{s ≤ t} level_scales[t, ℓ(t, s)] · exp(G_t − G_s) · (scale · q_t · k_s) · v_s` with
    `ℓ(t, s) = bit_length(t XOR s)` over absolute positions and `G` the cumulative log decay.
    With every level weight 1 it is exactly scalar-gate linear attention (`chunk_gla` with g
    broadcast over K).

    Args:
        q, k: `[B, T, H, K]`.
        v: `[B, T, H, V]`.
        g: `[B, T, H]` scalar log decay per head (≤ 0).
        level_scales: `[B, T, H, L]` per-query level weights λ; L must be at least
            bit_length(offset + T − 1) + 1 (extra levels are allowed and unused).
        scale: query scale; `None` means `K ** -0.5` (fla's log-linear reference defaults to 1.0).
        initial_state: a `LogLinearState(levels [B, H, L0, K, V], offset)` from an earlier call.
        output_final_state: also return the `LogLinearState` after the last token, with
            max(L, L0) levels (float32, or float64).
        chunk_size: tokens per chunk, a power of two.

    Returns:
        `(o [B, T, H, V] in q's dtype, final LogLinearState or None)`.
    """
    B, T, H, K, V, L, scale, levels0, offset = check_log_linear_inputs(q, k, v, g, level_scales, scale, initial_state)
    C = fit_chunk_size(chunk_size, T)
    c = C.bit_length() - 1
    dt, out_dtype = acc_dtype(q, levels0), q.dtype
    dev = q.device
    L_state = L if levels0 is None else max(L, levels0.shape[2])
    left = offset % C  # pad in front so that chunks start at absolute multiples of C
    first_chunk = offset // C

    qc = to_chunks(q.to(dt) * scale, C, left)  # [B, H, N, C, K]
    kc = to_chunks(k.to(dt), C, left)  # [B, H, N, C, K]
    vc = to_chunks(v.to(dt), C, left)  # [B, H, N, C, V]
    G = to_chunks(g.to(dt), C, left).cumsum(-1)  # [B, H, N, C]
    N = qc.shape[2]
    inter_levels = (first_chunk + N - 1).bit_length()  # chunk-level levels 1..inter_levels
    L_pad = max(L_state, c + 1 + inter_levels)
    lam = F.pad(level_scales.to(dt), (0, L_pad - L))  # zero weight for unused levels
    lam_c = to_chunks(lam, C, left)  # [B, H, N, C, L_pad]

    # Intra-chunk: levels 0..c through one masked, level-weighted score matrix per chunk.
    causal = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [B, H, N, C, C]
    lvl = level_matrix(C, dev)
    weights = lam_c.gather(-1, lvl.expand(B, H, N, C, C))  # λ_i[ℓ(i, j)]
    o = (qc @ kc.transpose(-1, -2) * decay * weights) @ vc  # [B, H, N, C, V]

    # Inter-chunk: the Fenwick recurrence over chunks, one level list update per chunk.
    if inter_levels:
        G_end = G[..., -1:]  # [B, H, N, 1]
        dS = (kc * (G_end - G).exp()[..., None]).transpose(-1, -2) @ vc  # [B, H, N, K, V]
        chunk_decay = G_end.exp()[..., None]  # [B, H, N, 1, 1]
        zero = qc.new_zeros(B, H, K, V)
        Y = [zero] * (inter_levels + 1)  # chunk-level states after the previous chunk
        entering = []
        for n, (dS_n, a_n) in enumerate(zip(steps(dS, 2), steps(chunk_decay, 2))):
            if n > 0:
                cc = trailing_ones(first_chunk + n - 1)
                Y = [zero] * (cc + 1) + [sum(Y[: cc + 2])] + Y[cc + 2 :]
            entering.append(torch.stack(Y[1:], dim=2))  # [B, H, inter_levels, K, V]
            Y = [dS_n] + [y * a_n for y in Y[1:]]
        H_in = torch.stack(entering, dim=2)  # [B, H, N, inter_levels, K, V]
        q_dec = qc * G.exp()[..., None]  # queries decayed back to their chunk's start
        lam_inter = lam_c[..., c + 1 : c + 1 + inter_levels]  # [B, H, N, C, inter_levels]
        q_w = (lam_inter[..., None] * q_dec[..., None, :]).flatten(-2)  # [B, H, N, C, inter_levels·K]
        o = o + q_w @ H_in.flatten(3, 4)
    o = from_chunks(o, T, left)  # [B, T, H, V]

    if levels0 is not None:
        o = o + _read_initial_state(q.to(dt) * scale, g.to(dt), lam, levels0.to(dt), offset)
    if not output_final_state:
        return o.to(out_dtype), None

    # Final state: the Fenwick levels of the last token t_f (chunk n_f, offset a_f in it).
    i_f = left + T - 1
    n_f, a_f = divmod(i_f, C)
    G_f = G[:, :, n_f, a_f]  # [B, H]
    k_dec = kc[:, :, n_f, : a_f + 1] * (G_f[..., None] - G[:, :, n_f, : a_f + 1]).exp()[..., None]
    onehot = F.one_hot(lvl[a_f, : a_f + 1], c + 1).to(dt)  # [a_f + 1, c + 1]: key -> in-chunk level
    per_level = torch.einsum("jl,bhjk->bhlkj", onehot, k_dec)  # [B, H, c + 1, K, a_f + 1]
    low = per_level @ vc[:, :, n_f, None, : a_f + 1]  # [B, H, c + 1, K, V]
    parts = [low]
    if inter_levels:
        parts.append(H_in[:, :, n_f] * G_f.exp()[..., None, None, None])
    X = torch.cat(parts, dim=2)  # [B, H, c + 1 + inter_levels, K, V]
    X = F.pad(X, (0, 0, 0, 0, 0, max(L_state - X.shape[2], 0)))[:, :, :L_state]
    if levels0 is not None:
        X = X + _carry_initial_state(g.to(dt), levels0.to(dt), offset, T, L_state)
    return o.to(out_dtype), LogLinearState(X, offset + T)


def _initial_levels_for(positions: range, offset: int) -> torch.Tensor:
    """h_t = bit_length(t XOR (offset − 1)): level at which t sees the carried state's low levels."""
    t0 = offset - 1
    return bit_length(torch.tensor([p ^ t0 for p in positions]))


def _read_initial_state(
    q: torch.Tensor, g: torch.Tensor, lam: torch.Tensor, levels0: torch.Tensor, offset: int
) -> torch.Tensor:
    """Outputs `[B, T, H, V]` due to a carried state: Σ_ℓ λ_t[max(ℓ, h_t)] e^{G_t} q_t·X^ℓ.

    q: `[B, T, H, K]` (scaled), g: `[B, T, H]`, lam: `[B, T, H, L_pad]`, levels0: `[B, H, L0, K, V]`.
    """
    B, T, H, K = q.shape
    L0 = levels0.shape[2]
    h = _initial_levels_for(range(offset, offset + T), offset).to(q.device)  # [T]
    idx = torch.maximum(torch.arange(L0, device=q.device)[None, :], h[:, None])  # [T, L0]
    w = lam.gather(-1, idx[None, :, None, :].expand(B, T, H, L0))  # [B, T, H, L0]
    q_dec = q * g.cumsum(1).exp()[..., None]  # decayed back to the carried state's time
    q_w = (w[..., None] * q_dec[..., None, :]).flatten(-2)  # [B, T, H, L0·K]
    return torch.einsum("bthn,bhnv->bthv", q_w, levels0.flatten(2, 3))


def _carry_initial_state(g: torch.Tensor, levels0: torch.Tensor, offset: int, T: int, L_state: int) -> torch.Tensor:
    """The carried levels as seen from the last token: levels ≤ h_f merge into h_f, all decay."""
    B, H, L0, K, V = levels0.shape
    h_f = ((offset + T - 1) ^ (offset - 1)).bit_length()  # level of the carried low levels at the end
    assert h_f < levels_needed(offset + T) <= L_state  # validated: level_scales covers every position
    total_decay = g.sum(1).exp()[..., None, None, None]  # [B, H, 1, 1, 1]
    target = torch.arange(L0, device=g.device).clamp(min=h_f)  # new level of each carried level
    regroup = F.one_hot(target, L_state).to(levels0)  # [L0, L_state]
    return torch.einsum("lm,bhlkv->bhmkv", regroup, levels0) * total_decay
