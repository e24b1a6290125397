"""Test-time-regression mixers: the state is a key→value regressor trained online on the context.

- `ttt_kvb`: TTT with key-value binding and a linear inner model (TTT-Linear, arXiv 2407.04620;
  "Test-Time Training with KV Binding Is Secretly Linear Attention"): mini-batch gradient descent
  on ½‖Wᵀk − v‖², `ops.ttt_kvb`.
- `falcon`: Falcon-1 (arXiv 2608.27763): one NLMS step per token on the prefix-aligned pair
  (k_{t−1}, v_t), `ops.falcon`.

Features as the delta-rule layers: q, k, v through SiLU, q and k L2-normalised, a per-token inner
learning rate beta = sigmoid(b_proj x) per head, output per-head RMSNorm, then `proj`. A padded
token has beta = 0 and a zero key, so it trains nothing (for `ttt_kvb` it still takes a slot of
its mini-batch: mini-batches count positions, see docs/mixers.md). Decode state per layer:
O(H K V), constant in T.
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
    check_int,
    check_power_of_two,
    l2norm,
    nbytes,
    padding_after_state,
    state_dtype,
    zero_padded,
)
from recurrent_depth.ops.falcon import chunk_falcon, naive_recurrent_falcon
from recurrent_depth.ops.ttt_kvb import chunk_ttt_kvb, naive_recurrent_ttt_kvb


class RegressionMixer(RecurrentMixer):
    """Projections and the inner learning rate shared by the test-time-regression mixers."""

    def __init__(self, config: ModelConfig, part: str = "core", **shared: Any) -> None:
        super().__init__(config, part, **shared)  # mode "fused_recurrent" runs the step-by-step op
        H, D, h = self.num_heads, self.head_dim, config.hidden_size
        self.q_proj = nn.Linear(h, H * D, bias=False)
        self.k_proj = nn.Linear(h, H * D, bias=False)
        self.v_proj = nn.Linear(h, H * D, bias=False)
        self.b_proj = nn.Linear(h, H, bias=False)
        self.o_norm = GatedRMSNorm(D, config.norm_eps)
        self.proj = nn.Linear(H * D, h, bias=config.bias)

    def mix(self, x: Tensor, valid: Tensor | None, state: Any, want_state: bool) -> tuple[Tensor, Any]:
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        q = l2norm(F.silu(self.q_proj(x)).view(B, T, H, D))
        k = l2norm(F.silu(self.k_proj(x)).view(B, T, H, D))
        # Falcon pairs each value with the previous key: left padding carries the state's last key.
        last = getattr(state["recurrent"], "last_key", None) if state else None
        k = padding_after_state(k, valid, None if last is None else last[:, None])[0]  # (one key: exact)
        v = self.v_proj(x).view(B, T, H, D)
        beta = zero_padded(self.b_proj(x).sigmoid(), valid).to(q.dtype)
        o, final = self.kernel(q, k, v, beta, state["recurrent"] if state else None, want_state)
        return self.proj(self.o_norm(o).reshape(B, T, H * D)), {"recurrent": final}

    def kernel(self, q, k, v, beta, initial_state, want_state: bool) -> tuple[Tensor, Any]:
        raise NotImplementedError

    def state_nbytes(self, batch: int, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
        H, D = self.num_heads, self.head_dim
        return nbytes(batch * H * self.state_elements_per_head(D), state_dtype(dtype))


@register_mixer("ttt_kvb")
class TTTKVB(RegressionMixer):
    mixer_name = "ttt_kvb"

    def __init__(self, config: ModelConfig, part: str = "core", *, mini_batch: int = 16, **shared: Any) -> None:
        super().__init__(config, part, **shared)
        self.mini_batch = check_int(self.mixer_name, "mini_batch", mini_batch, 1, 4096)
        self.shared_counter = self.mini_batch > 1  # (mini_batch 1: the count is always 0)

    def kernel(self, q, k, v, beta, initial_state, want_state: bool) -> tuple[Tensor, Any]:
        op = chunk_ttt_kvb if self.use_chunk(q.shape[1]) else naive_recurrent_ttt_kvb
        return op(q, k, v, beta, initial_state=initial_state, output_final_state=want_state,
                  mini_batch=self.mini_batch)

    def state_elements_per_head(self, D: int) -> int:
        return 2 * D * D  # the mini-batch's entering weight and the current one


@register_mixer("falcon")
class Falcon(RegressionMixer):
    mixer_name = "falcon"

    def __init__(self, config: ModelConfig, part: str = "core", *, chunk_size: int = 64, **shared: Any) -> None:
        super().__init__(config, part, **shared)
        self.chunk_size = check_power_of_two(self.mixer_name, "chunk_size", chunk_size)

    def kernel(self, q, k, v, beta, initial_state, want_state: bool) -> tuple[Tensor, Any]:
        if self.use_chunk(q.shape[1]):
            return chunk_falcon(q, k, v, beta, initial_state=initial_state, output_final_state=want_state,
                                chunk_size=self.chunk_size)
        return naive_recurrent_falcon(q, k, v, beta, initial_state=initial_state, output_final_state=want_state)

    def state_elements_per_head(self, D: int) -> int:
        return D * D + D  # the regressor and the last key
