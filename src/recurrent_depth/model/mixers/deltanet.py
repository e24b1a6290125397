"""DeltaNet and Gated DeltaNet: linear attention whose state is corrected, not only accumulated.

    DeltaNet        S_t = (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    Gated DeltaNet  S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (q_t / sqrt(K))

Parameterised as flash-linear-attention's layers: q, k, v through a causal short convolution
(size 4) and SiLU; q and k L2-normalised (unit keys keep I - beta k k^T contractive);
beta = sigmoid(b_proj x); Gated DeltaNet's log decay g = log alpha = -exp(A_log) softplus(a_proj x
+ dt_bias) (Mamba-2 style: A ~ U(0, 16), dt ~ logU[1e-3, 0.1]); output per-head RMSNorm, times
SiLU(g_proj x) with the output gate; then `proj`.

Decode state per layer: S [B, H, K, V] plus the convolution's last W-1 inputs [B, W-1, 2HK+HV];
constant in T, O(H K V) work per token. A padded token has beta = 0 and g = 0 and its conv input
is zeroed, so it changes neither state.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recurrent_depth.config import ModelConfig
from recurrent_depth.model.mixers.base import register_mixer
from recurrent_depth.model.mixers.common import (
    GatedRMSNorm,
    RecurrentMixer,
    ShortConv,
    check_bool,
    check_int,
    check_power_of_two,
    l2norm,
    mamba_decay_init,
    nbytes,
    or_default,
    padding_after_state,
    state_dtype,
    upcast,
    zero_padded,
)
from recurrent_depth.ops.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule
from recurrent_depth.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


class DeltaRuleMixer(RecurrentMixer):
    """Projections, short convolution, beta (and decay) shared by DeltaNet and Gated DeltaNet."""

    gated = False

    def __init__(
        self, config: ModelConfig, part: str = "core", *, expand_v: int = 1, use_short_conv: bool = True,
        conv_size: int = 4, use_output_gate: bool | None = None, chunk_size: int = 64, **shared: Any,
    ) -> None:
        super().__init__(config, part, **shared)
        name, H = self.mixer_name, self.num_heads
        self.key_dim = K = self.head_dim
        self.value_dim = V = K * check_int(name, "expand_v", expand_v)
        self.use_short_conv = check_bool(name, "use_short_conv", use_short_conv)
        self.conv_size = check_int(name, "conv_size", conv_size, 2, 16)
        self.use_output_gate = check_bool(name, "use_output_gate", or_default(use_output_gate, self.gated))
        self.chunk_size = check_power_of_two(name, "chunk_size", chunk_size)
        h = config.hidden_size
        self.q_proj = nn.Linear(h, H * K, bias=False)
        self.k_proj = nn.Linear(h, H * K, bias=False)
        self.v_proj = nn.Linear(h, H * V, bias=False)
        self.b_proj = nn.Linear(h, H, bias=False)
        self.conv = ShortConv(2 * H * K + H * V, self.conv_size) if self.use_short_conv else None
        if self.gated:
            self.a_proj = nn.Linear(h, H, bias=False)
            A_log, dt_bias = mamba_decay_init(H, (0.0, 16.0))
            self.A_log = nn.Parameter(A_log)
            self.dt_bias = nn.Parameter(dt_bias)
            self.A_log._no_weight_decay = True
            self.dt_bias._no_weight_decay = True
        self.g_proj = nn.Linear(h, H * V, bias=False) if self.use_output_gate else None
        self.o_norm = GatedRMSNorm(V, config.norm_eps)
        self.proj = nn.Linear(H * V, h, bias=config.bias)
        self.add_extra_modules(config)

    def add_extra_modules(self, config: ModelConfig) -> None:
        """A subclass's own modules, created after the shared ones (so their initialisation follows theirs)."""

    def features(self, x: Tensor, valid: Tensor | None, conv_state: Tensor | None) -> tuple[Tensor, ...]:
        """q, k [B, T, H, K] (unit norm), v [B, T, H, V], beta [B, T, H], g [B, T, H] or None, conv state."""
        B, T, _ = x.shape
        H, K, V = self.num_heads, self.key_dim, self.value_dim
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        if self.conv is not None:
            qkv, conv_state = self.conv(*padding_after_state(qkv, valid, conv_state))
            q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
        else:
            q, k, v = qkv.split([H * K, H * K, H * V], dim=-1)
            q, k = F.silu(q), F.silu(k)
        q, k = l2norm(q.view(B, T, H, K)), l2norm(k.view(B, T, H, K))
        beta = zero_padded(self.b_proj(x).sigmoid(), valid)
        g = None
        if self.gated:
            g = -upcast(self.A_log).exp() * F.softplus(upcast(self.a_proj(x)) + self.dt_bias)
            g = zero_padded(g, valid)
        return q, k, v.view(B, T, H, V), beta, g, conv_state

    def mix(self, x: Tensor, valid: Tensor | None, state: Any, want_state: bool) -> tuple[Tensor, Any]:
        B, T, _ = x.shape
        state = state or {}
        q, k, v, beta, g, conv_state = self.features(x, valid, state.get("conv"))
        o, final = self.kernel(x, q, k, v, beta, g, state.get("recurrent"), want_state, self.use_chunk(T))
        gate = self.g_proj(x).view(B, T, self.num_heads, self.value_dim) if self.g_proj is not None else None
        o = self.o_norm(o, gate)
        new_state = {"recurrent": final}
        if self.conv is not None:
            new_state["conv"] = conv_state
        return self.proj(o.reshape(B, T, -1)), new_state

    def kernel(self, x, q, k, v, beta, g, initial_state, want_state: bool, chunk: bool) -> tuple[Tensor, Any]:
        """The op: (o [B, T, H, V], final state). `x` is the layer input, for subclasses' extra gates."""
        if chunk:
            return chunk_delta_rule(q, k, v, beta.to(q.dtype), initial_state=initial_state,
                                    output_final_state=want_state, chunk_size=self.chunk_size)
        return fused_recurrent_delta_rule(q, k, v, beta.to(q.dtype), initial_state=initial_state,
                                          output_final_state=want_state)

    def state_nbytes(self, batch: int, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
        H, K, V = self.num_heads, self.key_dim, self.value_dim
        total = nbytes(batch * H * K * V, state_dtype(dtype))
        if self.conv is not None:
            total += nbytes(batch * (self.conv_size - 1) * (2 * H * K + H * V), dtype)
        return total


@register_mixer("deltanet")
class DeltaNet(DeltaRuleMixer):
    mixer_name = "deltanet"
    gated = False


@register_mixer("gated_deltanet")
class GatedDeltaNet(DeltaRuleMixer):
    mixer_name = "gated_deltanet"
    gated = True

    def kernel(self, x, q, k, v, beta, g, initial_state, want_state: bool, chunk: bool) -> tuple[Tensor, Any]:
        beta, g = beta.to(q.dtype), g.to(q.dtype)
        if chunk:
            return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                          output_final_state=want_state, chunk_size=self.chunk_size)
        return fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                                output_final_state=want_state)
