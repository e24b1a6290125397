"""The model pieces a generation loop calls, in two implementations with the same results.

`ModelRunner` is the plain reference: it calls the model's own `make_context`, `embed`,
`core_step` and `predict`. `FastRunner` computes the same functions for models whose blocks
are all plain softmax attention (the Huginn architecture), with far fewer tensor operations per
recurrence step, because at batch 1 decoding is bound by per-operation overhead, not FLOPs:

- the adapter `W [s; e]` is split into `W_s s + W_e e`; `W_e e` is computed once per token and
  reused by every step (the input injection does not change between steps);
- the q/k biases are folded into one bias vector and RoPE is one complex multiplication on q
  and k together, with angles looked up from a table built once;
- RMSNorm is `torch.nn.functional.rms_norm` (one fused call, same arithmetic as the model's).

Outputs agree with the reference to float rounding (tests compare both at odd sizes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from recurrent_depth.model.layers import rope_table
from recurrent_depth.model.mixers import MixerContext
from recurrent_depth.model.mixers.attention import Attention


@dataclass
class Step:
    """One model call's context: the model's `MixerContext` plus the fast path's rotary factors."""

    ctx: MixerContext
    freqs: Tensor | None = None  # complex [B, T, 1, D/2]


class ModelRunner:
    """Reference implementation: the model's own methods."""

    name = "reference"

    def __init__(self, model: Any) -> None:
        self.model = model
        cfg = model.config
        self.head_dim = cfg.head_dim
        self._table = rope_table(cfg.head_dim, cfg.max_seq_len, cfg.rope_base, model.device)  # [L, D/2, 2]

    def context(
        self, input_ids: Tensor, attention_mask: Tensor | None, cache: Any, position_ids: Tensor | None = None
    ) -> Step:
        ctx = self.model.make_context(input_ids, attention_mask, position_ids, cache)
        # Rotary factors from the table built once, instead of a fresh table per call.
        picked = self._table[ctx.positions]  # [B, T, D/2, 2]
        ctx._rope[self.head_dim] = (picked[..., 0].unsqueeze(2), picked[..., 1].unsqueeze(2))
        return Step(ctx)

    def embed(self, input_ids: Tensor, step: Step) -> Tensor:
        return self.model.embed(input_ids, step.ctx)

    def inject(self, e: Tensor) -> Tensor:
        """What every recurrence step of these positions needs from e (the reference: e itself)."""
        return e

    def core_step(self, state: Tensor, injected: Tensor, e: Tensor, index: int, step: Step) -> Tensor:
        return self.model.core_step(state, e, index, step.ctx)

    def predict(self, state: Tensor, step: Step, last_only: bool = False) -> Tensor:
        """Logits float32 from raw states `[B, T, h]`: `[B, T, V]`, or `[B, 1, V]` with last_only.

        The coda always runs on every position, because it writes the coda's KV cache.
        """
        model = self.model
        x = model.transformer.ln_f(state)
        for c, block in enumerate(model.transformer.coda):
            x = block(x, step.ctx, ("coda", c))
        if last_only:
            x = x[:, -1:]
        return model.lm_head(model.transformer.ln_f(x)).float()

    def initial_state(self, e: Tensor, init_scale: float, generator: torch.Generator | None) -> Tensor:
        return self.model.initial_state(e, init_scale, generator)


