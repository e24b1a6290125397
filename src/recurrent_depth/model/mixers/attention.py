"""Softmax attention as in Huginn: fused Wqkv, per-head q/k bias before interleaved RoPE, causal SDPA.

Grouped-query attention (`num_kv_heads < num_heads`; the config's value, or the mixer option
`num_kv_heads`, 1 = multi-query) and an optional sliding window are supported.
With `num_kv_heads == num_heads` the q/k bias is the checkpoint's single `qk_bias` [2, 1, H, D];
with GQA the two biases have different head counts and are stored as `q_bias` / `k_bias`.

`config.qk_norm` adds QK-norm (Qwen3's form): q and k are RMS-normalised over head_dim per head,
times a learnable gain of size head_dim shared by the heads (`q_norm.weight`, `k_norm.weight`),
after the projection and q/k bias and before RoPE. RoPE is a rotation, so every scaled logit
q.k / sqrt(D) is then at most max|g_q| * max|g_k| * sqrt(D). Off by default (Huginn has none).
`config.qk_norm_eps` sets the norm's epsilon (default `norm_eps`). Parcae normalises after RoPE without a
gain: the same thing, since RoPE keeps each head's norm (its models load with gains of one).
`config.qk_norm_per_head` gives each head its own gain (`q_norm.weight` [H, D], `k_norm.weight`
[Hkv, D]), so that QK-clip can rescale one head without touching the others.

The logits are q.k times `config.attention_scale`: 1/sqrt(D) (Huginn), or muP's sqrt(D_0)/D
(`attn_scale: "1/d"`, the default under `mup_base_width`), or 1/sqrt(query_pre_attn_scalar) (Gemma 2 / 3). SDPA
takes it as `scale=`; a quantized cache, whose kernels apply 1/sqrt(D), gets q pre-multiplied by the ratio (its
scores are linear in q). `config.attn_logit_softcapping` (Gemma 2) caps the scaled logits, cap * tanh(x / cap), before
the mask: such a layer attends as plain math (`eager_attention`), over a quantized cache's decoded columns; so does
every layer under `config.eager_attention` (retrofitted Gemma 2, whose transformers code never uses SDPA).
A layer's own RoPE base (`config.layer_rope_bases`, set by the model as `rope_base`) replaces the config's.

For QK-clip (`recurrent_depth.train.qk_clip`) the mixer can record, during training forwards,
the per-head maximum of its pre-softmax logits (`record_max_logit`), and rescale its heads
(`clip_heads`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recurrent_depth.config import MAX_SEQ_LEN, VALUE_GATE_CHANNELS, ModelConfig
from recurrent_depth.model.cache import combine_key_mask
from recurrent_depth.model.layers import ROPE_STYLES, apply_rope_half_rounded, model_norm
from recurrent_depth.model.mixers.base import LayerKey, MixerContext, register_mixer
from recurrent_depth.model.mixers.common import key_positions, upcast
from recurrent_depth.model.mixers.logits import MaxLogitRecorder, scale_parameter


@register_mixer("attention")
class Attention(MaxLogitRecorder, nn.Module):
    # every option of `MIXER_CONFIG_OPTIONS` (base.py): the config's attention settings are this mixer's
    config_options = frozenset({"qk_norm", "layer_rope_bases", "attn_logit_softcapping", "query_pre_attn_scalar",
                                "attn_scale", "rope_style", "rope_scaling", "num_kv_heads", "qkv_bias",
                                "eager_attention"})

    def __init__(
        self, config: ModelConfig, part: str = "core", window: int | None = None, num_kv_heads: int | None = None
    ) -> None:
        super().__init__()
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or not 1 <= window <= MAX_SEQ_LEN):
            raise ValueError(f"attention window={window!r} is invalid: expected None or an integer in "
                             f"[1, {MAX_SEQ_LEN}] (MAX_SEQ_LEN)")
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
        self.scale = config.attention_scale
        self.window = window
        self.softcap = config.attn_logit_softcapping  # cap * tanh(logits / cap) before the mask (Gemma 2): plain math
        # plain math for every call (transformers' Gemma 2 attends eagerly, capped or not), else SDPA where it can
        self.eager = config.eager_attention or self.softcap is not None
        self.logits_in_model_dtype = config.transformers_rounding  # that plain math as transformers' eager attention
        self.rope_base: float | None = None  # this layer's own unscaled RoPE base (layer_rope_bases), set by the model
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.Wqkv = nn.Linear(config.hidden_size, qkv_out, bias=config.bias or config.qkv_bias)
        self.rotate = apply_rope_half_rounded if config.transformers_rounding else ROPE_STYLES[config.rope_style]
        self.proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.bias)
        self.has_qk_bias = config.qk_bias
        if config.qk_bias:
            if self.num_kv_heads == self.num_heads:
                self.qk_bias = nn.Parameter(torch.zeros(2, 1, self.num_heads, self.head_dim))
            else:
                self.q_bias = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))
                self.k_bias = nn.Parameter(torch.zeros(self.num_kv_heads, self.head_dim))
        self.q_norm = self.k_norm = None
        self.qk_norm_full_width = config.qk_norm_full_width
        eps = config.norm_eps if config.qk_norm_eps is None else config.qk_norm_eps
        if config.qk_norm_full_width:  # OLMo-2: one norm over the concatenated heads
            self.q_norm = model_norm(config, self.num_heads * self.head_dim, eps)
            self.k_norm = model_norm(config, self.num_kv_heads * self.head_dim, eps)
        elif config.qk_norm:
            per_head = config.qk_norm_per_head
            self.q_norm = model_norm(config, self.head_dim, eps, self.num_heads if per_head else None)
            self.k_norm = model_norm(config, self.head_dim, eps, self.num_kv_heads if per_head else None)
        self.value_embed: nn.Embedding | None = None
        self.ve_gate: nn.Linear | None = None

    def add_value_embedding(self, vocab_size: int) -> None:
        """Give this layer a value embedding (`ModelConfig.value_embeddings`, nanochat's, in Parcae):
        v += 2 sigmoid(ve_gate(x[..., :32])) * value_embed(token) per kv head, x the layer's input."""
        self.value_embed = nn.Embedding(vocab_size, self.num_kv_heads * self.head_dim)
        self.ve_gate = nn.Linear(VALUE_GATE_CHANNELS, self.num_kv_heads, bias=False)

    def qkv(self, x: Tensor, ctx: MixerContext) -> tuple[Tensor, Tensor, Tensor]:
        """Project and rotate: q [B, T, H, D], k and v [B, T, Hkv, D]."""
        B, T, _ = x.shape
        D = self.head_dim
        q, k, v = self.Wqkv(x).split(
            [self.num_heads * D, self.num_kv_heads * D, self.num_kv_heads * D], dim=-1
        )
        if self.qk_norm_full_width:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.num_heads, D)
        k = k.view(B, T, self.num_kv_heads, D)
        v = v.view(B, T, self.num_kv_heads, D)
        if self.value_embed is not None:
            if ctx.token_ids is None:
                raise ValueError("a layer with a value embedding needs the token ids (MixerContext.token_ids)")
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., :VALUE_GATE_CHANNELS]))  # [B, T, Hkv] in (0, 2)
            v = v + gate.unsqueeze(-1) * self.value_embed(ctx.token_ids).view(B, T, self.num_kv_heads, D)
        if self.has_qk_bias:
            if self.num_kv_heads == self.num_heads:
                q, k = q + self.qk_bias[0], k + self.qk_bias[1]
            else:
                q, k = q + self.q_bias, k + self.k_bias
        if self.q_norm is not None and not self.qk_norm_full_width:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = ctx.rope(D, self.rope_base)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin), v

    def forward(self, x: Tensor, ctx: MixerContext, layer_key: LayerKey) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(x, ctx)
        if ctx.cache is not None and self.window is None and not self.eager and ctx.cache.attends_from_codes:
            # a quantized cache scores the queries against its key codes (inference/kv_codec.py), at 1/sqrt(D)
            if ctx.attentions is not None:
                raise ValueError("output_attentions needs a float KV cache; this call's cache is quantized (kv_quant)")
            standard = self.head_dim**-0.5
            q_codes = q if self.scale == standard else q * (self.scale / standard)
            out = ctx.cache.attend(layer_key, q_codes.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   ctx.attn_mask, ctx.is_causal)  # [B, H, T, D]
            return self.proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))
        key_mask = None
        if ctx.cache is not None:
            k, v = ctx.cache.update_kv(layer_key, k, v, ctx)  # [B, T_past + T, Hkv, D]
            key_mask = ctx.cache.key_mask(layer_key)  # columns a lookup rule leaves out (None: all)
        mask, is_causal = ctx.attn_mask, ctx.is_causal
        if self.window is not None:
            mask, is_causal = window_mask(ctx, k.shape[1], self.window), False
        if key_mask is not None:
            mask, is_causal = combine_key_mask(mask, key_mask, T), False
        if self.record_max_logit and self.training:
            self.observe_logits(q, k, self.scale, mask, is_causal)
        if ctx.attentions is not None or self.eager:  # the weights, or soft-capped / eager_attention: plain math
            out, probs = eager_attention(q, k, v, mask, is_causal, self.scale, self.softcap,
                                         self.logits_in_model_dtype)
            if ctx.attentions is not None:
                ctx.attentions[layer_key] = probs
            return self.proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [B, H, T, D]
            attn_mask=mask, is_causal=is_causal, scale=self.scale, enable_gqa=self.num_kv_heads != self.num_heads,
        )
        return self.proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    @torch.no_grad()
    def clip_heads(self, gamma: Tensor) -> None:
        """Scale head h's logits by gamma[h] <= 1 (QK-clip): sqrt(gamma) on its q and on its k.

        Parameters touched: the q and k rows of `Wqkv` (and of its bias), the q/k bias; with GQA a
        key head serves several query heads, so the whole gamma goes on the query side. With
        QK-norm the weights cannot change the logits (the norm removes their scale): the gains are
        scaled instead, by the same rule head by head when each head has its own
        (`qk_norm_per_head`), else by the smallest gamma of the layer (one gain serves every head).
        A full-width QK-norm (`qk_norm_full_width`) has a gain per channel, so head h's channels of the
        gains take head h's factors; its q/k bias comes after the norm and is scaled with them.
        """
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        gamma = gamma.to(torch.float64)
        if self.q_norm is not None and self.q_norm.weight.ndim == 1 and not self.qk_norm_full_width:
            gamma = gamma.min().expand(H)
        q_heads, k_heads = (gamma.sqrt(), gamma.sqrt()) if Hkv == H else (gamma, gamma.new_ones(Hkv))
        if self.q_norm is not None:
            for norm, heads in ((self.q_norm, q_heads), (self.k_norm, k_heads)):
                if self.qk_norm_full_width:  # [H * D] gains: head h owns channels h*D .. (h+1)*D - 1
                    per_head = heads.repeat_interleave(D)
                else:
                    per_head = heads[:, None] if norm.weight.ndim == 2 else heads[:1]  # shared gain: all equal
                scale_parameter(norm.weight, per_head.expand(norm.weight.shape), 1.0 if norm.unit_offset else 0.0)
            if not self.qk_norm_full_width:  # (the bias is added before a per-head norm, which removes its scale)
                return
        else:
            q_rows, k_rows = q_heads.repeat_interleave(D), k_heads.repeat_interleave(D)
            rows = torch.cat([q_rows, k_rows, gamma.new_ones(Hkv * D)])  # [q | k | v] of Wqkv
            scale_parameter(self.Wqkv.weight, rows[:, None].expand(self.Wqkv.weight.shape))
            if self.Wqkv.bias is not None:
                scale_parameter(self.Wqkv.bias, rows)
        if self.has_qk_bias:
            if Hkv == H:
                both = torch.stack([q_heads, k_heads])[:, None, :, None]  # [2, 1, H, 1]
                scale_parameter(self.qk_bias, both.expand(self.qk_bias.shape))
            else:
                scale_parameter(self.q_bias, q_heads[:, None].expand(self.q_bias.shape))
                scale_parameter(self.k_bias, k_heads[:, None].expand(self.k_bias.shape))

    def state_nbytes(self, batch: int, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
        """KV cache of one layer after `seq_len` tokens: 2 * Hkv * D elements per token."""
        return 2 * batch * seq_len * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()


def eager_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float, softcap: float | None = None,
    logits_in_model_dtype: bool = False,
) -> tuple[Tensor, Tensor]:
    """SDPA's attention written out, for `output_attentions`: (out [B, H, T, D], probs [B, H, T, S]).

    q [B, T, H, D], k and v [B, S, Hkv, D] (query head h reads key head h // (H / Hkv), as SDPA's GQA);
    mask / is_causal as given to SDPA (bool, True = may attend; the causal flag with S == T). The
    logits and softmax are float32 (float64 in a float64 model); probs are cast to v's dtype and out = probs @ v.
    softcap: the logits become softcap * tanh(logits / softcap) before the mask (Gemma 2's soft-capping).
    logits_in_model_dtype (`ModelConfig.transformers_rounding`): the logits and their cap computed in q's dtype, each
    operation rounded to it, and only the softmax in float32, as transformers' eager attention (the same in float32).
    """
    group = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if not logits_in_model_dtype:
        q, k = upcast(q), upcast(k)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, H, T, S]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if mask is None and is_causal:
        T, S = logits.shape[-2:]
        mask = torch.ones(T, S, dtype=torch.bool, device=logits.device).tril()
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(upcast(logits), dim=-1).to(v.dtype)
    return torch.matmul(probs, v), probs


