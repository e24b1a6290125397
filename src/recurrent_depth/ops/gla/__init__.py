"""Gated linear attention (GLA): chunked (sub-chunked), fused-recurrent and naive forms."""

from recurrent_depth.ops.gla.chunk import chunk_gla
from recurrent_depth.ops.gla.fused_recurrent import fused_recurrent_gla
from recurrent_depth.ops.gla.naive import naive_recurrent_gla

__all__ = ["chunk_gla", "fused_recurrent_gla", "naive_recurrent_gla"]
