"""Native Sparse Attention (NSA, arXiv 2502.11089): three branches mixed by learned gates.

    o_t = g_cmp(t) Attn(q_t, compressed KV) + g_slc(t) Attn(q_t, selected blocks) + g_win(t) Attn(q_t, window)

with g = sigmoid(g_proj x) per token and head. As flash-linear-attention's simplification:
- compression: mean pooling over non-overlapping blocks of `block_size` keys; compressed block c
  is visible to a query at position p once complete, (c + 1) * block_size - 1 <= p;
- selection: blocks ranked by the compressed-attention probabilities summed over the query heads
  of a KV group (one choice per group, so GQA shares it); block 0, the query's own block and the
  previous block are always taken, the rest of the `block_counts` by rank; the query then
  attends causally to every token of the chosen blocks;
- window: causal attention over the last `window` positions.

Blocks and windows follow token positions counted without padding, so a left-padded row equals
the same row alone. With `block_counts` covering every block, the selection branch is dense
causal attention. Cache: the full KV (`update_kv`, 2 H_kv d elements per token); the compressed
KV is recomputed from it. This CPU implementation applies the sparse patterns as masks over
dense score matrices: it defines the semantics, not the sparse kernel's speed.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recurrent_depth.config import ModelConfig
from recurrent_depth.model.layers import apply_rope
from recurrent_depth.model.mixers.base import LayerKey, MixerContext, register_mixer
from recurrent_depth.model.mixers.common import (
    allowed_keys,
    check_int,
    key_positions,
    masked_attention,
    nbytes,
    or_default,
)


def nsa_branches(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor,
    key_pos: Tensor,
    key_valid: Tensor,
    block_size: int,
    block_counts: int,
    window: int,
    probs: list[Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The three branch outputs, each [B, H, T, D].

    q: [B, H, T, D]; k, v: [B, Hkv, S, D] (the T queries are the last T keys); allowed:
    [B or 1, 1, T, S] causal/padding mask; key_pos, key_valid: [B or 1, S] positions (padding
    not counted) and real-key flags. probs (`output_attentions`): a list that gets each branch's
    weights over the S raw keys, [B, H, T, S], with branch output = weights @ v (the compressed
    branch's block probability spread evenly over the block's real keys, as its mean-pooled value).
    """
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    scale = D**-0.5
    query_pos = key_pos[:, S - T :]  # [B|1, T]
    key_pos, key_valid = key_pos.expand(B, S), key_valid.expand(B, S)

    # Compression: mean of each complete block of real keys.
    num_blocks = -(-S // block_size)
    block_of = key_pos // block_size  # [B, S]
    member = (block_of[..., None] == torch.arange(num_blocks, device=q.device)) & key_valid[..., None]  # [B, S, Nb]
    counts = member.sum(1).clamp(min=1)  # [B, Nb]
    pool = member.to(k.dtype) / counts[:, None].to(k.dtype)
    k_cmp = torch.einsum("bsn,bhsd->bhnd", pool, k)  # [B, Hkv, Nb, D]
    v_cmp = torch.einsum("bsn,bhsd->bhnd", pool, v)
    block_end = (torch.arange(num_blocks, device=q.device) + 1) * block_size - 1
    cmp_visible = (block_end <= query_pos[..., None])[:, None]  # [B|1, 1, T, Nb]
    o_cmp, p_cmp = masked_attention(q, k_cmp.repeat_interleave(G, 1), v_cmp.repeat_interleave(G, 1),
                                    cmp_visible, scale)

    # Selection: rank blocks per KV group; forced blocks first, future blocks never.
    importance = p_cmp.view(B, Hkv, G, T, num_blocks).sum(2)  # [B, Hkv, T, Nb]
    own = (query_pos // block_size)[:, None, :, None]  # [B|1, 1, T, 1]
    blocks = torch.arange(num_blocks, device=q.device)
    forced = (blocks == 0) | (blocks == own) | (blocks == own - 1)
    rank = importance.masked_fill(forced, float("inf")).masked_fill(blocks > own, float("-inf"))
    top = rank.topk(min(block_counts, num_blocks), dim=-1).indices
    chosen = torch.zeros_like(rank, dtype=torch.bool).scatter(-1, top, True) & (rank > float("-inf"))
    chosen = chosen | (forced & (blocks <= own))  # forced blocks beyond block_counts still count
    token_chosen = chosen.gather(-1, block_of[:, None, None, :].expand(B, Hkv, T, S))  # [B, Hkv, T, S]
    slc_mask = (token_chosen & allowed).repeat_interleave(G, 1)
    kh, vh = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    o_slc, p_slc = masked_attention(q, kh, vh, slc_mask, scale)

    # Sliding window over positions.
    recent = (query_pos[:, :, None] - key_pos[:, None, :]) < window  # [B, T, S]
    o_win, p_win = masked_attention(q, kh, vh, allowed & recent[:, None], scale)
    if probs is not None:
        probs.extend([torch.einsum("bhtn,bsn->bhts", p_cmp.to(pool.dtype), pool), p_slc, p_win])
    return o_cmp, o_slc, o_win


@register_mixer("nsa")
class NativeSparseAttention(nn.Module):
    mixer_name = "nsa"
    # `MIXER_CONFIG_OPTIONS` (base.py) it implements: kv heads and rope_scaling; it rotates interleaved pairs, scales
    # by head_dim^-1/2 and has bias-free projections
    config_options = frozenset({"num_kv_heads", "rope_scaling"})

    def __init__(
        self,
        config: ModelConfig,
        part: str = "core",
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        block_size: int = 64,
        block_counts: int = 16,
        window: int = 512,
    ) -> None:
        super().__init__()
        name = self.mixer_name
        self.num_heads = H = check_int(name, "num_heads", or_default(num_heads, config.num_heads))
        self.num_kv_heads = Hkv = check_int(name, "num_kv_heads", or_default(num_kv_heads, config.num_kv_heads))
        if H % Hkv:
            raise ValueError(f"{name} option num_kv_heads={Hkv} is invalid: expected a divisor of num_heads={H}")
        self.head_dim = D = check_int(name, "head_dim", or_default(head_dim, config.head_dim))
        if D % 2:
            raise ValueError(f"{name} option head_dim={D} is invalid: expected an even number (RoPE)")
        self.block_size = check_int(name, "block_size", block_size)
        self.block_counts = check_int(name, "block_counts", block_counts)
        self.window = check_int(name, "window", window)
        h = config.hidden_size
        self.q_proj = nn.Linear(h, H * D, bias=False)
        self.k_proj = nn.Linear(h, Hkv * D, bias=False)
        self.v_proj = nn.Linear(h, Hkv * D, bias=False)
        self.g_proj = nn.Linear(h, 3 * H, bias=False)
        self.proj = nn.Linear(H * D, h, bias=config.bias)

    def branches(
        self, x: Tensor, ctx: MixerContext, layer_key: LayerKey, probs: list[Tensor] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(o_cmp, o_slc, o_win), each [B, H, T, D], with the cache updated (probs: see `nsa_branches`)."""
        B, T, _ = x.shape
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = ctx.rope(D)
        q = apply_rope(self.q_proj(x).view(B, T, H, D), cos, sin)
        k = apply_rope(self.k_proj(x).view(B, T, Hkv, D), cos, sin)
        v = self.v_proj(x).view(B, T, Hkv, D)
        if ctx.cache is not None:
            k, v = ctx.cache.update_kv(layer_key, k, v, ctx)  # [B, S, Hkv, D]
        S = k.shape[1]
        allowed = allowed_keys(ctx, T, S, x.device)
        key_pos = key_positions(ctx, S, x.device)
        valid = ctx.key_valid if ctx.key_valid is not None else torch.ones(1, S, dtype=torch.bool, device=x.device)
        return nsa_branches(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), allowed, key_pos, valid,
                            self.block_size, self.block_counts, self.window, probs)

    def forward(self, x: Tensor, ctx: MixerContext, layer_key: LayerKey) -> Tensor:
        B, T, _ = x.shape
        probs = [] if ctx.attentions is not None else None
        o_cmp, o_slc, o_win = self.branches(x, ctx, layer_key, probs)
        g = self.g_proj(x).sigmoid().view(B, T, self.num_heads, 3).permute(3, 0, 2, 1)[..., None]  # [3, B, H, T, 1]
        o = g[0] * o_cmp + g[1] * o_slc + g[2] * o_win  # [B, H, T, D]
        if probs is not None:  # output_attentions: the gated sum of the branches' weights, o = weights @ v
            ctx.attentions[layer_key] = sum(gate * p.to(o.dtype) for gate, p in zip(g, probs, strict=True))
        return self.proj(o.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def state_nbytes(self, batch: int, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
        """The full KV cache: 2 H_kv d elements per token (selection needs the raw keys)."""
        return nbytes(2 * batch * seq_len * self.num_kv_heads * self.head_dim, dtype)
