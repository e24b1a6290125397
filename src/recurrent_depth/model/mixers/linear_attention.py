"""Linear attention (Katharopoulos et al. 2020), with or without the normaliser.

    S_t = S_{t-1} + phi(k_t) v_t^T        z_t = z_{t-1} + phi(k_t)
    o_t = phi(q_t)^T S_t / (phi(q_t)^T z_t)          (normalize=True)
    o_t = RMSNorm(phi(q_t)^T S_t)                    (normalize=False: the output norm keeps the
                                                      un-normalised sum at a usable scale)

Decode state per layer: S [B, H, K, V] (+ z [B, H, K] with the normaliser), constant in T;
O(H K V) work per token. A padded token has phi(k) = 0, so it writes nothing.
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
    check_bool,
    check_choice,
    check_power_of_two,
    nbytes,
    state_dtype,
    zero_padded,
)
from recurrent_depth.ops.linear_attn import chunk_linear_attn, fused_recurrent_linear_attn

FEATURE_MAPS = ("elu", "relu", "identity")


def feature_map(x: Tensor, kind: str) -> Tensor:
    if kind == "elu":
        return F.elu(x) + 1  # positive, so the normaliser never vanishes
    if kind == "relu":
        return F.relu(x)
    return x


@register_mixer("linear_attention")
class LinearAttention(RecurrentMixer):
    mixer_name = "linear_attention"

    def __init__(self, config: ModelConfig, part: str = "core", *, feature_map: str = "elu", normalize: bool = True,
                 chunk_size: int = 64, **shared: Any) -> None:
        super().__init__(config, part, **shared)
        name = self.mixer_name
        self.feature_map = check_choice(name, "feature_map", feature_map, FEATURE_MAPS)
        self.normalize = check_bool(name, "normalize", normalize)
        if self.normalize and self.feature_map == "identity":
            raise ValueError(f"{name} option feature_map='identity' needs normalize=False (the normaliser "
                             "phi(q)^T z can be zero or negative without a positive feature map)")
        self.chunk_size = check_power_of_two(name, "chunk_size", chunk_size)
        inner = self.num_heads * self.head_dim
        h = config.hidden_size
        self.q_proj = nn.Linear(h, inner, bias=False)
        self.k_proj = nn.Linear(h, inner, bias=False)
        self.v_proj = nn.Linear(h, inner, bias=False)
        self.o_norm = None if self.normalize else GatedRMSNorm(self.head_dim, config.norm_eps)
        self.proj = nn.Linear(inner, h, bias=config.bias)

    def mix(self, x: Tensor, valid: Tensor | None, state: Any, want_state: bool) -> tuple[Tensor, Any]:
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        q = feature_map(self.q_proj(x).view(B, T, H, D), self.feature_map)
        k = zero_padded(feature_map(self.k_proj(x).view(B, T, H, D), self.feature_map), valid)
        v = self.v_proj(x).view(B, T, H, D)
        recurrent = state["recurrent"] if state is not None else None
        if self.use_chunk(T):
            o, final = chunk_linear_attn(q, k, v, initial_state=recurrent, output_final_state=want_state,
                                         normalize=self.normalize, chunk_size=self.chunk_size)
        else:
            o, final = fused_recurrent_linear_attn(q, k, v, initial_state=recurrent, output_final_state=want_state,
                                                   normalize=self.normalize)
        if self.o_norm is not None:
            o = self.o_norm(o)
        return self.proj(o.reshape(B, T, H * D)), {"recurrent": final}

    def state_nbytes(self, batch: int, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
        K = V = self.head_dim
        per_head = K * V + (K if self.normalize else 0)
        return nbytes(batch * self.num_heads * per_head, state_dtype(dtype))
