"""Chunked FALCON: the NLMS step on (k_{t−1}, v_t) is a delta rule on the shifted keys.

    β'_t = β_t / (ε + ‖k_{t−1}‖²)     S_t = (I − β'_t x_t x_tᵀ) S_{t−1} + β'_t x_t v_tᵀ,  x_t = k_{t−1}

so the chunked (WY) delta rule computes it exactly; only the key shift and the step normalisation
are FALCON's own.
"""

from __future__ import annotations

import torch

from recurrent_depth.ops._common import acc_dtype, autocast_off, check_inputs, fit_chunk_size
from recurrent_depth.ops.falcon.naive import FalconState, check_eps, check_falcon_state, previous_keys
from recurrent_depth.ops.gated_delta_rule.chunk import chunk_delta_rule_fwd


@autocast_off
def chunk_falcon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: FalconState | None = None,
    output_final_state: bool = False,
    eps: float = 1e-6,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, FalconState | None]:
    """Same arguments and results as `naive_recurrent_falcon` (plus `chunk_size`, a power of two)."""
    B, T, H, K, V, scale = check_inputs(q, k, v, scale=scale, beta=beta)
    eps = check_eps(eps, initial_state)
    dt = acc_dtype(q, k)
    S0 = None
    if initial_state is not None:
        check_falcon_state(initial_state, B, H, K, V, q)
        S0 = initial_state.S.to(dt)
    x = previous_keys(k.to(dt), initial_state)
    step = beta.to(dt) / (eps + x.pow(2).sum(-1))
    o, S = chunk_delta_rule_fwd(q.to(dt), x, v.to(dt), step, None, scale, S0,
                                fit_chunk_size(chunk_size, T))
    return o.to(q.dtype), FalconState(S, k[:, -1].to(dt)) if output_final_state else None
