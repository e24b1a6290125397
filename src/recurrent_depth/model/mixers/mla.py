"""Multi-head latent attention (MLA, DeepSeek-V2/V3): a compressed latent KV cache.

    c_kv = RMSNorm(W_DKV x)            [B, T, d_c]   the only per-token cache, with
    k_R  = RoPE(W_KR x)                [B, T, d_R]   one decoupled rotary key shared by all heads
    k_h  = [W_UK,h c_kv ; k_R]         v_h = W_UV,h c_kv
    q_h  = [q_nope,h ; RoPE(q_rope,h)] from W_Q x (or W_UQ RMSNorm(W_DQ x) with a q-LoRA)
    score = (q_nope . k_nope + q_rope . k_R) / sqrt(d_nope + d_R)

Two ways to compute the same attention (`attn_impl`):
- "naive" (MHA mode, training and prefill): expand every cached latent to per-head K and V;
- "absorb" (MQA mode, decoding): fold W_UK into the query, q_lat,h = W_UK,h^T q_nope,h [d_c],
  attend once against [c_kv ; k_R] with values c_kv, then apply W_UV,h to the result.
- "auto" (default): naive for a call without cached tokens, absorb once a cache holds some.

Cache per token per layer: d_c + d_R elements (V3: 512 + 64), vs 2 H d_h for MHA. Decode work per
token: about 2 T H (2 d_c + d_R) in absorbed mode. The latent goes through the cache's `update_kv`
as (k = c_kv [B, T, 1, d_c], v = k_R [B, T, 1, d_R]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recurrent_depth.config import ModelConfig
from recurrent_depth.model.layers import apply_rope, model_norm
from recurrent_depth.model.mixers.attention import eager_attention
from recurrent_depth.model.mixers.base import LayerKey, MixerContext, register_mixer
from recurrent_depth.model.mixers.common import check_choice, check_int, nbytes, or_default
from recurrent_depth.model.mixers.logits import MaxLogitRecorder, scale_parameter

ATTN_IMPLS = ("auto", "naive", "absorb")


@register_mixer("mla")
class MultiHeadLatentAttention(MaxLogitRecorder, nn.Module):
    mixer_name = "mla"
    # `MIXER_CONFIG_OPTIONS` (base.py) it implements: its decoupled RoPE reads rope_scaling, but it rotates interleaved
    # pairs, scales by its own (d_nope + d_R)^-1/2, has one shared latent in place of kv heads and bias-free projections
    config_options = frozenset({"rope_scaling"})

    def __init__(
        self,
        config: ModelConfig,
        part: str = "core",
        num_heads: int | None = None,
        kv_lora_rank: int | None = None,
        q_lora_rank: int = 0,
        qk_nope_dim: int | None = None,
        qk_rope_dim: int | None = None,
        v_head_dim: int | None = None,
        attn_impl: str = "auto",
    ) -> None:
        super().__init__()
        name, hd = self.mixer_name, config.head_dim
        self.num_heads = H = check_int(name, "num_heads", or_default(num_heads, config.num_heads))
        self.kv_lora_rank = check_int(name, "kv_lora_rank", or_default(kv_lora_rank, 4 * hd))
        self.q_lora_rank = check_int(name, "q_lora_rank", q_lora_rank, low=0)
        self.qk_nope_dim = check_int(name, "qk_nope_dim", or_default(qk_nope_dim, hd))
        self.qk_rope_dim = check_int(name, "qk_rope_dim", or_default(qk_rope_dim, max(2, hd // 2 // 2 * 2)))
        if self.qk_rope_dim % 2:
            raise ValueError(f"{name} option qk_rope_dim={self.qk_rope_dim} is invalid: expected an even number "
                             "(rotary embedding rotates pairs)")
        self.v_head_dim = check_int(name, "v_head_dim", or_default(v_head_dim, hd))
        self.attn_impl = check_choice(name, "attn_impl", attn_impl, ATTN_IMPLS)
        self.scale = (self.qk_nope_dim + self.qk_rope_dim) ** -0.5
        h = config.hidden_size
        q_out = H * (self.qk_nope_dim + self.qk_rope_dim)
        if self.q_lora_rank:
            self.wq_a = nn.Linear(h, self.q_lora_rank, bias=False)
            self.q_norm = model_norm(config, self.q_lora_rank)
            self.wq_b = nn.Linear(self.q_lora_rank, q_out, bias=False)
        else:
            self.wq = nn.Linear(h, q_out, bias=False)
        self.wkv_a = nn.Linear(h, self.kv_lora_rank + self.qk_rope_dim, bias=False)
        self.kv_norm = model_norm(config, self.kv_lora_rank)
        self.wkv_b = nn.Linear(self.kv_lora_rank, H * (self.qk_nope_dim + self.v_head_dim), bias=False)
        self.proj = nn.Linear(H * self.v_head_dim, h, bias=config.bias)

    # ------------------------------------------------------------------ pieces
    def query_latent(self, x: Tensor) -> Tensor:
        """The input of the query up-projection: x, or RMSNorm(W_DQ x) with a q-LoRA."""
        return self.q_norm(self.wq_a(x)) if self.q_lora_rank else x

    def project(self, x: Tensor, ctx: MixerContext) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """q_nope [B, T, H, d_nope], q_rope [B, T, H, d_R] (rotated), c_kv [B, T, d_c], k_rope [B, T, d_R]."""
        B, T, _ = x.shape
        wq = self.wq_b if self.q_lora_rank else self.wq
        q = wq(self.query_latent(x)).view(B, T, self.num_heads, self.qk_nope_dim + self.qk_rope_dim)
        q_nope, q_rope = q.split([self.qk_nope_dim, self.qk_rope_dim], dim=-1)
        c_kv, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_dim], dim=-1)
        cos, sin = ctx.rope(self.qk_rope_dim)
        q_rope = apply_rope(q_rope, cos, sin)
        k_rope = apply_rope(k_rope[:, :, None], cos, sin)[:, :, 0]
        return q_nope, q_rope, self.kv_norm(c_kv), k_rope

    def up_weights(self) -> tuple[Tensor, Tensor]:
        """W_UK [H, d_nope, d_c] and W_UV [H, d_v, d_c], views of `wkv_b`."""
        w = self.wkv_b.weight.view(self.num_heads, self.qk_nope_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_dim], w[:, self.qk_nope_dim :]

    def attend(
        self,
        q_nope: Tensor,
        q_rope: Tensor,
        c_kv: Tensor,
        k_rope: Tensor,
        mask: Tensor | None,
        is_causal: bool,
        impl: str,
        weights: dict[tuple, Tensor] | None = None,
        layer_key: LayerKey | None = None,
    ) -> Tensor:
        """Attention of T queries over S latents: -> [B, T, H, d_v]. mask: [B or 1, 1, T, S] bool or None.

        weights (`output_attentions`): a dict that gets the softmax probabilities [B, H, T, S] under
        `layer_key`, the attention then computed as plain math (`eager_attention`) instead of SDPA."""
        B, T, H, _ = q_nope.shape
        S = c_kv.shape[1]
        if impl == "naive":
            kv = self.wkv_b(c_kv).view(B, S, H, self.qk_nope_dim + self.v_head_dim)
            k_nope, v = kv.split([self.qk_nope_dim, self.v_head_dim], dim=-1)
            k = torch.cat([k_nope, k_rope[:, :, None].expand(B, S, H, self.qk_rope_dim)], dim=-1)
            q = torch.cat([q_nope, q_rope], dim=-1)
            if weights is not None:
                o, weights[layer_key] = eager_attention(q, k, v, mask, is_causal, self.scale)
                return o.transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [B, H, T|S, D]
                attn_mask=mask, is_causal=is_causal, scale=self.scale,
            )
            return o.transpose(1, 2)
        w_uk, w_uv = self.up_weights()
        q_lat = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)  # W_UK folded into the query
        q = torch.cat([q_lat, q_rope], dim=-1).transpose(1, 2)  # [B, H, T, d_c + d_R]
        k = torch.cat([c_kv, k_rope], dim=-1)[:, None]  # [B, 1, S, d_c + d_R]: one head for all
        if weights is not None:  # the same logits q_lat . c_kv + q_rope . k_R, so the same probabilities
            o_lat, weights[layer_key] = eager_attention(q.transpose(1, 2), k.transpose(1, 2), c_kv[:, :, None],
                                                        mask, is_causal, self.scale)
            return torch.einsum("bhtc,hvc->bthv", o_lat, w_uv)
        o_lat = F.scaled_dot_product_attention(
            q, k, c_kv[:, None], attn_mask=mask, is_causal=is_causal, scale=self.scale, enable_gqa=True
        )  # [B, H, T, d_c]
        return torch.einsum("bhtc,hvc->bthv", o_lat, w_uv)

    def resolve_impl(self, ctx: MixerContext) -> str:
        if self.attn_impl == "auto":
            return "absorb" if ctx.past_len > 0 else "naive"
        return self.attn_impl

    # ------------------------------------------------------------------ mixer interface
    def forward(self, x: Tensor, ctx: MixerContext, layer_key: LayerKey) -> Tensor:
        B, T, _ = x.shape
        q_nope, q_rope, c_kv, k_rope = self.project(x, ctx)
        if ctx.cache is not None:
            c_kv, k_rope = ctx.cache.update_kv(layer_key, c_kv[:, :, None], k_rope[:, :, None], ctx)
            c_kv, k_rope = c_kv[:, :, 0], k_rope[:, :, 0]  # [B, S, d_c], [B, S, d_R]
        if self.record_max_logit and self.training:
            self.observe_mla_logits(q_nope, q_rope, c_kv, k_rope, ctx)
        o = self.attend(q_nope, q_rope, c_kv, k_rope, ctx.attn_mask, ctx.is_causal, self.resolve_impl(ctx),
                        ctx.attentions, layer_key)
        return self.proj(o.reshape(B, T, self.num_heads * self.v_head_dim))

    def observe_mla_logits(self, q_nope: Tensor, q_rope: Tensor, c_kv: Tensor, k_rope: Tensor,
                           ctx: MixerContext) -> None:
        """Record the per-head max logit (QK-clip) from the per-head keys [W_UK,h c_kv ; k_R]."""
        B, S, H = c_kv.shape[0], c_kv.shape[1], self.num_heads
        with torch.no_grad():
            k_nope = self.wkv_b(c_kv).view(B, S, H, -1)[..., : self.qk_nope_dim]
            k = torch.cat([k_nope, k_rope[:, :, None].expand(B, S, H, self.qk_rope_dim)], dim=-1)
            self.observe_logits(torch.cat([q_nope, q_rope], dim=-1), k, self.scale, ctx.attn_mask, ctx.is_causal)

    @torch.no_grad()
    def clip_heads(self, gamma: Tensor) -> None:
        """QK-clip as Kimi K2 does for MLA: head h's content parts (q_nope,h rows of the query
        projection and k_nope,h rows of W_UK) by sqrt(gamma[h]), its rotary query rows by gamma[h];
        the rotary key k_R is shared by every head and stays as it is."""
        gamma = gamma.to(torch.float64)
        d_nope, d_rope, d_v = self.qk_nope_dim, self.qk_rope_dim, self.v_head_dim
        q_rows = torch.cat([gamma.sqrt()[:, None].expand(-1, d_nope), gamma[:, None].expand(-1, d_rope)], 1)
        wq = self.wq_b if self.q_lora_rank else self.wq
        scale_parameter(wq.weight, q_rows.reshape(-1, 1).expand(wq.weight.shape))
        ones = gamma.new_ones(len(gamma), d_v)
        kv_rows = torch.cat([gamma.sqrt()[:, None].expand(-1, d_nope), ones], 1)
        scale_parameter(self.wkv_b.weight, kv_rows.reshape(-1, 1).expand(self.wkv_b.weight.shape))

    def state_nbytes(self, batch: int, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
        """Latent cache of one layer: (d_c + d_R) elements per token."""
        return nbytes(batch * seq_len * (self.kv_lora_rank + self.qk_rope_dim), dtype)
