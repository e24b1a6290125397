"""Step-by-step TTT-KVB with a linear inner model (TTT-Linear, Sun et al. 2024, arXiv 2407.04620;
the key-value-binding view of "Test-Time Training with KV Binding Is Secretly Linear
Attention", cited by title in the research notes): the ground truth for the chunked (dual) form.

The fast weight W [K, V] is trained online on ℓ_s(W) = ½‖Wᵀk_s − v_s‖², gradient
∇ℓ_s(W) = k_s (Wᵀk_s − v_s)ᵀ, with mini-batch gradient descent: every gradient of mini-batch i is
taken at W_i, the weight entering that mini-batch (b tokens, counted from the first position):

    W_t = W_i − Σ_{s in batch i, s ≤ t} β_s k_s (W_iᵀ k_s − v_s)ᵀ        o_t = W_tᵀ (scale · q_t)

b = 1 is the delta rule; W_0 = 0 with one batch covering the sequence (b ≥ T) is un-normalised
linear attention with keys β_s k_s (see docs/mixers.md).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from recurrent_depth.ops._common import acc_dtype, autocast_off, check_inputs, check_state, heads_first, steps


class TTTKVBState(NamedTuple):
    """Decode state after some tokens: `start` W_i (the weight the current mini-batch's gradients are
    taken at), `current` W_t, both [B, H, K, V], and `offset`, tokens already in the current mini-batch."""

    start: torch.Tensor
    current: torch.Tensor
    offset: int


def check_ttt_state(state: object, B: int, H: int, K: int, V: int, mini_batch: int, ref: torch.Tensor) -> None:
    if not isinstance(state, TTTKVBState):
        raise ValueError(f"initial_state must be a TTTKVBState, got {type(state).__name__}")
    check_state(state.start, B, H, K, V, ref)
    check_state(state.current, B, H, K, V, ref)
    if not 0 <= state.offset < mini_batch:
        raise ValueError(f"initial_state.offset={state.offset} must be in [0, mini_batch={mini_batch})")


def check_mini_batch(mini_batch: int) -> int:
    if isinstance(mini_batch, bool) or not isinstance(mini_batch, int) or mini_batch < 1:
        raise ValueError(f"mini_batch={mini_batch!r} must be a positive integer")
    return mini_batch


@autocast_off
def naive_recurrent_ttt_kvb(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: TTTKVBState | None = None,
    output_final_state: bool = False,
    mini_batch: int = 16,
) -> tuple[torch.Tensor, TTTKVBState | None]:
    """TTT-KVB one token at a time. q, k [B, T, H, K], v [B, T, H, V], beta [B, T, H] (inner learning rate).

    Returns `(o [B, T, H, V] in q's dtype, TTTKVBState or None)`.
    """
    B, T, H, K, V, scale = check_inputs(q, k, v, scale=scale, beta=beta)
    check_mini_batch(mini_batch)
    dt, out_dtype = acc_dtype(q, k), q.dtype
    if initial_state is None:
        start = current = q.new_zeros(B, H, K, V, dtype=dt)
        offset = 0
    else:
        check_ttt_state(initial_state, B, H, K, V, mini_batch, q)
        start, current, offset = initial_state.start.to(dt), initial_state.current.to(dt), initial_state.offset
    q, k, v, beta = (heads_first(x, dt) for x in (q, k, v, beta))
    outs = []
    for q_t, k_t, v_t, b_t in zip(steps(q * scale, 2), steps(k, 2), steps(v, 2), steps(beta[..., None], 2)):
        error = torch.einsum("bhkv,bhk->bhv", start, k_t) - v_t  # gradient taken at the batch's W_i
        current = current - torch.einsum("bhk,bhv->bhkv", b_t * k_t, error)
        outs.append(torch.einsum("bhkv,bhk->bhv", current, q_t))
        offset += 1
        if offset == mini_batch:
            start, offset = current, 0
    o = torch.stack(outs, dim=1).to(out_dtype)
    return o, TTTKVBState(start, current, offset) if output_final_state else None
