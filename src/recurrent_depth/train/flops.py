"""Model FLOPs of a recurrent-depth forward/backward pass, counted by hand (for AFU / MFU figures).

Per token, a linear layer `in -> out` costs 2*in*out FLOPs forward and twice that backward.
Causal softmax attention costs 2*H*T*D per token per layer forward (QK^T and AV, each
H*T*D multiply-adds on average over the causal triangle); torch's FLOP counter misses it on CPU
(SDPA has no formula there), which is why it is counted here. Backward costs 2x forward, and
only for what gradients flow through: the prelude, the last `grad_steps` core steps (with their
adapter), the coda and the head. Activation-checkpointing recompute is overhead, not model FLOPs,
and so is the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from recurrent_depth.config import ModelConfig


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one training step, split so tests and reports can check each part."""

    forward: float
    backward: float
    attention_forward: float  # included in `forward`

    @property
    def total(self) -> float:
        return self.forward + self.backward


def block_linear_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of one block's matmuls (attention projections + SwiGLU MLP)."""
    h, D = cfg.hidden_size, cfg.head_dim
    qkv = h * (cfg.num_heads + 2 * cfg.num_kv_heads) * D
    proj = cfg.num_heads * D * h
    mlp = h * 2 * cfg.intermediate_size + cfg.intermediate_size * h
    return 2.0 * (qkv + proj + mlp)


def attention_flops(cfg: ModelConfig, seq_len: int) -> float:
    """Forward FLOPs per token of one causal attention layer at sequence length `seq_len`."""
    return 2.0 * cfg.num_heads * cfg.head_dim * seq_len


def training_step_flops(cfg: ModelConfig, batch: int, seq_len: int, num_steps: tuple[int, int]) -> StepFlops:
    """Model FLOPs of forward + backward on [batch, seq_len] tokens at depth (no_grad_steps, grad_steps)."""
    if cfg.mixer != "attention":
        raise ValueError(f"FLOPs are counted for softmax attention only, got mixer={cfg.mixer!r}")
    n_free, n_grad = num_steps
    tokens = batch * seq_len
    layer = block_linear_flops(cfg) + attention_flops(cfg, seq_len)
    adapter = 2.0 * (2 * cfg.hidden_size) * cfg.hidden_size
    head = 2.0 * cfg.hidden_size * cfg.vocab_size
    core_step = cfg.core_layers * layer + adapter
    outer = (cfg.prelude_layers + cfg.coda_layers) * layer + head
    forward = tokens * (outer + (n_free + n_grad) * core_step)
    with_grad = tokens * (outer + n_grad * core_step)
    attention = (
        tokens
        * attention_flops(cfg, seq_len)
        * (cfg.prelude_layers + cfg.coda_layers + (n_free + n_grad) * cfg.core_layers)
    )
    return StepFlops(forward=forward, backward=2.0 * with_grad, attention_forward=attention)
