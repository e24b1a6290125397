"""Recurrent delta rule for decoding: the gated delta rule's loop with no decay."""

from __future__ import annotations

import torch

from recurrent_depth.ops._common import autocast_off, check_inputs
from recurrent_depth.ops.gated_delta_rule.fused_recurrent import fused_recurrent_delta_rule_fwd


@autocast_off
def fused_recurrent_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The delta rule token by token; same arguments and results as `chunk_delta_rule`."""
    scale = check_inputs(q, k, v, scale=scale, beta=beta, initial_state=initial_state)[-1]
    o, S = fused_recurrent_delta_rule_fwd(q, k, v, beta, None, scale, initial_state)
    return o.to(q.dtype), S if output_final_state else None
