"""Fractional bit widths by an outlier / regular channel split (TurboQuant's KV-cache setup).

For b bits per coordinate with lo = ⌊b⌋: n_out = (b − lo)·D outlier channels are coded at lo + 1 bits
and the other D − n_out regular channels at lo bits, each group by its own quantizer (its own
rotation, sketch and norms), so the average is exactly b. At D = 128, 2.5 bits = 64 channels at
3 bits + 64 at 2; 3.5 = 64 at 4 + 64 at 3; at D = 64 the groups are 32 + 32. (The TurboQuant paper
writes 2.5 bits as 32 outliers at 3 bits + 96 at 2 for D = 128, which averages 2.25 bits.)
(b − lo)·D must be a whole number of channels, and each group needs >= 2 channels.

Outlier channels are chosen by calibration, `select_outlier_channels(x, n_out)`: the n_out channels
with the largest mean square over every vector of a calibration tensor (e.g. a layer's prompt keys),
as QJL does for its outlier keys. Without calibration the first n_out channels are used: after
each group's own random rotation the split is then only a bit allocation, harmless on isotropic
data and no better. With rotation='hadamard', both group sizes must be powers of two (a
non-power-of-two group raises a ValueError suggesting rotation='qr'). The channel split is
quantizer state (a D-bit mask), shared by all vectors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from recurrent_depth.quant.base import Quantizer, derive_seed
from recurrent_depth.quant.codes import Codes, prefixed, unprefixed

GroupFactory = Callable[[int, int, int], Quantizer]  # (dim, bits, seed) -> quantizer


def split_sizes(dim: int, bits: float) -> tuple[int, int, int]:
    """(outlier channels, outlier bits, regular bits) for a fractional `bits` at `dim`."""
    lo = math.floor(bits)
    n_out = (bits - lo) * dim
    if abs(n_out - round(n_out)) > 1e-6:
        raise ValueError(f"{bits:g} bits at D = {dim} needs {n_out:g} outlier channels at {lo + 1} bits; "
                         f"choose bits so that (bits - {lo})·{dim} is a whole number")
    n_out = round(n_out)
    if min(n_out, dim - n_out) < 2:
        raise ValueError(f"{bits:g} bits at D = {dim} leaves a channel group of {min(n_out, dim - n_out)} "
                         "channels; each group needs at least 2")
    return n_out, lo + 1, lo


def select_outlier_channels(x: torch.Tensor, count: int) -> list[int]:
    """The `count` channels of x [..., D] with the largest mean square, in increasing order (ties: the
    lower channel first, so the choice is deterministic)."""
    if not 0 < count < x.shape[-1]:
        raise ValueError(f"outlier count must be in [1, {x.shape[-1] - 1}], got {count}")
    energy = x.detach().float().pow(2).reshape(-1, x.shape[-1]).mean(0)
    return sorted(energy.sort(descending=True, stable=True).indices[:count].tolist())


def checked_outlier_channels(channels: Sequence[int] | None, count: int, dim: int, what: str) -> list[int]:
    """`channels` (None: the first `count`) in increasing order; a ValueError that starts with `what`
    unless they are `count` distinct channels in [0, dim)."""
    given = range(count) if channels is None else channels
    out = sorted(int(c) for c in given)
    if len(set(out)) != count or not all(0 <= c < dim for c in out):
        raise ValueError(f"{what} needs {count} distinct outlier channels in [0, {dim}), got {list(given)}")
    return out


class ChannelSplit(Quantizer):
    def __init__(self, method: str, dim: int, bits: float, make_group: GroupFactory, seed: int = 0,
                 outlier_channels: Sequence[int] | None = None, spec_suffix: str = "") -> None:
        super().__init__(dim)
        self.method, self._bits, self.seed, self._suffix = method, float(bits), int(seed), spec_suffix
        n_out, hi, lo = split_sizes(dim, bits)
        outliers = checked_outlier_channels(outlier_channels, n_out, dim, f"{bits:g} bits at D = {dim}")
        regular = sorted(set(range(dim)) - set(outliers))
        self.outlier_channels, self.regular_channels = outliers, regular
        self.state_key = (self.seed, tuple(outliers))
        self._out_idx = torch.tensor(outliers)
        self._reg_idx = torch.tensor(regular)
        self.outlier = make_group(n_out, hi, derive_seed(seed, "outlier"))
        self.regular = make_group(dim - n_out, lo, derive_seed(seed, "regular"))
        self._make_group = make_group

    def calibrated(self, x: torch.Tensor) -> ChannelSplit:
        """The same quantizer with its outlier channels chosen from calibration data x [..., D]."""
        channels = select_outlier_channels(x, len(self.outlier_channels))
        return ChannelSplit(self.method, self.dim, self._bits, self._make_group, self.seed, channels, self._suffix)

    @property
    def bits(self) -> float:
        return self._bits

    @property
    def spec(self) -> str:
        return f"{self.method}:{self._bits:g}{self._suffix}"

    @property
    def bytes_per_vector(self) -> int:
        return self.outlier.bytes_per_vector + self.regular.bytes_per_vector

    @property
    def state_nbytes(self) -> int:
        return 8 + math.ceil(self.dim / 8)  # seed + outlier-channel mask

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.index_select(-1, self._out_idx.to(x.device)), x.index_select(-1, self._reg_idx.to(x.device))

    def _groups(self, codes: Codes) -> tuple[Codes, Codes]:
        self._check_codes(codes)
        return (unprefixed("outlier", codes, self.outlier.spec, self.outlier.dim, self.outlier.state_key),
                unprefixed("regular", codes, self.regular.spec, self.regular.dim, self.regular.state_key))

    def encode(self, x: torch.Tensor) -> Codes:
        out, reg = self._split(self._check_input(x))
        fields = {**prefixed("outlier", self.outlier.encode(out)), **prefixed("regular", self.regular.encode(reg))}
        return Codes(self.spec, self.dim, fields, self.state_key)

    def decode(self, codes: Codes) -> torch.Tensor:
        c_out, c_reg = self._groups(codes)
        out, reg = self.outlier.decode(c_out), self.regular.decode(c_reg)
        x = out.new_empty((*out.shape[:-1], self.dim))
        x[..., self._out_idx.to(x.device)] = out
        x[..., self._reg_idx.to(x.device)] = reg
        return x

    def score(self, q: torch.Tensor, codes: Codes) -> torch.Tensor:
        self._check_query(q)
        c_out, c_reg = self._groups(codes)
        q_out, q_reg = self._split(q.float())
        return self.outlier.score(q_out, c_out) + self.regular.score(q_reg, c_reg)

    def combine(self, weights: torch.Tensor, codes: Codes) -> torch.Tensor:
        c_out, c_reg = self._groups(codes)
        out, reg = self.outlier.combine(weights, c_out), self.regular.combine(weights, c_reg)
        x = out.new_empty((*out.shape[:-1], self.dim))
        x[..., self._out_idx.to(x.device)] = out
        x[..., self._reg_idx.to(x.device)] = reg
        return x
