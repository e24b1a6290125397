"""Model FLOPs of a recurrent-depth forward/backward pass, counted by hand (for AFU / MFU figures).

Per token, a linear layer `in -> out` costs 2*in*out FLOPs forward and twice that backward.
Causal softmax attention costs 2*H*T*D per token per layer forward: QK^T and AV each cost 2*D
FLOPs per head and query-key pair, and the causal triangle holds T^2/2 pairs (a sliding window
W < T leaves W*T - W^2/2); torch's FLOP counter misses it on CPU (SDPA has no formula there),
which is why it is counted here. Per-part `mixer_options` of the attention mixer (`num_kv_heads`,
`window`) are honoured, as the model builds them. Each core step adds its injection's matmul
(`injection`: concat's adapter 2h -> h, diagonal's B e, h -> h; add and none have none), the coda
reads through `coda_projection` (h -> h) where the config has one, and a layer with a value
embedding adds its gate (`VALUE_GATE_CHANNELS` -> its kv heads). Backward costs 2x forward, and
only for what gradients flow through: the last `grad_steps` core steps (with their injection), the
coda and the head, and the prelude when its output e reaches them (injection other than none with
`grad_steps` >= 1, or e as s_0 with no step before the gradient ones: with injection none and
truncated backprop the prelude gets no gradient). Activation-checkpointing recompute is overhead,
not model FLOPs, and so is the optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from recurrent_depth.config import VALUE_GATE_CHANNELS, ModelConfig, is_int
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


def injection_flops(cfg: ModelConfig) -> float:
    """Forward FLOPs per token of one core step's injection of e (`cfg.injection`)."""
    h = cfg.hidden_size
    return {"concat": 2.0 * (2 * h) * h, "diagonal": 2.0 * h * h}.get(cfg.injection, 0.0)


def _part_flops(cfg: ModelConfig, part: str, seq_len: int) -> tuple[float, float]:
    """(all forward FLOPs, attention forward FLOPs) per token of all of `part`'s blocks (one pass)."""
    name = cfg.mixer_for(part)
    if name != "attention":
        raise ValueError(f"FLOPs are counted for softmax attention only, got mixer {name!r} in the {part}")
    options = scoped_options(name, part, dict(cfg.mixer_options))
    kv = cfg.num_kv_heads if options.get("num_kv_heads") is None else options["num_kv_heads"]
    start = {"prelude": 0, "core": cfg.prelude_layers, "coda": cfg.prelude_layers + cfg.core_layers}[part]
    count = {"prelude": cfg.prelude_layers, "core": cfg.core_layers, "coda": cfg.coda_layers}[part]
    attention = 0.0
    for layer in range(start, start + count):  # (per-layer windows: a retrofitted Qwen2's sliding layers)
        window = cfg.attention_windows[layer] if cfg.attention_windows else options.get("window")
        attention += attention_flops(cfg, seq_len, window)
    # a value embedding's gate: Linear(VALUE_GATE_CHANNELS, kv heads) on the layer's input
    gates = sum(start <= i < start + count for i in cfg.value_embeddings) * 2.0 * VALUE_GATE_CHANNELS * kv
    return count * block_linear_flops(cfg, kv) + gates + attention, attention


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
        _part_flops(cfg, part, seq_len) for part in ("prelude", "core", "coda")
    )
    head = 2.0 * cfg.hidden_size * cfg.vocab_size
    projection = 2.0 * cfg.hidden_size * cfg.hidden_size if cfg.coda_projection else 0.0
    core_step = core + injection_flops(cfg)
    readout = coda + projection + head
    # the prelude's output e reaches the gradient: injected into a step with gradients, or s_0 read with none
    # detached before it (truncated backprop detaches the state, and injection none never reads e again)
    prelude_grad = (cfg.injection != "none" and n_grad > 0) or (cfg.state_init == "embedding" and n_free == 0)
    forward = tokens * (prelude + readout + (n_free + n_grad) * core_step)
    with_grad = tokens * ((prelude if prelude_grad else 0.0) + readout + n_grad * core_step)
    attention = tokens * (prelude_attn + coda_attn + (n_free + n_grad) * core_attn)
    return StepFlops(forward=forward, backward=2.0 * with_grad, attention_forward=attention)
