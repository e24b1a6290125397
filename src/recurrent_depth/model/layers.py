"""Building blocks shared by every part of the model: RMSNorm, the MLPs, RoPE, the block layouts, Parcae's
diagonal injection."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recurrent_depth.config import ModelConfig


class RMSNorm(nn.Module):
    """y = x / rms(x) * weight, the statistics in float32 whatever the input dtype (as Huginn).

    heads: None for one gain [dim]; n for a gain per head [n, dim], for inputs [..., n, dim].
    unit_offset (`ModelConfig.norm_unit_offset`, Gemma's norm): the gain is 1 + weight (weight starts at 0),
    added and multiplied in float32 and rounded to x's dtype once, as transformers' GemmaRMSNorm; without it
    the normalised x is rounded to x's dtype before the gain (Huginn's), which a (1 + w) gain stored in bf16
    could not reproduce.
    float32_gain (`ModelConfig.norm_float32_gain`, OLMo-2's norm): the gain w multiplied in float32 and the product
    rounded to x's dtype once, as transformers' Olmo2RMSNorm (the same as the default in float32).
    """

    def __init__(self, dim: int, eps: float = 1e-6, heads: int | None = None, unit_offset: bool = False,
                 float32_gain: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.float32_gain = float32_gain
        shape = (dim,) if heads is None else (heads, dim)
        self.weight = nn.Parameter(torch.zeros(shape) if unit_offset else torch.ones(shape))

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            x32 = x.float()
            normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            if self.unit_offset:
                return (normed * (1.0 + self.weight.float())).to(x.dtype)
            if self.float32_gain:
                return (normed * self.weight.float()).to(x.dtype)
        return normed.to(x.dtype) * self.weight

    def reset_gain(self) -> None:
        """The gain back to one (weight 1, or 0 under unit_offset)."""
        if self.unit_offset:
            nn.init.zeros_(self.weight)
        else:
            nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        flags = "".join(f", {name}=True" for name in ("unit_offset", "float32_gain") if getattr(self, name))
        return f"{tuple(self.weight.shape)}, eps={self.eps}{flags}"


def model_norm(config: ModelConfig, dim: int | None = None, eps: float | None = None,
               heads: int | None = None) -> RMSNorm:
    """An RMSNorm of the model's kind (`norm_unit_offset`, `norm_float32_gain`) over `dim` channels (default
    hidden_size), with epsilon `eps` (default norm_eps): the one place the model's norms are made."""
    return RMSNorm(config.hidden_size if dim is None else dim, config.norm_eps if eps is None else eps, heads,
                   unit_offset=config.norm_unit_offset, float32_gain=config.norm_float32_gain)


def relu2_half(x: Tensor) -> Tensor:
    """relu(x)^2 / 2 (Parcae's ReLU2)."""
    return F.relu(x).pow(2).mul(0.5)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "relu2_half": relu2_half,
}


class GatedMLP(nn.Module):
    """A gated MLP (SwiGLU by default) with one fused input projection: fc(x) = [gate | up],
    out = proj(act(gate) * up). Checkpoints with separate gate / up projections are fused on load."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.bias)
        self.act = ACTIVATIONS[config.mlp_activation]

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(self.act(gate) * up)


class MLP(nn.Module):
    """An ungated MLP, out = proj(act(fc(x))) (`mlp_gated=False`: Parcae's BaseMLP, GPT-2's)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.bias)
        self.act = ACTIVATIONS[config.mlp_activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.act(self.fc(x)))


def build_mlp(config: ModelConfig) -> nn.Module:
    return GatedMLP(config) if config.mlp_gated else MLP(config)


class DiagonalInjection(nn.Module):
    """Parcae's injection (`injection="diagonal"`): x = exp(-dt A) * s + dt * (B e), per channel.

    A = exp(A_log) > 0 and the step dt = softplus(dt_bias) > 0, so the state's factor exp(-dt A) lies in
    (0, 1) whatever the weights (the zero-order-hold discretisation of ds/dt = -A s + B e, Euler for B):
    the injection alone can never grow the state. B [h, h] maps e into the state. Names as Parcae's.
    """

    # The state's factor at init, exp(-dt A) = 1/sqrt(5) (A = 1): Parcae's default `ssm_decay`.
    INIT_DECAY = 5 ** -0.5

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(hidden_size))
        self.dt_bias = nn.Parameter(torch.zeros(hidden_size))
        self.B = nn.Parameter(torch.zeros(hidden_size, hidden_size))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """A = 1, dt = -log(INIT_DECAY) (so the factor is INIT_DECAY), B = I (e enters unchanged)."""
        self.A_log.zero_()
        dt = -math.log(self.INIT_DECAY)
        self.dt_bias.fill_(dt + math.log(-math.expm1(-dt)))  # softplus^-1(dt)
        self.B.copy_(torch.eye(self.B.shape[0]))

    def decay(self) -> Tensor:
        """The state's per-channel factor exp(-dt A) [h], in (0, 1)."""
        return torch.exp(-F.softplus(self.dt_bias) * torch.exp(self.A_log))

    def forward(self, state: Tensor, e: Tensor) -> Tensor:
        dt = F.softplus(self.dt_bias)
        return state * torch.exp(-dt * torch.exp(self.A_log)) + dt * (e @ self.B.T)


