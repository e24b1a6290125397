"""Softmax attention from quantized KV code rows (`codes_attention`, the reference; fused forms in `accel.quant`)."""

from recurrent_depth.ops.codes_attention.naive import causal_scores_mask, codes_attention

__all__ = ["causal_scores_mask", "codes_attention"]
