"""Log-linear attention (Fenwick-tree levels over a scalar-gate base): chunked, fused-recurrent, naive."""

from recurrent_depth.ops.log_linear_attn.chunk import chunk_log_linear_attn
from recurrent_depth.ops.log_linear_attn.fused_recurrent import fused_recurrent_log_linear_attn
from recurrent_depth.ops.log_linear_attn.naive import naive_parallel_log_linear_attn, naive_recurrent_log_linear_attn
from recurrent_depth.ops.log_linear_attn.utils import LogLinearState

__all__ = [
    "LogLinearState",
    "chunk_log_linear_attn",
    "fused_recurrent_log_linear_attn",
    "naive_parallel_log_linear_attn",
    "naive_recurrent_log_linear_attn",
]