def rope_table(head_dim: int, max_len: int, base: float, device: torch.device | str | None = None,
               scaling: tuple | None = None) -> Tensor:
    """(cos, sin) of angle pos * base^(-2i/d) for each rotated pair: [max_len, head_dim/2, 2], fp32.

    Computed in float32 exactly as the official implementation does, so angles match it bit for bit.
    `scaling` is `config.rope_scaling_key(...)` (None: plain RoPE), which rescales the frequencies.
    Tables are cached per (dim, length, base, scaling, device): decoding reads them once per token per layer.
    """
    return _rope_table(head_dim, max_len, float(base), str(torch.device(device or "cpu")), scaling)


def rope_frequencies(head_dim: int, base: float, scaling: tuple | None = None, device: str = "cpu") -> Tensor:
    """inv_freq [head_dim/2] fp32: base^(-2i/d), then rescaled by `scaling` (transformers' formulas).

    linear: every frequency / factor (positions interpolated). llama3: wavelengths above
    original_context / low_freq_factor are divided by factor, below original_context /
    high_freq_factor kept, and those between blended linearly in original_context / wavelength.
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    if scaling is None:
        return inv_freq
    kind, factor = scaling[0], scaling[1]
    if kind == "linear":
        return inv_freq / factor
    low, high, context = scaling[2], scaling[3], scaling[4]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > context / low, inv_freq / factor, inv_freq)
    blend = (context / wavelength - low) / (high - low)
    smoothed = (1 - blend) * scaled / factor + blend * scaled
    medium = (wavelength >= context / high) & (wavelength <= context / low)
    return torch.where(medium, smoothed, scaled)


# Tables for contexts up to this many positions are built whole at once (Huginn-0125's 4096 among them:
# the same table as ever, bit for bit); longer contexts get a table as long as the positions in use,
# grown by doubling, instead of one for all of `max_seq_len` (a 5e7-token context would take 8 GB).
ROPE_EAGER_POSITIONS = 4096


def rope_table_length(max_len: int, positions: Tensor | None = None, needed: int | None = None) -> int:
    """Rows of the table that serves `positions` (or the first `needed` positions) of a `max_len` context."""
    if max_len <= ROPE_EAGER_POSITIONS:
        return max_len  # no look at the positions: no device synchronisation for ordinary contexts
    if needed is None:
        needed = int(positions.max()) + 1 if positions is not None and positions.numel() else 1
    return min(max_len, max(ROPE_EAGER_POSITIONS, 1 << (max(needed, 1) - 1).bit_length()))


def rope_at(positions: Tensor, head_dim: int, max_len: int, base: float, scaling: tuple | None = None) -> Tensor:
    """`rope_table(head_dim, max_len, base, scaling)[positions]` ([..., head_dim/2, 2]) from a table only as
    long as the positions need."""
    length = rope_table_length(max_len, positions)
    return rope_table(head_dim, length, base, positions.device, scaling)[positions]


class RotaryTable:
    """A table of `rope_table` rows (or their complex `cos + i sin`) for a `max_len` context, built for
    the positions looked up so far: `table[positions]` -> [..., head_dim/2, 2] (complex: [..., head_dim/2])."""

    def __init__(
        self, head_dim: int, max_len: int, base: float, device: torch.device | str | None = None,
        as_complex: bool = False,
    ) -> None:
        self.head_dim, self.max_len, self.base, self.device = head_dim, max_len, base, device
        self.as_complex = as_complex
        self._table: Tensor | None = None

    def __getitem__(self, positions: Tensor) -> Tensor:
        length = rope_table_length(self.max_len, positions)
        if self._table is None or self._table.shape[0] < length:
            table = rope_table(self.head_dim, length, self.base, self.device)
            self._table = torch.complex(table[..., 0], table[..., 1]) if self.as_complex else table
        return self._table[positions]


@functools.lru_cache(maxsize=16)
def _rope_table(head_dim: int, max_len: int, base: float, device: str, scaling: tuple | None = None) -> Tensor:
    with torch.inference_mode(False), torch.no_grad():
        inv_freq = rope_frequencies(head_dim, base, scaling, device)
        angles = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv_freq)
        return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) (GPT-J / complex style, not NeoX rotate-half).

    x: [B, T, H, D]; cos, sin: [B, T, 1, D/2] (or broadcastable). Computed in fp32 as one complex
    product per pair, (a + ib)(cos + i sin), like the official implementation: one kernel forward
    and backward instead of six, about twice as fast as real arithmetic in eager mode. Under
    torch.compile the same formula in real arithmetic (equal up to one rounding), which inductor
    fuses, as it cannot fuse complex numbers.
    """
    pairs = x.float().unflatten(-1, (-1, 2))  # [B, T, H, D/2, 2]
    if torch.compiler.is_compiling():
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2).to(x.dtype)
    if pairs.stride(-1) != 1 or any(stride % 2 for stride in pairs.stride()[:-1]):
        pairs = pairs.contiguous()  # view_as_complex needs (real, imag) adjacent and aligned
    rotated = torch.view_as_complex(pairs) * torch.complex(cos, sin)
    return torch.view_as_real(rotated).flatten(-2).to(x.dtype)


