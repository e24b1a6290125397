"""Pieces shared by the token mixers: padding and position helpers, masked attention, the causal
short convolution with its decode state, gated per-head RMSNorm, and the base class of the
fixed-state (recurrent) mixers.

Every mixer follows one contract (see `base.py`): `mixer(x [B, T, h], ctx, layer_key) -> [B, T, h]`.
With `ctx.cache` set, a mixer reads its per-layer decode state from the cache with exactly the
`layer_key` it was given and writes it back under the same key (`get_state`/`set_state`, or
`update_kv` for per-token caches), so a caching policy that maps keys (a KV-sharing budget maps
`("core", j, step)` to `("core", j, step % k)`) works for every mixer alike. `state_nbytes(batch,
seq_len)` is the size of that state after `seq_len` tokens, for one layer at one recurrence step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recurrent_depth.config import ModelConfig
from recurrent_depth.model.mixers.base import LayerKey, MixerContext

MODES = ("auto", "chunk", "fused_recurrent")


# ---------------------------------------------------------------------------- option checks
def check_int(mixer: str, name: str, value: Any, low: int = 1, high: int | None = None) -> int:
    """Require an int in [low, high]; raise a ValueError naming the mixer option otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise ValueError(f"{mixer} option {name}={value!r} is invalid: expected {allowed}")
    return value


def or_default(value: Any, default: Any) -> Any:
    """`value`, or `default` when value is None (0 stays 0, so the range check can reject it)."""
    return default if value is None else value


def check_choice(mixer: str, name: str, value: Any, choices: tuple) -> Any:
    if value not in choices:
        raise ValueError(f"{mixer} option {name}={value!r} is invalid: expected one of {list(choices)}")
    return value


