"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2-Exp): MLA restricted to top-k keys per query.

A lightning indexer scores every visible key s for query t,

    I[t, s] = sum_j w[t, j] * ReLU(q_I[t, j] . k_I[s])      (ReLU before the sum over heads)

with H_I indexer heads of dim d_I, one indexer key per token shared by all heads
(k_I = LayerNorm(W_k x)), w = W_w x / sqrt(H_I d_I), and RoPE on the first d_R dims of q_I and
k_I. The top-k keys of each query (shared by all attention heads: MLA runs in MQA mode) are the
only ones the main MLA attention sees. With topk >= T this is exactly dense MLA.

Training the indexer: with `indexer_loss=True` every call in grad mode records
KL(p_t || softmax(I_t)), where p_t is the main attention summed over heads and L1-normalised
(a fixed target), over all visible keys in the dense warm-up (`mode="dense"`: the main
attention ignores the indexer) or over the selected keys (`mode="sparse"`). The indexer
reads a detached input, so the KL trains only the indexer and the language-model loss only the
rest. `pop_indexer_loss(model)` returns the mean recorded KL and clears it;
`indexer_parameters(model)` lists what to train during the warm-up.

Cache per token per layer: the MLA latent (d_c + d_R) plus the indexer key d_I, through
`update_kv` as (k = [c_kv ; k_R], v = k_I). Decode: indexer O(T H_I d_I), attention over k keys.
This CPU implementation applies the selection as a mask over the dense score matrix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from recurrent_depth.config import ModelConfig
from recurrent_depth.model.layers import apply_rope
from recurrent_depth.model.mixers.base import LayerKey, MixerContext, register_mixer
from recurrent_depth.model.mixers.common import (
    allowed_keys,
    check_bool,
    check_choice,
    check_int,
    nbytes,
    or_default,
    upcast,
)
from recurrent_depth.model.mixers.mla import MultiHeadLatentAttention


