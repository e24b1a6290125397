"""Softmax attention as in Huginn: fused Wqkv, per-head q/k bias before interleaved RoPE, causal SDPA.

Grouped-query attention (`num_kv_heads < num_heads`; the config's value, or the mixer option
`num_kv_heads`, 1 = multi-query) and an optional sliding window are supported.
With `num_kv_heads == num_heads` the q/k bias is the checkpoint's single `qk_bias` [2, 1, H, D];
with GQA the two biases have different head counts and are stored as `q_bias` / `k_bias`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recurrent_depth.config import ModelConfig
from recurrent_depth.model.layers import apply_rope
from recurrent_depth.model.linear import Linear
from recurrent_depth.model.mixers.base import LayerKey, MixerContext, register_mixer


@register_mixer("attention")
class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, part: str = "core", window: int | None = None, num_kv_heads: int | None = None
    ) -> None:
        super().__init__()
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"attention window={window!r} is invalid: expected None or an integer >= 1")
        if num_kv_heads is not None and (
            isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads < 1
            or config.num_heads % num_kv_heads
        ):
            raise ValueError(
                f"attention num_kv_heads={num_kv_heads!r} is invalid: expected None (the config's "
                f"{config.num_kv_heads}) or a divisor of num_heads={config.num_heads} (1 = multi-query attention)"
            )
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads if num_kv_heads is None else num_kv_heads
        self.head_dim = config.head_dim
        self.window = window
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.Wqkv = Linear(config.hidden_size, qkv_out, bias=config.bias)
        self.proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.bias)
        self.has_qk_bias = config.qk_bias
        if config.qk_bias:
            if self.num_kv_heads == self.num_heads:
                self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.num_heads, self.head_dim))
            else:
                self.q_bias = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))
                self.k_bias = nn.Parameter(torch.zeros(self.num_kv_heads, self.head_dim))

    def qkv(self, x: Tensor, ctx: MixerContext) -> tuple[Tensor, Tensor, Tensor]:
        """Project and rotate: q [B, T, H, D], k and v [B, T, Hkv, D]."""
        B, T, _ = x.shape
        D = self.head_dim
        q, k, v = self.Wqkv(x).split(
            [self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D], dim=-1
        )
        q = q.view(B, T, self.num_heads, D)
        k = k.view(B, T, self.num_kv_heads, D)
        v = v.view(B, T, self.num_kv_heads, D)
        if self.has_qk_bias:
            if self.num_kv_heads == self.num_heads:
                q, k = q + self.qk_bias[0], k + self.qk_bias[1]
            else:
                q, k = q + self.q_bias, k + self.k_bias
        cos, sin = ctx.rope(D)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, ctx: MixerContext, layer_key: LayerKey) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x, ctx)
        if ctx.cache is not None:
            k, v = ctx.cache.update_kv(layer_key, k, v, ctx)  # [B, T_past + T, Hkv, D]
        mask, is_causal = ctx.attn_mask, ctx.is_causal
        if self.window is not None:
            mask, is_causal = window_mask(ctx, k.shape[1], self.window), False
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [B, H, T, D]
            attn_mask=mask, is_causal=is_causal, enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return self.proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def state_nbytes(self, batch: int, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
        """KV cache of one layer after `seq_len` tokens: 2 * Hkv * D elements per token."""
        return 2 * batch * seq_len * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


def window_mask(ctx: MixerContext, kv_len: int, window: int) -> Tensor:
    """The call's mask further limited to the last `window` keys: [B, 1, T, kv_len] bool."""
    T = ctx.positions.shape[1]
    q_idx = torch.arange(ctx.past_len, ctx.past_len + T, device=ctx.positions.device)[:, None]
    k_idx = torch.arange(kv_len, device=ctx.positions.device)[None, :]
    allowed = (k_idx <= q_idx) & (k_idx > q_idx - window)  # [T, kv_len]
    if ctx.attn_mask is not None:
        return ctx.attn_mask & allowed
    return allowed[None, None]
