"""Gated linear attention (GLA, Yang et al. 2023): a data-dependent decay per key channel.

    S_t = diag(alpha_t) S_{t-1} + k_t v_t^T        o_t = S_t^T (q_t / sqrt(K))

As flash-linear-attention's layer: log alpha = logsigmoid(W2 W1 x + b) / 16 with a rank-16 gate
projection (the /16 keeps alpha near 1, i.e. long memory, at init); key dim = expand_k * head_dim
(0.5 by default), value dim = expand_v * head_dim; output per-head RMSNorm times SiLU(g_proj x).

Decode state per layer: S [B, H, K, V], constant in T; O(H K V) work per token. A padded token
has k = 0 and log alpha = 0, so the state is untouched.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recurrent_depth.config import ModelConfig
from recurrent_depth.model.mixers.base import register_mixer
from recurrent_depth.model.mixers.common import (
    GatedRMSNorm,
    RecurrentMixer,
    check_power_of_two,
    nbytes,
    state_dtype,
    zero_padded,
)
from recurrent_depth.ops.gla import chunk_gla, fused_recurrent_gla

GATE_RANK = 16
GATE_NORMALIZER = 16.0


@register_mixer("gla")
class GatedLinearAttention(RecurrentMixer):
    mixer_name = "gla"

    def __init__(self, config: ModelConfig, part: str = "core", *, expand_k: float = 0.5, expand_v: float = 1.0,
                 chunk_size: int = 64, **shared: Any) -> None:
        super().__init__(config, part, **shared)
        name, H, head_dim = self.mixer_name, self.num_heads, self.head_dim
        for opt, value in (("expand_k", expand_k), ("expand_v", expand_v)):
            if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0
                    or int(value * head_dim) < 1):
                raise ValueError(f"{name} option {opt}={value!r} is invalid: expected a finite number > 0 with "
                                 f"{opt} * head_dim >= 1 (head_dim={head_dim})")
        self.key_dim = K = int(expand_k * head_dim)
        self.value_dim = V = int(expand_v * head_dim)
        self.chunk_size = check_power_of_two(name, "chunk_size", chunk_size)
        h = config.hidden_size
        self.q_proj = nn.Linear(h, H * K, bias=False)
        self.k_proj = nn.Linear(h, H * K, bias=False)
        self.v_proj = nn.Linear(h, H * V, bias=False)
        self.gk_proj = nn.Sequential(nn.Linear(h, GATE_RANK, bias=False), nn.Linear(GATE_RANK, H * K, bias=True))
        self.g_proj = nn.Linear(h, H * V, bias=False)
        self.o_norm = GatedRMSNorm(V, config.norm_eps)
        self.proj = nn.Linear(H * V, h, bias=config.bias)

    def mix(self, x: Tensor, valid: Tensor | None, state: Any, want_state: bool) -> tuple[Tensor, Any]:
        B, T, _ = x.shape
        H, K, V = self.num_heads, self.key_dim, self.value_dim
        q = self.q_proj(x).view(B, T, H, K)
        k = zero_padded(self.k_proj(x).view(B, T, H, K), valid)
        v = self.v_proj(x).view(B, T, H, V)
        g = zero_padded(F.logsigmoid(self.gk_proj(x)).view(B, T, H, K) / GATE_NORMALIZER, valid)
        recurrent = state["recurrent"] if state is not None else None
        if self.use_chunk(T):
            o, final = chunk_gla(q, k, v, g, initial_state=recurrent, output_final_state=want_state,
                                 chunk_size=self.chunk_size)
        else:
            o, final = fused_recurrent_gla(q, k, v, g, initial_state=recurrent, output_final_state=want_state)
        o = self.o_norm(o, self.g_proj(x).view(B, T, H, V))
        return self.proj(o.reshape(B, T, H * V)), {"recurrent": final}

    def state_nbytes(self, batch: int, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
        return nbytes(batch * self.num_heads * self.key_dim * self.value_dim, state_dtype(dtype))
