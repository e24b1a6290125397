"""Log-linear attention (Guo et al. 2025): Fenwick-tree levels over two linear bases.

A query t splits the past into O(log t) buckets, l(t, s) = bit_length(t XOR s) (level 0 is t
itself, level l the aligned block of 2^(l-1) tokens before that), keeps one state per bucket and
weighs each by a learned, data-dependent lambda_t[l] >= 0:

    o_t = sum_l lambda_t[l] q_t^T S_t^(l)

- `log_linear_mamba2`: the scalar-gate Mamba-2 base, q = C_t, k = B_t, v = dt_t x_t,
  log alpha_t = -exp(A_log) dt_t, plus the skip D x_t; causal short conv over (x, B, C);
  output RMSNorm gated by SiLU(z). Uses `recurrent_depth.ops.chunk_log_linear_attn`.
- `log_linear_gated_deltanet`: the Gated DeltaNet layer (`deltanet.py`) with the same level
  weights; uses `log_linear_delta.chunk_log_linear_gated_delta_rule`.

lambda_t[l] = softplus(L[h, l] * dl_t[h, l]) with dl = l_proj(x) and L initialised to ones
(flash-linear-attention's parameterisation); there is one level per bit of `max_seq_len`.
Decode state per layer: bit_length(T - 1) + 1 level states [H, K, V] (it grows as log T) plus
the convolution's last W-1 inputs; O(log T * H K V) work per token. Fenwick buckets follow
absolute positions, so left padding shifts them: a padded row writes nothing into the state
but is not bit-identical to running alone (the other linear mixers are).
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
    check_int,
    check_power_of_two,
    mamba_decay_init,
    nbytes,
    or_default,
    state_dtype,
    upcast,
    zero_padded,
)
from recurrent_depth.model.mixers.deltanet import DeltaRuleMixer
from recurrent_depth.model.mixers.log_linear_delta import (
    chunk_log_linear_gated_delta_rule,
    recurrent_log_linear_gated_delta_rule,
)
from recurrent_depth.ops.log_linear_attn import chunk_log_linear_attn, fused_recurrent_log_linear_attn
from recurrent_depth.ops.log_linear_attn.utils import LogLinearState, levels_needed


class LevelWeights(nn.Module):
    """lambda [B, T, H, L] = softplus(L[h, l] * l_proj(x)[h, l]), cut to the levels positions < `upto` use."""

    def __init__(self, hidden: int, num_heads: int, num_levels: int) -> None:
        super().__init__()
        self.num_heads, self.num_levels = num_heads, num_levels
        self.l_proj = nn.Linear(hidden, num_heads * num_levels, bias=False)
        self.level_weight = nn.Parameter(torch.ones(num_heads, num_levels))

    def forward(self, x: Tensor, upto: int) -> Tensor:
        B, T, _ = x.shape
        if upto > self.num_levels:
            raise ValueError(f"log-linear attention over {upto} levels needs max_seq_len >= {2 ** (upto - 1)}; "
                             f"this layer has {self.num_levels} levels")
        dl = self.l_proj(x).view(B, T, self.num_heads, self.num_levels)[..., :upto]
        return F.softplus(self.level_weight[:, :upto] * dl)


def unpack(stored: dict | None) -> LogLinearState | None:
    """The cache holds {"levels": [B, H, L, K, V], "offset": int} (plain dicts of batch-first tensors,
    which caching policies can mask row by row); the ops take a `LogLinearState`."""
    return None if stored is None else LogLinearState(stored["levels"], stored["offset"])


def pack(state: LogLinearState | None) -> dict | None:
    return None if state is None else {"levels": state.levels, "offset": state.offset}


@register_mixer("log_linear_mamba2")
class LogLinearMamba2(RecurrentMixer):
    mixer_name = "log_linear_mamba2"
    shared_counter = absolute_positions = True

    def __init__(self, config: ModelConfig, part: str = "core", *, state_dim: int | None = None, conv_size: int = 4,
                 chunk_size: int = 64, **shared: Any) -> None:
        super().__init__(config, part, **shared)
        name, H, P = self.mixer_name, self.num_heads, self.head_dim
        self.state_dim = N = check_int(name, "state_dim", or_default(state_dim, config.head_dim))
        self.conv_size = check_int(name, "conv_size", conv_size, 2, 16)
        self.chunk_size = check_power_of_two(name, "chunk_size", chunk_size)
        self.num_levels = levels_needed(config.max_seq_len)
        h = config.hidden_size
        self.z_proj = nn.Linear(h, H * P, bias=False)
        self.xbc_proj = nn.Linear(h, H * P + 2 * N, bias=False)
        self.dt_proj = nn.Linear(h, H, bias=False)
        self.levels = LevelWeights(h, H, self.num_levels)
        self.conv = ShortConv(H * P + 2 * N, self.conv_size)
        A_log, dt_bias = mamba_decay_init(H, (1.0, 16.0))
        self.A_log = nn.Parameter(A_log)
        self.dt_bias = nn.Parameter(dt_bias)
        self.D = nn.Parameter(torch.ones(H))
        for p in (self.A_log, self.dt_bias, self.D):
            p._no_weight_decay = True
        self.o_norm = GatedRMSNorm(P, config.norm_eps)
        self.proj = nn.Linear(H * P, h, bias=config.bias)

    def mix(self, x: Tensor, valid: Tensor | None, state: Any, want_state: bool) -> tuple[Tensor, Any]:
        B, T, _ = x.shape
        H, P, N = self.num_heads, self.head_dim, self.state_dim
        state = state or {}
        xbc, conv_state = self.conv(zero_padded(self.xbc_proj(x), valid), state.get("conv"))
        xs, Bs, Cs = xbc.split([H * P, N, N], dim=-1)
        xs = xs.view(B, T, H, P)
        dt = F.softplus(upcast(self.dt_proj(x)) + self.dt_bias)  # [B, T, H]
        g = zero_padded(-upcast(self.A_log).exp() * dt, valid)
        v = zero_padded(xs * dt[..., None].to(xs.dtype), valid)
        q = Cs[:, :, None, :].expand(B, T, H, N)  # one group: C and B shared by all heads
        k = Bs[:, :, None, :].expand(B, T, H, N)
        recurrent = unpack(state.get("recurrent"))
        offset = recurrent.offset if recurrent is not None else 0
        lam = self.levels(x, levels_needed(offset + T)).to(x.dtype)
        if self.use_chunk(T):
            y, final = chunk_log_linear_attn(q, k, v, g.to(x.dtype), lam, scale=1.0, initial_state=recurrent,
                                             output_final_state=want_state, chunk_size=self.chunk_size)
        else:
            y, final = fused_recurrent_log_linear_attn(q, k, v, g.to(x.dtype), lam, scale=1.0,
                                                       initial_state=recurrent, output_final_state=want_state)
        y = y + self.D[:, None].to(xs.dtype) * xs
        y = self.o_norm(y, self.z_proj(x).view(B, T, H, P))
        return self.proj(y.reshape(B, T, H * P)), {"recurrent": pack(final), "conv": conv_state}

    def state_nbytes(self, batch: int, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
        H, P, N = self.num_heads, self.head_dim, self.state_dim
        levels = levels_needed(seq_len)
        conv = batch * (self.conv_size - 1) * (H * P + 2 * N)
        return nbytes(batch * H * levels * N * P, state_dtype(dtype)) + nbytes(conv, dtype)


@register_mixer("log_linear_gated_deltanet")
class LogLinearGatedDeltaNet(DeltaRuleMixer):
    mixer_name = "log_linear_gated_deltanet"
    shared_counter = absolute_positions = True
    gated = True

    def add_extra_modules(self, config: ModelConfig) -> None:
        self.num_levels = levels_needed(config.max_seq_len)
        self.levels = LevelWeights(config.hidden_size, self.num_heads, self.num_levels)

    def kernel(self, x, q, k, v, beta, g, initial_state, want_state: bool, chunk: bool) -> tuple[Tensor, Any]:
        initial_state = unpack(initial_state)
        offset = initial_state.offset if initial_state is not None else 0
        lam = self.levels(x, levels_needed(offset + x.shape[1])).to(q.dtype)
        beta, g = beta.to(q.dtype), g.to(q.dtype)
        if chunk:
            o, final = chunk_log_linear_gated_delta_rule(q, k, v, g, beta, lam, initial_state=initial_state,
                                                         output_final_state=want_state, chunk_size=self.chunk_size)
        else:
            o, final = recurrent_log_linear_gated_delta_rule(q, k, v, g, beta, lam, initial_state=initial_state,
                                                             output_final_state=want_state)
        return o, pack(final)

    def state_nbytes(self, batch: int, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
        one_level = nbytes(batch * self.num_heads * self.key_dim * self.value_dim, state_dtype(dtype))
        return super().state_nbytes(batch, seq_len, dtype) + (levels_needed(seq_len) - 1) * one_level
