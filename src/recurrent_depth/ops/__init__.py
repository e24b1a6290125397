"""Functional ops of the linear-attention family, named as in flash-linear-attention (plain PyTorch).

Every op has a chunked form (`chunk_*`, the fast path for training and prefill), a recurrent form
(`fused_recurrent_*`, for decoding) with the same signature, and a step-by-step reference
(`naive_*`). Conventions, shared by all of them:

- tensors are `[B, T, H, D]` (q, k: D = K; v: D = V); gates are log decays; `beta` is `[B, T, H]`;
- `scale=None` means `K ** -0.5`; the ops never normalise q or k (layers do);
- states are `[B, H, K, V]` (linear attention with `normalize=True`: `(S, z [B, H, K])`;
  log-linear attention: `LogLinearState(levels [B, H, L, K, V], offset)`);
- they return `(o, final_state)`; `final_state` is None unless `output_final_state=True`;
- inputs may be bf16/fp16: everything accumulates in float32 (float64 inputs stay float64),
  `o` comes back in q's dtype and states in the accumulation dtype.

See docs/ops.md for the formulas, costs and examples.
"""

from recurrent_depth.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule, naive_recurrent_delta_rule
from recurrent_depth.ops.falcon import FalconState, chunk_falcon, naive_recurrent_falcon
from recurrent_depth.ops.gated_delta_rule import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
)
from recurrent_depth.ops.gla import chunk_gla, fused_recurrent_gla, naive_recurrent_gla
from recurrent_depth.ops.linear_attn import chunk_linear_attn, fused_recurrent_linear_attn, naive_recurrent_linear_attn
from recurrent_depth.ops.log_linear_attn import (
    LogLinearState,
    chunk_log_linear_attn,
    fused_recurrent_log_linear_attn,
    naive_parallel_log_linear_attn,
    naive_recurrent_log_linear_attn,
)
from recurrent_depth.ops.ttt_kvb import TTTKVBState, chunk_ttt_kvb, naive_recurrent_ttt_kvb

__all__ = [
    "FalconState",
    "LogLinearState",
    "TTTKVBState",
    "chunk_falcon",
    "chunk_ttt_kvb",
    "naive_recurrent_falcon",
    "naive_recurrent_ttt_kvb",
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_gla",
    "chunk_linear_attn",
    "chunk_log_linear_attn",
    "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gla",
    "fused_recurrent_linear_attn",
    "fused_recurrent_log_linear_attn",
    "naive_parallel_log_linear_attn",
    "naive_recurrent_delta_rule",
    "naive_recurrent_gated_delta_rule",
    "naive_recurrent_gla",
    "naive_recurrent_linear_attn",
    "naive_recurrent_log_linear_attn",
]