@register_mixer("dsa")
class DeepSeekSparseAttention(MultiHeadLatentAttention):
    mixer_name = "dsa"

    def __init__(
        self, config: ModelConfig, part: str = "core", *, topk: int = 2048, index_heads: int = 4,
        index_dim: int | None = None, mode: str = "sparse", indexer_loss: bool = False, **mla_options: Any,
    ) -> None:
        """The indexer's options; `mla_options` are those of the MLA attention it restricts."""
        super().__init__(config, part, **mla_options)
        name = self.mixer_name
        self.topk = check_int(name, "topk", topk)
        self.index_heads = check_int(name, "index_heads", index_heads)
        self.index_dim = check_int(name, "index_dim", or_default(index_dim, 2 * self.qk_rope_dim))
        if self.index_dim < self.qk_rope_dim:
            raise ValueError(f"{name} option index_dim={self.index_dim} is invalid: expected >= qk_rope_dim="
                             f"{self.qk_rope_dim} (RoPE rotates the first qk_rope_dim indexer dims)")
        self.mode = check_choice(name, "mode", mode, ("sparse", "dense"))
        self.indexer_loss = check_bool(name, "indexer_loss", indexer_loss)
        h = config.hidden_size
        q_in = self.q_lora_rank or h
        self.indexer = nn.ModuleDict(
            dict(
                wq=nn.Linear(q_in, self.index_heads * self.index_dim, bias=False),
                wk=nn.Linear(h, self.index_dim, bias=False),
                k_norm=nn.LayerNorm(self.index_dim),
                weights=nn.Linear(h, self.index_heads, bias=False),
            )
        )
        self.indexer_losses: list[Tensor] = []

    # ------------------------------------------------------------------ indexer
    def _rope_prefix(self, x: Tensor, ctx: MixerContext) -> Tensor:
        """RoPE on the first d_R dims of x [B, T, n, d_I]."""
        cos, sin = ctx.rope(self.qk_rope_dim)
        return torch.cat([apply_rope(x[..., : self.qk_rope_dim], cos, sin), x[..., self.qk_rope_dim :]], dim=-1)

    def index_key(self, x: Tensor, ctx: MixerContext) -> Tensor:
        """k_I [B, T, d_I] (from a detached input: the indexer learns from its own loss only)."""
        x = x.detach()
        k = self.indexer["k_norm"](self.indexer["wk"](x))
        return self._rope_prefix(k[:, :, None], ctx)[:, :, 0]

    def index_scores(self, x: Tensor, ctx: MixerContext, k_index: Tensor) -> Tensor:
        """I [B, T, S] for T queries over S indexer keys."""
        B, T, _ = x.shape
        q_in = self.query_latent(x).detach()
        x = x.detach()
        q = self.indexer["wq"](q_in).view(B, T, self.index_heads, self.index_dim)
        q = self._rope_prefix(q, ctx)
        w = self.indexer["weights"](x) * (self.index_heads * self.index_dim) ** -0.5  # [B, T, H_I]
        per_head = torch.relu(torch.einsum("bthd,bsd->bths", q, k_index))  # ReLU before the head sum
        return torch.einsum("bth,bths->bts", w, per_head)

    def select(self, scores: Tensor, allowed: Tensor) -> Tensor:
        """[B, 1, T, S] bool: the top-k allowed keys of each query (all of them when fewer than k).

        Equal scores are common (a key whose indexer dot products are all negative scores exactly 0
        after the ReLU). Ties go to the most recent key, a rule that depends only on the order of
        the real keys, so the choice is the same in a full forward, a cached decode and a padded row
        (`topk` breaks ties by memory layout, which differs between those).
        """
        allowed = allowed[:, 0].expand(scores.shape)
        masked = scores.masked_fill(~allowed, float("-inf"))
        S = scores.shape[-1]
        k = min(self.topk, S)
        order = masked.flip(-1).sort(dim=-1, descending=True, stable=True).indices[..., :k]
        idx = S - 1 - order
        chosen = torch.zeros_like(allowed).scatter(-1, idx, True)
        return (chosen & allowed)[:, None]

    # ------------------------------------------------------------------ mixer interface
    def forward(self, x: Tensor, ctx: MixerContext, layer_key: LayerKey) -> Tensor:
        B, T, _ = x.shape
        q_nope, q_rope, c_kv, k_rope = self.project(x, ctx)
        k_index = self.index_key(x, ctx)
        if ctx.cache is not None:
            latent, k_index = ctx.cache.update_kv(
                layer_key, torch.cat([c_kv, k_rope], dim=-1)[:, :, None], k_index[:, :, None].to(c_kv.dtype), ctx
            )
            c_kv, k_rope = latent[:, :, 0].split([self.kv_lora_rank, self.qk_rope_dim], dim=-1)
            k_index = k_index[:, :, 0]
        S = c_kv.shape[1]
        allowed = allowed_keys(ctx, T, S, x.device)
        need_scores = self.mode == "sparse" or self.recording_loss()
        scores = self.index_scores(x, ctx, k_index.to(x.dtype)) if need_scores else None
        if self.mode == "sparse":
            selected = self.select(scores, allowed)
            o = self.attend(q_nope, q_rope, c_kv, k_rope, selected, False, self.resolve_impl(ctx),
                            ctx.attentions, layer_key)  # (weights: 0 off the selected keys)
        else:
            selected = None
            o = self.attend(q_nope, q_rope, c_kv, k_rope, ctx.attn_mask, ctx.is_causal, self.resolve_impl(ctx),
                            ctx.attentions, layer_key)
        if self.recording_loss():
            kl = self.kl_to_attention(q_nope, q_rope, c_kv, k_rope, scores, allowed, selected, ctx)
            # Backward recomputing a checkpointed step (graph task id != -1) runs the same ops,
            # but must not record the term a second time, after the caller has popped it.
            if torch._C._current_graph_task_id() == -1:
                self.indexer_losses.append(kl)
        return self.proj(o.reshape(B, T, self.num_heads * self.v_head_dim))

    def recording_loss(self) -> bool:
        return self.indexer_loss and torch.is_grad_enabled()

    def kl_to_attention(
        self, q_nope: Tensor, q_rope: Tensor, c_kv: Tensor, k_rope: Tensor, scores: Tensor, allowed: Tensor,
        selected: Tensor | None, ctx: MixerContext,
    ) -> Tensor:
        """Mean over real queries of KL(p_t || softmax(I_t)) on the dense (or selected) key set."""
        support = (allowed if selected is None else selected)[:, 0].expand(scores.shape)  # [B, T, S]
        with torch.no_grad():
            w_uk, _ = self.up_weights()
            q_lat = torch.einsum("bthn,hnc->bthc", q_nope, w_uk)
            logits = (torch.einsum("bthc,bsc->bhts", q_lat, c_kv) + torch.einsum("bthr,bsr->bhts", q_rope, k_rope))
            probs = (upcast(logits) * self.scale).masked_fill(~support[:, None], float("-inf")).softmax(-1)
            target = probs.sum(1)
            target = target / target.sum(-1, keepdim=True)  # [B, T, S]
        log_q = upcast(scores).masked_fill(~support, float("-inf")).log_softmax(-1)
        terms = torch.where(support & (target > 0), target * (target.clamp_min(1e-30).log() - log_q), 0.0)
        kl = terms.sum(-1)  # [B, T]
        T = kl.shape[1]
        if ctx.key_valid is not None:
            real = ctx.key_valid[:, ctx.past_len : ctx.past_len + T].to(kl.dtype)
            return (kl * real).sum() / real.sum().clamp_min(1)
        return kl.mean()

    def state_nbytes(self, batch: int, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
        """Latent (d_c + d_R) plus indexer key (d_I) elements per token."""
        return nbytes(batch * seq_len * (self.kv_lora_rank + self.qk_rope_dim + self.index_dim), dtype)


def pop_indexer_loss(model: nn.Module) -> Tensor | None:
    """Mean of the indexer KL terms recorded by every DSA layer since the last call; clears them."""
    terms: list[Tensor] = []
    for module in model.modules():
        if isinstance(module, DeepSeekSparseAttention):
            terms.extend(module.indexer_losses)
            module.indexer_losses = []
    return torch.stack(terms).mean() if terms else None


def indexer_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The indexers' parameters (train only these during the dense warm-up)."""
    return [p for m in model.modules() if isinstance(m, DeepSeekSparseAttention) for p in m.indexer.parameters()]