class FastRunner(ModelRunner):
    """Fused-operation implementation for all-attention models (see the module docstring)."""

    name = "fast"

    @staticmethod
    def supports(model: Any) -> bool:
        blocks = [*model.transformer.prelude, *model.transformer.core_block, *model.transformer.coda]
        return all(type(b.attn) is Attention and b.attn.window is None for b in blocks)

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        if not self.supports(model):
            raise ValueError("the fast runner needs every block to be plain softmax attention without a window")
        cfg = model.config
        t = model.transformer
        h = cfg.hidden_size
        self.H, self.Hkv, self.D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.norm_eps
        self.gqa = self.Hkv != self.H
        angles = self._table  # [L, D/2, 2] (cos, sin)
        self._freq_table = torch.complex(angles[..., 0], angles[..., 1])  # [L, D/2]
        self.blocks = {
            "prelude": [self._prepare(b) for b in t.prelude],
            "core": [self._prepare(b) for b in t.core_block],
            "coda": [self._prepare(b) for b in t.coda],
        }
        w = t.adapter.weight
        self.adapter_s = w[:, :h]
        self.adapter_e = w[:, h:]
        self.adapter_bias = t.adapter.bias
        self.ln_f = t.ln_f.weight
        self.wte = t.wte.weight
        self.lm_head = model.lm_head.weight
        self.emb_scale = model.emb_scale

    def _prepare(self, block: Any) -> dict[str, Any]:
        attn = block.attn
        H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
        bias = attn.Wqkv.bias
        if attn.has_qk_bias:
            qk = (
                torch.cat([attn.qk_bias[0].reshape(-1), attn.qk_bias[1].reshape(-1)])
                if Hkv == H
                else torch.cat([attn.q_bias.reshape(-1), attn.k_bias.reshape(-1)])
            )
            extra = torch.cat([qk, qk.new_zeros(Hkv * D)])
            bias = extra if bias is None else bias + extra
        return {
            "norm": [block.norm_1.weight, block.norm_2.weight, block.norm_3.weight, block.norm_4.weight],
            "qkv": attn.Wqkv.weight,
            "qkv_bias": bias,
            "proj": attn.proj.weight,
            "proj_bias": attn.proj.bias,
            "fc": block.mlp.fc.weight,
            "fc_bias": block.mlp.fc.bias,
            "out": block.mlp.proj.weight,
            "out_bias": block.mlp.proj.bias,
        }

    # ------------------------------------------------------------------ pieces
    def context(
        self, input_ids: Tensor, attention_mask: Tensor | None, cache: Any, position_ids: Tensor | None = None
    ) -> Step:
        step = super().context(input_ids, attention_mask, cache, position_ids)
        step.freqs = self._freq_table[step.ctx.positions].unsqueeze(2)  # [B, T, 1, D/2]
        return step

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def _block(self, x: Tensor, p: dict[str, Any], step: Step, key: tuple) -> Tensor:
        B, T, _ = x.shape
        H, Hkv, D = self.H, self.Hkv, self.D
        n1, n2, n3, n4 = p["norm"]
        qkv = F.linear(self._norm(x, n1), p["qkv"], p["qkv_bias"])  # [B, T, (H + 2 Hkv) D]
        qk = qkv[..., : (H + Hkv) * D].unflatten(-1, (H + Hkv, D // 2, 2))
        # Interleaved RoPE on q and k at once: pairs (x0, x1) as complex numbers times e^{i angle}.
        qk = torch.view_as_real(torch.view_as_complex(qk.float()) * step.freqs).flatten(-2).to(x.dtype)
        q, k = qk.split([H, Hkv], dim=2)  # [B, T, H, D], [B, T, Hkv, D]
        v = qkv[..., (H + Hkv) * D :].view(B, T, Hkv, D)
        ctx = step.ctx
        if ctx.cache is not None:
            k, v = ctx.cache.update_kv(key, k, v, ctx)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=ctx.attn_mask, is_causal=ctx.is_causal, enable_gqa=self.gqa,
        )  # [B, H, T, D]
        x = self._norm(x + F.linear(att.transpose(1, 2).reshape(B, T, H * D), p["proj"], p["proj_bias"]), n2)
        gate, up = F.linear(self._norm(x, n3), p["fc"], p["fc_bias"]).chunk(2, dim=-1)
        return self._norm(x + F.linear(F.silu(gate) * up, p["out"], p["out_bias"]), n4)

    def embed(self, input_ids: Tensor, step: Step) -> Tensor:
        x = F.embedding(input_ids, self.wte) * self.emb_scale
        for i, p in enumerate(self.blocks["prelude"]):
            x = self._block(x, p, step, ("prelude", i))
        return x

    def inject(self, e: Tensor) -> Tensor:
        return F.linear(e, self.adapter_e, self.adapter_bias)

    def core_step(self, state: Tensor, injected: Tensor, e: Tensor, index: int, step: Step) -> Tensor:
        x = torch.addmm(injected.flatten(0, 1), state.flatten(0, 1), self.adapter_s.t()).view_as(state)
        for j, p in enumerate(self.blocks["core"]):
            x = self._block(x, p, step, ("core", j, index))
        return x

    def predict(self, state: Tensor, step: Step, last_only: bool = False) -> Tensor:
        x = self._norm(state, self.ln_f)
        for c, p in enumerate(self.blocks["coda"]):
            x = self._block(x, p, step, ("coda", c))
        if last_only:
            x = x[:, -1:]
        return F.linear(self._norm(x, self.ln_f), self.lm_head).float()


def make_runner(model: Any, fast: bool = True) -> ModelRunner:
    """The fast runner when asked for and supported, else the reference."""
    if fast and FastRunner.supports(model):
        return FastRunner(model)
    return ModelRunner(model)