def check_bool(mixer: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{mixer} option {name}={value!r} is invalid: expected True or False")
    return value


def check_power_of_two(mixer: str, name: str, value: Any, high: int = 1024) -> int:
    check_int(mixer, name, value, 1, high)
    if value & (value - 1):
        raise ValueError(f"{mixer} option {name}={value!r} is invalid: expected a power of two in [1, {high}]")
    return value


def upcast(x: Tensor) -> Tensor:
    """x in float32 when it is half precision; float32 and float64 stay as they are (a float64
    model computes its norms and gates in float64, so float64 references match it to rounding)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


# ---------------------------------------------------------------------------- padding and positions
def new_valid(ctx: MixerContext, T: int) -> Tensor | None:
    """[B, T] bool: which of this call's tokens are real (None when nothing is padded)."""
    if ctx.key_valid is None:
        return None
    return ctx.key_valid[:, ctx.past_len : ctx.past_len + T]


def key_positions(ctx: MixerContext, num_keys: int, device: torch.device) -> Tensor:
    """[B or 1, S] position of every key so far (padding excluded from the count, as RoPE positions).

    Left padding shifts the real tokens of a row; counting only real tokens makes block and window
    boundaries of the sparse mixers independent of how much padding a row has.
    """
    if ctx.key_valid is None:
        return torch.arange(num_keys, device=device)[None]
    return (ctx.key_valid.long().cumsum(-1) - 1).clamp(min=0)


def allowed_keys(ctx: MixerContext, T: int, num_keys: int, device: torch.device) -> Tensor:
    """[B or 1, 1, T, S] bool: causal (bottom-right aligned) and, with padding, real keys or self."""
    if ctx.attn_mask is not None:
        return ctx.attn_mask
    q_idx = torch.arange(num_keys - T, num_keys, device=device)[:, None]
    k_idx = torch.arange(num_keys, device=device)[None, :]
    return (k_idx <= q_idx)[None, None]


def zero_padded(x: Tensor, valid: Tensor | None) -> Tensor:
    """Zero the padded positions of x [B, T, ...] (valid: [B, T] or None)."""
    if valid is None:
        return x
    return x * valid.view(*valid.shape, *([1] * (x.dim() - 2))).to(x.dtype)


def padding_after_state(x: Tensor, valid: Tensor | None, before: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """(x [B, T, ...] with its padded positions zeroed, `before` [B, n, ...]) moved so that what came
    before this call (a short conv's last inputs, Falcon's last key) sits right before each row's first
    real token, after its left padding: a window over the padding then sees what the row alone sees.
    Without it, a call that continues a state (a KV slot shared by several steps of the prompt) read
    the padding's zeros there. Returns (x', before') for `cat([before', x'], 1)`."""
    x = zero_padded(x, valid)
    if valid is None or before is None:
        return x, before
    B, T = valid.shape
    n = before.shape[1]
    first = torch.where(valid.any(1), valid.long().argmax(1), T)[:, None]  # leading padding per row
    joined = torch.cat([before.to(x.dtype), x], 1)  # [B, n + T, ...]
    j = torch.arange(n + T, device=x.device)[None]
    source = torch.where(j < first + n, j - first, j)  # `before` shifted right past the padding
    keep = (source >= 0).view(B, n + T, *([1] * (x.dim() - 2)))
    index = source.clamp(min=0).view(B, n + T, *([1] * (x.dim() - 2))).expand(joined.shape)
    moved = torch.where(keep, joined.gather(1, index), torch.zeros((), dtype=x.dtype, device=x.device))
    return moved[:, n:], moved[:, :n].to(before.dtype)


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Softmax attention with a boolean mask: q [B, H, T, D], k [B, H, S, D], v [B, H, S, Dv].

    mask broadcasts to [B, H, T, S] (True = may attend). Rows with nothing to attend to return 0
    (and get zero gradients) instead of NaN. Returns (o [B, H, T, Dv], probs [B, H, T, S]).
    """
    scores = q @ k.transpose(-1, -2)
    scores = upcast(scores) * scale  # softmax statistics in float32 for half-precision models
    mask = mask.expand(scores.shape)
    empty = ~mask.any(-1, keepdim=True)
    probs = scores.masked_fill(~(mask | empty), float("-inf")).softmax(-1).masked_fill(empty, 0.0)
    return (probs.to(v.dtype) @ v), probs


# ---------------------------------------------------------------------------- small modules
class ShortConv(nn.Module):
    """Causal depthwise convolution over time with a decode state (the last W-1 inputs).

    x: [B, T, C] -> SiLU(conv(x)) [B, T, C]. `state` [B, W-1, C] holds the inputs before x (zeros
    at the start of a sequence), so prefilling any number of tokens, even fewer than W-1, and then
    decoding gives exactly the full-sequence result. Padded inputs must be zeroed by the caller.
    """

    def __init__(self, channels: int, kernel_size: int, activation: bool = True) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.activation = activation
        self.weight = nn.Parameter(torch.empty(channels, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels))
        bound = 1 / math.sqrt(kernel_size)
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
        B, T, C = x.shape
        W = self.kernel_size
        if state is None:
            state = x.new_zeros(B, W - 1, C)
        full = torch.cat([state.to(x.dtype), x], dim=1)  # [B, W-1+T, C]
        y = F.conv1d(full.transpose(1, 2), self.weight[:, None, :], self.bias, groups=C).transpose(1, 2)
        return (F.silu(y) if self.activation else y), full[:, full.shape[1] - (W - 1) :]


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the mixer output, optionally times SiLU(gate): [B, T, H, D] -> [B, T, H, D]."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor | None = None) -> Tensor:
        x32 = upcast(x)
        y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
        return y if gate is None else y * F.silu(gate)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """Unit L2 norm over the last dim (keeps I - beta k k^T contractive for the delta rules)."""
    return x * torch.rsqrt(upcast(x).pow(2).sum(-1, keepdim=True) + eps).to(x.dtype)


def inverse_softplus(x: Tensor) -> Tensor:
    return x + torch.log(-torch.expm1(-x))


def dt_bias_init(num_heads: int) -> Tensor:
    """Mamba-2 style dt_bias: softplus(dt_bias) = dt ~ logU[1e-3, 0.1], floored at 1e-4."""
    dt = torch.exp(torch.rand(num_heads) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3)).clamp(min=1e-4)
    return inverse_softplus(dt)


def mamba_decay_init(num_heads: int, a_range: tuple[float, float]) -> tuple[Tensor, Tensor]:
    """Mamba-2 style (A_log, dt_bias): A ~ U(a_range) (kept away from 0), dt as `dt_bias_init`."""
    A = torch.empty(num_heads).uniform_(*a_range).clamp(min=1e-4)
    return torch.log(A), dt_bias_init(num_heads)


# ---------------------------------------------------------------------------- recurrent mixer base
class RecurrentMixer(nn.Module):
    """Base of the fixed-state mixers (linear attention, DeltaNet, GLA, Gated DeltaNet, log-linear).

    Subclasses implement `mix(x, valid, state, want_state) -> (out [B, T, h], new_state)`, where
    `state` is whatever they returned last time for this layer key (None at the start) and
    `valid` [B, T] marks real tokens (None: all real). Padded tokens must leave the state exactly
    as it was: the subclasses zero their keys, decays and betas there.

    The options every recurrent mixer takes are checked here; a subclass names its own options
    and passes the rest on (`**shared`), which is how `base._accepted_options` finds both.
    """

    mixer_name = "recurrent"
    # `MIXER_CONFIG_OPTIONS` (base.py): none implemented (their projections and norms are their own). No RoPE, no
    # shared key/value heads and no softmax (every output is normalised, so muP's 1/d rule for softmax logits has
    # nothing to scale): those options pass here, for the attention layers beside them in a hybrid
    config_options: frozenset[str] = frozenset()
    moot_config_options = frozenset({"rope_style", "rope_scaling", "num_kv_heads", "attn_scale"})
    # The state holds one position count for every row of the batch (log-linear's Fenwick offset,
    # TTT-KVB's place in its mini-batch), so rows that skip a step cannot keep their own.
    shared_counter = False
    # That count is an absolute position, bounded by max_seq_len: a slot shared by several steps
    # (a KV budget) would advance it once per step and run out of levels.
    absolute_positions = False

    def __init__(
        self, config: ModelConfig, part: str = "core", *, num_heads: int | None = None, head_dim: int | None = None,
        mode: str = "auto",
    ) -> None:
        """num_heads, head_dim: default the model's. mode: "auto", "chunk" or "fused_recurrent" (see `use_chunk`)."""
        super().__init__()
        name = self.mixer_name
        self.num_heads = check_int(name, "num_heads", or_default(num_heads, config.num_heads))
        self.head_dim = check_int(name, "head_dim", or_default(head_dim, config.head_dim))
        self.mode = check_choice(name, "mode", mode, MODES)

    def forward(self, x: Tensor, ctx: MixerContext, layer_key: LayerKey) -> Tensor:
        valid = new_valid(ctx, x.shape[1])
        state = None
        if ctx.cache is not None:
            state = ctx.cache.get_state(layer_key)
            if state is None and ctx.past_len > 0:
                raise RuntimeError(
                    f"cache has no {self.mixer_name} state for {layer_key} at {ctx.past_len} cached positions "
                    "(this layer/step was skipped for earlier tokens; use a cache policy with a fallback)"
                )
        out, new_state = self.mix(x, valid, state, want_state=ctx.cache is not None)
        if ctx.cache is not None:
            ctx.cache.set_state(layer_key, new_state)
        return out

    def use_chunk(self, T: int) -> bool:
        """`mode`: "chunk", "fused_recurrent", or "auto" (the recurrent form for a single token)."""
        if self.mode == "auto":
            return T > 1
        return self.mode == "chunk"

    def mix(self, x: Tensor, valid: Tensor | None, state: Any, want_state: bool) -> tuple[Tensor, Any]:
        raise NotImplementedError

    def state_nbytes(self, batch: int, seq_len: int, dtype: torch.dtype = torch.float32) -> int:
        raise NotImplementedError


def state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Recurrent states accumulate in float32 (float64 for float64 models), as the ops return them."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()
