"""Log-linear Gated DeltaNet as functions: Fenwick-tree levels over the gated delta rule.

Gated DeltaNet unrolls to S_t = sum_{s<=t} P_{t<-s} beta_s k_s v_s^T with the transitions
A_r = alpha_r (I - beta_r k_r k_r^T) and P_{t<-s} = A_t ... A_{s+1}. Log-linear attention
(Guo et al. 2025) weighs each source token by a per-query, per-level scale:

    o_t = sum_{s<=t} lambda_t[l(t, s)] (scale q_t)^T P_{t<-s} beta_s k_s v_s^T,   l(t, s) = bit_length(t XOR s)

Because every level evolves under the same linear transitions, each Fenwick level keeps its
own [K, V] state: at token t, merge levels 0..c into c + 1 (c = trailing ones of t - 1), apply
A_t to every level, put beta_t k_t v_t^T in level 0, and read o_t = sum_l lambda_t[l] X_l^T q_t.
With every lambda = 1 this is exactly Gated DeltaNet.

`recurrent_log_linear_gated_delta_rule` is that recurrence (the reference, and the decode form);
`chunk_log_linear_gated_delta_rule` is the fast form: inside a chunk the WY representation of
`ops/gated_delta_rule/chunk.py` gives the explicit [C, C] token-mixing matrix M (o = M V for a
zero entering state), which is weighted by lambda_t[l(i, j)]; across chunks a chunk-level Fenwick
tree of states is carried through each chunk's transition P_n = Gamma_C I - K_out^T W. Positions
are absolute (a `LogLinearState` carries the offset), tensors are [B, T, H, D] and states
[B, H, L, K, V], as in `recurrent_depth.ops`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recurrent_depth.ops._common import acc_dtype, autocast_off, check_like, fit_chunk_size, from_chunks, to_chunks
from recurrent_depth.ops.log_linear_attn.utils import (
    LogLinearState,
    check_log_linear_inputs,
    level_matrix,
    trailing_ones,
)


def _check(q, k, v, g, beta, level_scales, scale, initial_state):
    out = check_log_linear_inputs(q, k, v, g, level_scales, scale, initial_state)
    B, T, H = out[:3]
    check_like("beta", beta, (B, T, H), "[B, T, H]", q)
    return out


@autocast_off
def recurrent_log_linear_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    level_scales: torch.Tensor,
    scale: float | None = None,
    initial_state: LogLinearState | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, LogLinearState | None]:
    """Token-by-token log-linear gated delta rule.

    Args:
        q, k: `[B, T, H, K]` (the layer L2-normalises them). v: `[B, T, H, V]`.
        g: `[B, T, H]` log decay (<= 0). beta: `[B, T, H]` in [0, 1].
        level_scales: `[B, T, H, L]`, L >= bit_length(offset + T - 1) + 1.
        scale: query scale, None meaning K ** -0.5.
        initial_state: `LogLinearState(levels [B, H, L0, K, V], offset)` from an earlier call.

    Returns:
        `(o [B, T, H, V] in q's dtype, LogLinearState with max(L, L0) levels or None)`.
    """
    B, T, H, K, V, L, scale, levels0, offset = _check(q, k, v, g, beta, level_scales, scale, initial_state)
    dt, out_dtype = acc_dtype(q, levels0), q.dtype
    num_levels = L if levels0 is None else max(L, levels0.shape[2])

    def flat(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, D] -> [B*H, T, D]
        return x.to(dt).transpose(1, 2).reshape(B * H, T, x.shape[-1])

    qs, ks, vs = flat(q * scale), flat(k), flat(v)
    betas, alphas = flat(beta[..., None]), flat(g[..., None]).exp()  # [B*H, T, 1]
    lam = F.pad(flat(level_scales), (0, num_levels - L))  # [B*H, T, L_state]
    if levels0 is None:
        X = qs.new_zeros(B * H, num_levels, K, V)
    else:
        X = F.pad(levels0.to(dt).reshape(B * H, -1, K, V), (0, 0, 0, 0, 0, num_levels - levels0.shape[2]))
    outs = []
    for t in range(T):
        pos = offset + t
        kt, bt, at = ks[:, t], betas[:, t, :, None, None], alphas[:, t, :, None, None]  # [B*H, K], [B*H, 1, 1, 1]
        if pos > 0:
            c = trailing_ones(pos - 1)
            merged = X[:, : c + 2].sum(1, keepdim=True)
            rest = torch.cat([merged, X[:, c + 2 :]], dim=1)  # levels c + 1 .. L - 1
            k_rest = torch.einsum("nk,nlkv->nlv", kt, rest)
            rest = at * (rest - bt * kt[:, None, :, None] * k_rest[:, :, None, :])
            X = torch.cat([X.new_zeros(B * H, c + 1, K, V), rest], dim=1)
        new = betas[:, t, :, None] * kt[:, :, None] * vs[:, t, None, :]  # [B*H, K, V]
        X = torch.cat([new[:, None], X[:, 1:]], dim=1)
        read = torch.einsum("nk,nlkv->nlv", qs[:, t], X)  # [B*H, L, V]
        outs.append(torch.bmm(lam[:, t, None, :], read))  # [B*H, 1, V]
    o = torch.cat(outs, dim=1).reshape(B, H, T, V).transpose(1, 2)
    final = LogLinearState(X.reshape(B, H, num_levels, K, V), offset + T)
    return o.to(out_dtype), final if output_final_state else None


@autocast_off
def chunk_log_linear_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    level_scales: torch.Tensor,
    scale: float | None = None,
    initial_state: LogLinearState | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, LogLinearState | None]:
    """Chunked log-linear gated delta rule; same arguments and results as the recurrent form.

    Chunks are aligned to absolute positions (multiples of `chunk_size`). When a carried state
    ends mid-chunk, the tokens up to the next chunk boundary (fewer than `chunk_size`) run through
    the recurrent form first.
    """
    B, T, H, K, V, L, scale, levels0, offset = _check(q, k, v, g, beta, level_scales, scale, initial_state)
    C = fit_chunk_size(chunk_size, T)
    head = (-offset) % C
    if head:
        cut = min(head, T)
        o_head, state = recurrent_log_linear_gated_delta_rule(
            q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], level_scales[:, :cut], scale,
            initial_state, output_final_state=True,
        )
        if cut == T:
            return o_head, state if output_final_state else None
        o_tail, final = _chunk_aligned(
            q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], level_scales[:, cut:], scale, state, C,
            output_final_state,
        )
        return torch.cat([o_head, o_tail], dim=1), final
    return _chunk_aligned(q, k, v, g, beta, level_scales, scale, initial_state, C, output_final_state)


def _chunk_aligned(q, k, v, g, beta, level_scales, scale, initial_state, C, output_final_state):
    """The chunked form when the first token sits at a multiple of C."""
    B, T, H, K, V = *q.shape, v.shape[-1]
    L = level_scales.shape[-1]
    levels0, offset = initial_state if initial_state is not None else (None, 0)
    assert offset % C == 0
    c = C.bit_length() - 1
    dt, out_dtype = acc_dtype(q, levels0), q.dtype
    dev = q.device
    num_levels = L if levels0 is None else max(L, levels0.shape[2])
    first_chunk = offset // C

    qc = to_chunks(q.to(dt) * scale, C)  # [B, H, N, C, K]
    kc = to_chunks(k.to(dt), C)  # [B, H, N, C, K]
    vc = to_chunks(v.to(dt), C)  # [B, H, N, C, V]
    bc = to_chunks(beta.to(dt), C)[..., None]  # [B, H, N, C, 1]
    G = to_chunks(g.to(dt), C).cumsum(-1)  # [B, H, N, C]
    N = qc.shape[2]
    # chunk level 0 is the current chunk; chunk level j >= 1 holds token level c + j (one at least)
    chunk_levels = max((first_chunk + N - 1).bit_length() + 1, 2)
    L_pad = max(num_levels, c + chunk_levels)
    lam_c = to_chunks(F.pad(level_scales.to(dt), (0, L_pad - L)), C)  # [B, H, N, C, L_pad]

    # WY representation inside each chunk (see ops/gated_delta_rule/chunk.py), with the explicit
    # solve for diag(beta) kept: X_beta = (I + A)^-1 diag(beta) maps values to pseudo-values.
    causal = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [B, H, N, C, C]
    kk = kc @ kc.transpose(-1, -2) * decay
    qk = qc @ kc.transpose(-1, -2) * decay  # zero above the diagonal (decay is 0 there)
    gamma = G.exp()[..., None]  # [B, H, N, C, 1]
    A = (bc * kk).masked_fill(~causal.tril(-1), 0.0)
    eye = torch.eye(C, dtype=dt, device=dev)
    rhs = torch.cat([eye * bc, bc * gamma * kc], dim=-1)  # [B, H, N, C, C + K]
    X = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    X_beta, W = X[..., :C], X[..., C:]  # [B, H, N, C, C], [B, H, N, C, K]
    M = qk @ X_beta  # o_intra = M V: the chunk's own token-mixing matrix
    lvl = level_matrix(C, dev)
    weights = lam_c.gather(-1, lvl.expand(B, H, N, C, C))  # lambda_i[l(i, j)]
    o = (M * weights) @ vc  # [B, H, N, C, V]

    R = qc * gamma - qk @ W  # o_inter = R S for an entering state S: [B, H, N, C, K]
    k_out = kc * (G[..., -1:] - G).exp()[..., None]  # keys decayed to the chunk's end
    content = k_out.transpose(-1, -2) @ (X_beta @ vc)  # [B, H, N, K, V]: the chunk's own state
    eye_k = torch.eye(K, dtype=dt, device=dev)
    P = G[..., -1, None, None].exp() * eye_k - k_out.transpose(-1, -2) @ W  # [B, H, N, K, K]

    zero = qc.new_zeros(B, H, K, V)
    Y = [zero] * chunk_levels
    if levels0 is not None:  # token levels of token offset - 1 -> chunk levels of its chunk
        lv = levels0.to(dt)
        Y[0] = lv[:, :, : c + 1].sum(2)
        for j in range(1, chunk_levels):
            if c + j < lv.shape[2]:
                Y[j] = lv[:, :, c + j]
    inter = []
    for n in range(N):
        m = first_chunk + n
        if m > 0:
            cc = trailing_ones(m - 1)
            Y = [zero] * (cc + 1) + [sum(Y[: cc + 2])] + Y[cc + 2 :]
        entering = torch.stack(Y[1:], dim=2)  # [B, H, chunk_levels - 1, K, V]
        lam_inter = lam_c[:, :, n, :, c + 1 : c + chunk_levels]  # [B, H, C, chunk_levels - 1]
        read = torch.einsum("bhck,bhjkv->bhcjv", R[:, :, n], entering)
        inter.append(torch.einsum("bhcj,bhcjv->bhcv", lam_inter, read))
        moved = P[:, :, n, None] @ entering  # [B, H, chunk_levels - 1, K, V]
        Y = [content[:, :, n]] + list(moved.unbind(2))
    o = from_chunks(o + torch.stack(inter, dim=2), T)  # [B, T, H, V]
    if not output_final_state:
        return o.to(out_dtype), None

    # Final state: token levels of the last token (offset a_f in the last chunk). Levels 0..c split
    # the last chunk's own content by level: the content is linear in V, so mask V per level.
    a_f = T - 1 - (N - 1) * C
    onehot = F.one_hot(lvl[a_f], c + 1).to(dt) * (torch.arange(C, device=dev) <= a_f)[:, None].to(dt)
    low = torch.einsum("bhck,bhcs,sl,bhsv->bhlkv", k_out[:, :, -1], X_beta[:, :, -1], onehot, vc[:, :, -1])
    levels = torch.cat([low, torch.stack(Y[1:], dim=2)], dim=2)  # token levels 0 .. c + chunk_levels - 1
    if levels.shape[2] >= num_levels:
        assert not levels[:, :, num_levels:].any(), "levels beyond the state size must be empty"
        levels = levels[:, :, :num_levels]
    else:
        levels = F.pad(levels, (0, 0, 0, 0, 0, num_levels - levels.shape[2]))
    return o.to(out_dtype), LogLinearState(levels, offset + T)
