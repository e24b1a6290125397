"""Softmax attention from quantized KV code rows (`codes_attention`, the reference; fused forms in `accel.quant`),
and with a recent-token window of exact entries (`windowed_codes_attention`, `windowed_scores`)."""

from recurrent_depth.ops.codes_attention.naive import (
    causal_scores_mask,
    codes_attention,
    windowed_codes_attention,
    windowed_scores,
)

__all__ = ["causal_scores_mask", "codes_attention", "windowed_codes_attention", "windowed_scores"]
