"""Chunked delta rule: the WY / UT-transform core of the gated delta rule with no decay."""

from __future__ import annotations

import torch

from recurrent_depth.ops._common import autocast_off, check_inputs, fit_chunk_size
from recurrent_depth.ops.gated_delta_rule.chunk import chunk_delta_rule_fwd


@autocast_off
def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Delta rule (DeltaNet; Schlag et al. 2021, chunked as in Yang et al. 2024).

    `S_t = (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ`, `o_t = S_tᵀ (scale · q_t)`.

    Args:
        q, k: `[B, T, H, K]`. Not normalised here: layers L2-normalise keys so that
            `I − β k kᵀ` stays a contraction.
        v: `[B, T, H, V]`.
        beta: `[B, T, H]` write strength, usually a sigmoid in (0, 1).
        scale: query scale; `None` means `K ** -0.5`.
        initial_state: `[B, H, K, V]`.
        output_final_state: also return the state after the last token (float32, or float64).
        chunk_size: tokens per chunk, a power of two.

    Returns:
        `(o [B, T, H, V] in q's dtype, final_state [B, H, K, V] or None)`.
    """
    scale = check_inputs(q, k, v, scale=scale, beta=beta, initial_state=initial_state)[-1]
    o, S = chunk_delta_rule_fwd(q, k, v, beta, None, scale, initial_state,
                                fit_chunk_size(chunk_size, q.shape[1]))
    return o.to(q.dtype), S if output_final_state else None
