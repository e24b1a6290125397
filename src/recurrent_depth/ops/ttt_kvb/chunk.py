"""TTT-KVB in its dual (chunked) form: one mini-batch per chunk, all its tokens at once.

Within mini-batch i (keys K_i, values V_i, queries Q_i, rates β_i, entering weight W_i):

    E   = K_i W_i − V_i                                   (the residuals, all at W_i)
    O_i = Q_i W_cur − (tril(Q_i K_iᵀ) ⊙ β_sᵀ) E            W_{i+1} = W_cur − K_iᵀ diag(β_i) E

where W_cur = W_i except in the first chunk of a call that resumes inside a mini-batch (decode),
where it is the weight after the tokens already seen. The chunk size is the mini-batch size: the
method's mini-batching is what makes it parallel (the chunks stay sequential).
"""

from __future__ import annotations

import torch

from recurrent_depth.ops._common import acc_dtype, autocast_off, check_inputs, from_chunks, to_chunks
from recurrent_depth.ops.ttt_kvb.naive import TTTKVBState, check_mini_batch, check_ttt_state


@autocast_off
def chunk_ttt_kvb(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: TTTKVBState | None = None,
    output_final_state: bool = False,
    mini_batch: int = 16,
) -> tuple[torch.Tensor, TTTKVBState | None]:
    """Same arguments and results as `naive_recurrent_ttt_kvb`, computed one mini-batch at a time."""
    B, T, H, K, V, scale = check_inputs(q, k, v, scale=scale, beta=beta)
    C = check_mini_batch(mini_batch)
    dt, out_dtype = acc_dtype(q, k), q.dtype
    if initial_state is None:
        start = current = q.new_zeros(B, H, K, V, dtype=dt)
        offset = 0
    else:
        check_ttt_state(initial_state, B, H, K, V, C, q)
        start, current, offset = initial_state.start.to(dt), initial_state.current.to(dt), initial_state.offset
    # zero-padding `offset` slots before the first token aligns chunks with mini-batches (zeros add nothing);
    # a call that ends inside its first mini-batch is one chunk of offset + T, not padded up to C
    width = min(C, offset + T)
    qc, kc, vc = (to_chunks(x.to(dt), width, left=offset) for x in (q * scale, k, v))  # [B, H, N, width, D]
    bc = to_chunks(beta.to(dt)[..., None], width, left=offset)  # [B, H, N, width, 1]
    causal = torch.ones(width, width, dtype=torch.bool, device=q.device).tril()
    outs = []
    entering = start
    for n in range(qc.shape[2]):
        q_n, k_n, v_n, b_n = qc[:, :, n], kc[:, :, n], vc[:, :, n], bc[:, :, n]
        entering = start
        error = k_n @ start - v_n  # [B, H, C, V]
        scores = (q_n @ k_n.transpose(-1, -2)).masked_fill(~causal, 0.0) * b_n.transpose(-1, -2)
        outs.append(q_n @ current - scores @ error)
        current = current - (b_n * k_n).transpose(-1, -2) @ error
        start = current
    o = from_chunks(torch.stack(outs, dim=2), T, left=offset).to(out_dtype)
    if not output_final_state:
        return o, None
    end = (offset + T) % C
    # an unfinished last mini-batch keeps taking its gradients at the weight that entered it
    return o, TTTKVBState(entering if end else current, current, end)
