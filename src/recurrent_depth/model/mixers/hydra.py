"""Hydra (Hwang, Lahoti, Dao, Gu 2024): a bidirectional quasiseparable sequence mixer.

    Y = shift(SS_f(X)) + flip(shift(SS_b(flip X))) + D(X) * X

SS is the Mamba-2 scalar-gate scan, y_t = sum_{s<=t} C_t . B_s exp(sum_{r=s+1..t} A dt_r) dt_s x_s;
the shift (y_t <- y_{t-1}) keeps the diagonal out of both scans, and a data-dependent diagonal
D(x) = fc_D(x) + D supplies it. As a matrix, M[i, j] is C^f_{i-1} . B^f_j decay^f(j+1..i-1) dt^f_j
below the diagonal, the mirror image with C^b_{i+1} above it, and D_i on it
(`quasiseparable_matrix`, the plain reference of the two-scan fast path).

Layer (hydra/modules/hydra.py): in-projection to z, x, (B_f, C_f), (B_b, C_b) and dt for both
directions; a non-causal depthwise convolution (kernel 7) + SiLU over (x, B, C); the mixer above
with one group of B, C shared by all heads; RMSNorm(y) * SiLU(z); `proj`. Defaults: expand 2,
head_dim 64 (here the config's), state dim 64, A_log = 0 (A = -1), D = 1, dt ~ logU[1e-3, 0.1].

Output 0 depends on the last token, so Hydra has no decode state and cannot be the mixer of a
causal language model, so it is not a registered mixer (`mixer="hydra"` is unknown). Use `Hydra` directly
as an encoder / bidirectional layer; `forward(x, ctx=None, mask=None)` with mask [B, T] True for
real tokens (padded tokens then change nothing for the real ones).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from recurrent_depth.config import ModelConfig
from recurrent_depth.model.mixers.base import MixerContext
from recurrent_depth.model.mixers.common import (
    GatedRMSNorm,
    check_choice,
    check_int,
    dt_bias_init,
    or_default,
    zero_padded,
)
from recurrent_depth.ops.gla import chunk_gla, fused_recurrent_gla


def _shift(y: Tensor) -> Tensor:
    """y_t <- y_{t-1}, y_0 <- 0, over dim 1."""
    return F.pad(y[:, :-1], (0, 0, 0, 0, 1, 0))


def quasiseparable_mix(
    x: Tensor, dt: Tensor, A: Tensor, Bf: Tensor, Cf: Tensor, Bb: Tensor, Cb: Tensor, diag: Tensor,
    chunk: bool = True,
) -> Tensor:
    """The two-scan fast path. x [B, T, H, P]; dt [B, T, 2, H] (forward, backward); A [H] (< 0);
    B*, C* [B, T, N] (one group); diag [B, T, H]. Returns [B, T, H, P]."""
    Bsz, T, H, P = x.shape
    N = Bf.shape[-1]
    scan = chunk_gla if chunk else fused_recurrent_gla

    def ss(xs: Tensor, dts: Tensor, Bs: Tensor, Cs: Tensor) -> Tensor:
        q = Cs[:, :, None].expand(Bsz, T, H, N)
        k = Bs[:, :, None].expand(Bsz, T, H, N)
        g = (A * dts)[..., None].expand(Bsz, T, H, N)
        return scan(q, k, xs * dts[..., None], g, scale=1.0)[0]

    y_f = _shift(ss(x, dt[:, :, 0], Bf, Cf))
    y_b = _shift(ss(x.flip(1), dt[:, :, 1].flip(1), Bb.flip(1), Cb.flip(1))).flip(1)
    return y_f + y_b + diag[..., None] * x


def quasiseparable_matrix(
    dt: Tensor, A: Tensor, Bf: Tensor, Cf: Tensor, Bb: Tensor, Cb: Tensor, diag: Tensor
) -> Tensor:
    """The explicit mixing matrix M [B, H, T, T] (y_i = sum_j M[i, j] x_j): the plain reference."""
    Bsz, T, _, H = dt.shape
    cum_f = torch.cumsum(A * dt[:, :, 0], dim=1)  # [B, T, H]: sum_{r<=t} A dt_r
    cum_b = torch.cumsum((A * dt[:, :, 1]).flip(1), dim=1).flip(1)  # sum_{r>=t} A dt_r
    i = torch.arange(T, device=dt.device)
    lower, upper = i[:, None] > i[None, :], i[:, None] < i[None, :]
    # below: C_f[i-1] . B_f[j] exp(cum_f[i-1] - cum_f[j]) dt_f[j]
    cf_prev = F.pad(Cf[:, :-1], (0, 0, 1, 0))
    cum_f_prev = F.pad(cum_f[:, :-1], (0, 0, 1, 0))
    cb = torch.einsum("bin,bjn->bij", cf_prev, Bf)[:, None]  # [B, 1, T, T]
    dec = (cum_f_prev.transpose(1, 2)[..., :, None] - cum_f.transpose(1, 2)[..., None, :])
    low = cb * dec.masked_fill(~lower, float("-inf")).exp() * dt[:, :, 0].transpose(1, 2)[..., None, :]
    # above: C_b[i+1] . B_b[j] exp(cum_b[i+1] - cum_b[j]) dt_b[j]
    cb_next = F.pad(Cb[:, 1:], (0, 0, 0, 1))
    cum_b_next = F.pad(cum_b[:, 1:], (0, 0, 0, 1))
    cbb = torch.einsum("bin,bjn->bij", cb_next, Bb)[:, None]
    dec_b = (cum_b_next.transpose(1, 2)[..., :, None] - cum_b.transpose(1, 2)[..., None, :])
    up = cbb * dec_b.masked_fill(~upper, float("-inf")).exp() * dt[:, :, 1].transpose(1, 2)[..., None, :]
    return low + up + torch.diag_embed(diag.transpose(1, 2))


class Hydra(nn.Module):
    """The bidirectional Hydra layer: [B, T, h] -> [B, T, h] (see the module docstring)."""

    mixer_name = "hydra"

    def __init__(
        self,
        config: ModelConfig,
        part: str = "encoder",
        head_dim: int | None = None,
        expand: int = 2,
        state_dim: int = 64,
        conv_size: int = 7,
        mode: str = "chunk",
    ) -> None:
        super().__init__()
        name = self.mixer_name
        h = config.hidden_size
        self.head_dim = P = check_int(name, "head_dim", or_default(head_dim, config.head_dim))
        inner = check_int(name, "expand", expand) * h
        if inner % P:
            raise ValueError(f"{name} option head_dim={P} is invalid: expected a divisor of expand * hidden_size"
                             f" = {inner}")
        self.num_heads = H = inner // P
        self.state_dim = N = check_int(name, "state_dim", state_dim)
        self.conv_size = check_int(name, "conv_size", conv_size, 1, 31)
        if self.conv_size % 2 == 0:
            raise ValueError(f"{name} option conv_size={conv_size} is invalid: expected an odd number (centred conv)")
        self.mode = check_choice(name, "mode", mode, ("chunk", "fused_recurrent"))
        self.z_proj = nn.Linear(h, inner, bias=False)
        self.xbc_proj = nn.Linear(h, inner + 4 * N, bias=False)
        self.dt_proj = nn.Linear(h, 2 * H, bias=False)
        self.conv = nn.Conv1d(inner + 4 * N, inner + 4 * N, self.conv_size, padding=self.conv_size // 2,
                              groups=inner + 4 * N)
        self.fc_D = nn.Linear(inner, H, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))
        self.dt_bias = nn.Parameter(dt_bias_init(2 * H))
        self.D = nn.Parameter(torch.ones(H))
        self.o_norm = GatedRMSNorm(P, config.norm_eps)
        self.proj = nn.Linear(inner, h, bias=config.bias)

    def parts(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, ...]:
        """The mixer's inputs: xs [B, T, H, P], dt [B, T, 2, H], A [H], B_f, C_f, B_b, C_b [B, T, N], diag, z."""
        Bsz, T, _ = x.shape
        H, P, N = self.num_heads, self.head_dim, self.state_dim
        xbc = zero_padded(self.xbc_proj(x), mask)
        xbc = F.silu(self.conv(xbc.transpose(1, 2)).transpose(1, 2))
        xs, Bf, Cf, Bb, Cb = xbc.split([H * P, N, N, N, N], dim=-1)
        dt = zero_padded(F.softplus(self.dt_proj(x) + self.dt_bias).view(Bsz, T, 2, H), mask)
        diag = self.fc_D(xs) + self.D
        return xs.view(Bsz, T, H, P), dt, -self.A_log.exp(), Bf, Cf, Bb, Cb, diag, self.z_proj(x)

    def forward(self, x: Tensor, ctx: MixerContext | None = None, layer_key: Any = None,
                mask: Tensor | None = None) -> Tensor:
        if ctx is not None:
            if ctx.cache is not None or ctx.past_len:
                raise ValueError("hydra is bidirectional: it has no decode state and cannot run with a cache")
            mask = ctx.key_valid if mask is None else mask
        Bsz, T, _ = x.shape
        xs, dt, A, Bf, Cf, Bb, Cb, diag, z = self.parts(x, mask)
        y = quasiseparable_mix(xs, dt, A, Bf, Cf, Bb, Cb, diag, chunk=self.mode == "chunk")
        y = self.o_norm(y, z.view(Bsz, T, self.num_heads, self.head_dim))
        return self.proj(y.reshape(Bsz, T, -1))