def window_mask(ctx: MixerContext, kv_len: int, window: int) -> Tensor:
    """The call's mask further limited to the last `window` keys: [B, 1, T, kv_len] bool (each row from its own
    column where rows sit at different columns, `ctx.query_columns`). Fewer than past_len + T keys: a cache that
    drops the columns no window reaches (`inference.cache`) returned the last kv_len columns."""
    T = ctx.positions.shape[1]
    if ctx.query_columns is None and kv_len < ctx.past_len + T:
        return window_mask(ctx, ctx.past_len + T, window)[..., ctx.past_len + T - kv_len:]
    k_idx = torch.arange(kv_len, device=ctx.positions.device)[None, :]
    if ctx.query_columns is not None:  # [B, T]: each row's own columns
        q_idx = ctx.query_columns[:, None, :, None]  # [B, 1, T, 1]
        allowed = (k_idx <= q_idx) & (k_idx > q_idx - window)  # [B, 1, T, kv_len]
        # (the call's mask hides each row's keys past its own column, as `allowed` does; a pool that holds each
        # row's recent columns returns fewer keys, counted from the row's first held one as query_columns are)
        return allowed if ctx.attn_mask is None or ctx.attn_mask.shape[-1] != kv_len else ctx.attn_mask & allowed
    q_idx = torch.arange(ctx.past_len, ctx.past_len + T, device=ctx.positions.device)[:, None]
    allowed = (k_idx <= q_idx) & (k_idx > q_idx - window)  # [T, kv_len]
    if ctx.key_valid is not None and ctx.key_valid.shape[-1] == kv_len:
        # the last `window` real tokens: hidden columns inside a row (a batch's rejected speculative drafts) are
        # not counted, as its positions do not count them (left padding alone gives the same as columns)
        pos = key_positions(ctx, kv_len, k_idx.device)  # [B, kv_len]
        recent = pos[:, ctx.past_len:, None] - pos[:, None, :] < window  # [B, T, kv_len]
        allowed = (k_idx <= q_idx) & recent[:, None]  # [B, 1, T, kv_len]
        return allowed if ctx.attn_mask is None else ctx.attn_mask & allowed
    if ctx.attn_mask is not None:
        return ctx.attn_mask & allowed
    return allowed[None, None]
