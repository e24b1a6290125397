"""Linear attention (Katharopoulos et al. 2020): chunked, fused-recurrent and naive forms."""

from recurrent_depth.ops.linear_attn.chunk import chunk_linear_attn
from recurrent_depth.ops.linear_attn.fused_recurrent import fused_recurrent_linear_attn
from recurrent_depth.ops.linear_attn.naive import naive_recurrent_linear_attn

__all__ = ["chunk_linear_attn", "fused_recurrent_linear_attn", "naive_recurrent_linear_attn"]
