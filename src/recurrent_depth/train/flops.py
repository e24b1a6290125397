"""Model FLOPs of a recurrent-depth forward/backward pass, counted by hand (for AFU / MFU figures).

Per token, a linear layer `in -> out` costs 2*in*out FLOPs forward and twice that backward.
Causal softmax attention costs 2*H*T*D per token per layer forward: QK^T and AV each cost 2*D
FLOPs per head and query-key pair, and the causal triangle holds T^2/2 pairs (a sliding window
W < T leaves W*T - W^2/2); torch's FLOP counter misses it on CPU (SDPA has no formula there),
which is why it is counted here. Per-part `mixer_options` of the attention mixer (`num_kv_heads`,
`window`) are honoured, as the model builds them. Backward costs 2x forward, and
only for what gradients flow through: the prelude, the last `grad_steps` core steps (with their
adapter), the coda and the head. Activation-checkpointing recompute is overhead, not model FLOPs,
and so is the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from recurrent_depth.config import ModelConfig, is_int
from recurrent_depth.model.mixers.base import scoped_options


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step, split so tests and reports can check each part."""

    forward: float
    backward: float
    attention_forward: float  # included in `forward`

    @property
    def total(self) -> float:
        return self.forward + self.backward


def block_linear_flops(cfg: ModelConfig, num_kv_heads: int | None = None) -> float:
    """Forward FLOPs per token of one block's matmuls (attention projections + the MLP: three matrices
    gated, two ungated)."""
    h, D = cfg.hidden_size, cfg.head_dim
    kv = cfg.num_kv_heads if num_kv_heads is None else num_kv_heads
    qkv = h * (cfg.num_heads + 2 * kv) * D
    proj = cfg.num_heads * D * h
    mlp = (3 if cfg.mlp_gated else 2) * cfg.intermediate_size * h
    return 2.0 * (qkv + proj + mlp)


def attention_flops(cfg: ModelConfig, seq_len: int, window: int | None = None) -> float:
    """Forward FLOPs per token of one causal attention layer at sequence length `seq_len`."""
    pairs = seq_len**2 / 2 if window is None or window >= seq_len else window * seq_len - window**2 / 2
    return 4.0 * cfg.num_heads * cfg.head_dim * pairs / seq_len


def _attention_layer(cfg: ModelConfig, part: str, seq_len: int) -> tuple[float, float]:
    """(all forward FLOPs, attention forward FLOPs) per token of one block of `part`."""
    name = cfg.mixer_for(part)
    if name != "attention":
        raise ValueError(f"FLOPs are counted for softmax attention only, got mixer {name!r} in the {part}")
    options = scoped_options(name, part, dict(cfg.mixer_options))
    attention = attention_flops(cfg, seq_len, options.get("window"))
    start = {"prelude": 0, "core": cfg.prelude_layers, "coda": cfg.prelude_layers + cfg.core_layers}[part]
    count = {"prelude": cfg.prelude_layers, "core": cfg.core_layers, "coda": cfg.coda_layers}[part]
    windows = cfg.attention_windows[start:start + count]  # (per-layer windows: the part's mean layer)
    if windows:
        attention = sum(attention_flops(cfg, seq_len, w) for w in windows) / len(windows)
    return block_linear_flops(cfg, options.get("num_kv_heads")) + attention, attention


def training_step_flops(cfg: ModelConfig, batch: int, seq_len: int, num_steps: tuple[int, int]) -> StepFlops:
    """Model FLOPs of forward + backward on [batch, seq_len] tokens at depth (no_grad_steps, grad_steps)."""
    for name, value in (("batch", batch), ("seq_len", seq_len)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if (
        not isinstance(num_steps, tuple | list)
        or len(num_steps) != 2
        or not all(is_int(n) and n >= 0 for n in num_steps)
    ):
        raise ValueError(f"num_steps must be a pair (no_grad_steps, grad_steps) of integers >= 0, got {num_steps!r}")
    n_free, n_grad = num_steps
    tokens = batch * seq_len
    (prelude, prelude_attn), (core, core_attn), (coda, coda_attn) = (
        _attention_layer(cfg, part, seq_len) for part in ("prelude", "core", "coda")
    )
    adapter = 2.0 * (2 * cfg.hidden_size) * cfg.hidden_size
    head = 2.0 * cfg.hidden_size * cfg.vocab_size
    core_step = cfg.core_layers * core + adapter
    outer = cfg.prelude_layers * prelude + cfg.coda_layers * coda + head
    forward = tokens * (outer + (n_free + n_grad) * core_step)
    with_grad = tokens * (outer + n_grad * core_step)
    outer_attention = cfg.prelude_layers * prelude_attn + cfg.coda_layers * coda_attn
    attention = tokens * (outer_attention + (n_free + n_grad) * cfg.core_layers * core_attn)
    return StepFlops(forward=forward, backward=2.0 * with_grad, attention_forward=attention)