def apply_rope_half(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the pairs (x[i], x[i + D/2]) (NeoX / Llama "rotate half"), in fp32; shapes as `apply_rope`.

    Equal to transformers' `x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)` term for term.
    """
    x32 = x.float()
    a, b = x32.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


def apply_rope_half_rounded(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`apply_rope_half` as transformers computes it in x's dtype (`ModelConfig.transformers_rounding`): cos and sin
    rounded to it, then each product and each sum rounded, `x * cos + rotate_half(x) * sin` term for term.
    Equal to `apply_rope_half` in float32; in bf16 / fp16 it is what a transformers model of that dtype computes."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


ROPE_STYLES = {"interleaved": apply_rope, "half": apply_rope_half}


class SandwichBlock(nn.Module):
    """x <- norm_2(x + mix(norm_1(x))); x <- norm_4(x + mlp(norm_3(x))).

    Every block ends in a norm, so the recurrent state stays normalised however deep it runs.
    The token mixer (`attn`, named as in the Huginn checkpoint) is any registered mixer.
    """

    def __init__(self, config: ModelConfig, mixer: nn.Module) -> None:
        super().__init__()
        self.norm_1 = model_norm(config)
        self.attn = mixer
        self.norm_2 = model_norm(config)
        self.mlp = build_mlp(config)
        self.norm_3 = model_norm(config)
        self.norm_4 = model_norm(config)

    def forward(self, x: Tensor, ctx, layer_key: tuple) -> Tensor:
        x = self.norm_2(x + self.attn(self.norm_1(x), ctx, layer_key))
        return self.norm_4(x + self.mlp(self.norm_3(x)))


class PeriNormBlock(SandwichBlock):
    """x <- x + norm_2(mix(norm_1(x))); x <- x + norm_4(mlp(norm_3(x))) (Ouro's four norms).

    The norms wrap each branch, inside the residual: parameters as the sandwich block's."""

    def forward(self, x: Tensor, ctx, layer_key: tuple) -> Tensor:
        x = x + self.norm_2(self.attn(self.norm_1(x), ctx, layer_key))
        return x + self.norm_4(self.mlp(self.norm_3(x)))


class PreNormBlock(nn.Module):
    """x <- x + mix(norm_1(x)); x <- x + mlp(norm_3(x)) (Llama, Qwen2, Qwen3)."""

    def __init__(self, config: ModelConfig, mixer: nn.Module) -> None:
        super().__init__()
        self.norm_1 = model_norm(config)
        self.attn = mixer
        self.norm_3 = model_norm(config)
        self.mlp = build_mlp(config)

    def forward(self, x: Tensor, ctx, layer_key: tuple) -> Tensor:
        x = x + self.attn(self.norm_1(x), ctx, layer_key)
        return x + self.mlp(self.norm_3(x))


class PostNormBlock(nn.Module):
    """x <- x + norm_2(mix(x)); x <- x + norm_4(mlp(x)) (OLMo-2: the norm on each branch's output only)."""

    def __init__(self, config: ModelConfig, mixer: nn.Module) -> None:
        super().__init__()
        self.attn = mixer
        self.norm_2 = model_norm(config)
        self.mlp = build_mlp(config)
        self.norm_4 = model_norm(config)

    def forward(self, x: Tensor, ctx, layer_key: tuple) -> Tensor:
        x = x + self.norm_2(self.attn(x, ctx, layer_key))
        return x + self.norm_4(self.mlp(x))


BLOCKS: dict[str, type[nn.Module]] = {
    "sandwich": SandwichBlock, "peri-norm": PeriNormBlock, "pre-norm": PreNormBlock, "post-norm": PostNormBlock,
}


def build_block(config: ModelConfig, mixer: nn.Module) -> nn.Module:
    """The block of `config.block_layout` around `mixer` (every layout has `attn` and `mlp`)."""
    return BLOCKS[config.block_layout](config, mixer)
