"""Gated delta rule (Gated DeltaNet): chunked (WY representation), fused-recurrent and naive forms."""

from recurrent_depth.ops.gated_delta_rule.chunk import chunk_gated_delta_rule
from recurrent_depth.ops.gated_delta_rule.fused_recurrent import fused_recurrent_gated_delta_rule
from recurrent_depth.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "naive_recurrent_gated_delta_rule"]
