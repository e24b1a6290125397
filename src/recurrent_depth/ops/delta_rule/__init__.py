"""Delta rule (DeltaNet): chunked (WY representation), fused-recurrent and naive forms."""

from recurrent_depth.ops.delta_rule.chunk import chunk_delta_rule
from recurrent_depth.ops.delta_rule.fused_recurrent import fused_recurrent_delta_rule
from recurrent_depth.ops.delta_rule.naive import naive_recurrent_delta_rule

__all__ = ["chunk_delta_rule", "fused_recurrent_delta_rule", "naive_recurrent_delta_rule"]
