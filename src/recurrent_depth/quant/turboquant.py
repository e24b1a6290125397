"""TurboQuant (Zandieh et al., arXiv 2504.19874): TurboQuant_mse and TurboQuant_prod.

TurboQuant_mse (b bits): y = Π(x/‖x‖); idx_j = nearest Lloyd–Max centroid of the sphere-coordinate
density in dimension D; stores b·D bits + ‖x‖ (fp16). x̃ = ‖x‖·Πᵀ c[idx]. Theorem 1 (unit x):
E‖x − x̃‖² ≤ (√3·π/2)·4^{−b}.

TurboQuant_prod (b bits): TurboQuant_mse at b − 1 bits, then 1-bit QJL on the residual
r = Πx/n − c[idx] with a D×D Gaussian S, n = fp16(‖x‖) the stored norm: stores idx, sign(S r)
(D bits), n (fp16) and ‖r‖ as an 8-bit fraction (see `residual_code`), 3 norm bytes instead of two
fp16 norms. x̃ = n·Πᵀ(c[idx] + (√(π/2)/D)·ρ·Sᵀ sign(S r)), with ρ the stored ‖r‖, is unbiased for
inner products (over S and the rounding), with Theorem 2: Var⟨y, x̃⟩ ≤ (√3·π²·‖y‖²/D)·4^{−b}.
b = 1 is pure QJL on the rotated unit vector. The residual is taken against the stored norm, so the
QJL stage also absorbs the fp16 rounding of ‖x‖. It is sketched in the rotated basis: S·Π is again
iid Gaussian, so this is the paper's estimator, and encoding and scoring skip the inverse rotation.

The residual fraction. ‖r‖ ≤ √(1 + D·c_min²) (+ the fp16 rounding of n), c_min the smallest
centroid magnitude: the nearest centroid is at least as close as ±c_min, so |r_j| ≤ max(|y_j|, c_min).
ρ is stored as an integer q in [0, 255] on a grid of that range, rounded stochastically: q =
⌊‖r‖/Δ + u⌋ with u uniform in [0, 1), so E[qΔ] = ‖r‖ and the estimator stays unbiased. u is a hash
of the vector's sign bits with seeded random weights (u = (m₀ + Σ_j s_j·m_j mod 2²⁴)/2²⁴): uniform
over the seed for every sign pattern, independent of S, and reproducible (integer arithmetic, the
same on every device and in `TurboRows`).
"""

from __future__ import annotations

import functools
import math

import torch

from recurrent_depth.quant.base import (
    RotatedQuantizer,
    ScalarCodebook,
    derive_seed,
    store_norm,
    stored_ratio,
    unit_and_norm,
)
from recurrent_depth.quant.codebook import MAX_CODEBOOK_BITS, sphere_codebook
from recurrent_depth.quant.codes import Codes
from recurrent_depth.quant.packing import pack_bits, packed_nbytes, unpack_bits
from recurrent_depth.quant.rotation import gaussian_matrix, on_device

RESIDUAL_LEVELS = 255  # the residual norm's fraction is one byte: q in [0, 255]
HASH_BITS = 24  # the stochastic rounding's u has 2^24 levels


@functools.lru_cache(maxsize=256)
def dither_weights(dim: int, seed: int) -> torch.Tensor:
    """[dim + 1] int64 in [0, 2^24): m_1..m_D (one per sign bit), then the offset m_0."""
    return torch.randint(0, 1 << HASH_BITS, (dim + 1,), generator=torch.Generator().manual_seed(seed))


def residual_code(residual_norm: torch.Tensor, signs: torch.Tensor, weights: torch.Tensor,
                  step: float) -> torch.Tensor:
    """‖r‖ [..., 1] float32 as uint8 [..., 1]: stochastic rounding of ‖r‖ / step, u hashed from the sign
    bits [..., D] (0/1 integers) with `dither_weights` (see the module docstring)."""
    h = ((signs * weights[:-1]).sum(-1, keepdim=True) + weights[-1]) % (1 << HASH_BITS)
    u = (h.double() + 0.5) / (1 << HASH_BITS)
    q = torch.floor(residual_norm.double() / step + u)
    return q.clamp(0, RESIDUAL_LEVELS).to(torch.uint8)


def _check_int_bits(method: str, bits: object, lo: int, hi: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int | float) or bits != int(bits) or not lo <= bits <= hi:
        raise ValueError(f"{method} bits must be an integer in [{lo}, {hi}] here (use a channel split for "
                         f"fractional bits), got {bits!r}")
    return int(bits)


class TurboQuantMSE(RotatedQuantizer):
    method = "mse"

    def __init__(self, dim: int, bits: int, rotation: str = "qr", seed: int = 0) -> None:
        self._bits = _check_int_bits("mse", bits, 1, MAX_CODEBOOK_BITS)
        if dim < 2:
            raise ValueError(f"mse needs D >= 2 (one coordinate of a unit vector is ±1), got D = {dim}")
        super().__init__(dim, rotation, seed)
        self.codebook = ScalarCodebook(sphere_codebook(dim, self._bits), self._bits)

    @property
    def bits(self) -> float:
        return self._bits

    @property
    def bytes_per_vector(self) -> int:
        return self.codebook.nbytes(self.dim) + 2

    def encode(self, x: torch.Tensor) -> Codes:
        unit, norm = unit_and_norm(self._check_input(x))
        idx = self.codebook.encode(self.rotation.forward(unit))
        return Codes(self.spec, self.dim, {"idx": idx, "norm": store_norm(norm, "vector norm")}, self.state_key)

    def _rotated(self, codes: Codes) -> torch.Tensor:
        self._check_codes(codes)
        return self.codebook.decode(codes.fields["idx"], self.dim) * codes.fields["norm"].float()


class TurboQuantProd(RotatedQuantizer):
    method = "prod"

    def __init__(self, dim: int, bits: int, rotation: str = "qr", seed: int = 0) -> None:
        self._bits = _check_int_bits("prod", bits, 1, MAX_CODEBOOK_BITS + 1)
        if dim < 2:
            raise ValueError(f"prod needs D >= 2, got D = {dim}")
        super().__init__(dim, rotation, seed)
        self.codebook = ScalarCodebook(sphere_codebook(dim, self._bits - 1), self._bits - 1) if self._bits > 1 else None
        self._sketch_seed = derive_seed(seed, "qjl")
        self._dither_seed = derive_seed(seed, "dither")
        self.scale = math.sqrt(math.pi / 2) / dim
        c_min = min(abs(c) for c in self.codebook.centroids) if self.codebook else 0.0
        # The grid of ‖r‖: [0, √(1 + D·c_min²)] plus a margin for the fp16 rounding of the norm.
        self.residual_step = (math.sqrt(1 + dim * c_min**2) + 2.0**-8) / RESIDUAL_LEVELS

    @property
    def bits(self) -> float:
        return self._bits

    @property
    def bytes_per_vector(self) -> int:
        mse = self.codebook.nbytes(self.dim) if self.codebook else 0
        return mse + packed_nbytes(self.dim, 1) + 2 + 1  # fp16 norm + the residual norm's byte

    def dither(self, like: torch.Tensor) -> torch.Tensor:
        """The stochastic rounding's hash weights (`dither_weights`) on `like`'s device."""
        return on_device(dither_weights, self.dim, self._dither_seed, device=like.device)

    def sketch(self, like: torch.Tensor) -> torch.Tensor:
        """S [D, D] (rows are the sketch), on `like`'s device."""
        return on_device(gaussian_matrix, self.dim, self.dim, self._sketch_seed, device=like.device)

    def encode(self, x: torch.Tensor) -> Codes:
        unit, norm = unit_and_norm(self._check_input(x))
        y = self.rotation.forward(unit)
        stored = store_norm(norm, "vector norm")
        fields: dict[str, torch.Tensor] = {}
        if self.codebook is not None:
            fields["idx"] = self.codebook.encode(y)
        y = y * stored_ratio(norm, stored)  # Πx / n: the residual absorbs the norm's rounding
        if self.codebook is not None:
            y = y - self.codebook.decode(fields["idx"], self.dim)
        signs = (y @ self.sketch(y).T >= 0).to(torch.int64)
        fields["signs"] = pack_bits(signs, 1)
        fields["norm"] = stored
        fields["residual"] = residual_code(y.norm(dim=-1, keepdim=True), signs, self.dither(y), self.residual_step)
        return Codes(self.spec, self.dim, fields, self.state_key)

    def _residual_norm(self, codes: Codes) -> torch.Tensor:
        """n·ρ [..., 1]: the stored norm times the stored residual norm."""
        return codes.fields["norm"].float() * (codes.fields["residual"].float() * self.residual_step)

    def _signs(self, codes: Codes) -> torch.Tensor:
        return unpack_bits(codes.fields["signs"], 1, self.dim).float() * 2 - 1

    def _mse_part(self, codes: Codes) -> torch.Tensor | None:
        if self.codebook is None:
            return None
        return self.codebook.decode(codes.fields["idx"], self.dim) * codes.fields["norm"].float()

    def _rotated(self, codes: Codes) -> torch.Tensor:
        self._check_codes(codes)
        signs = self._signs(codes)
        out = self.scale * self._residual_norm(codes) * (signs @ self.sketch(signs))
        mse = self._mse_part(codes)
        return out if mse is None else out + mse

    def score(self, q: torch.Tensor, codes: Codes) -> torch.Tensor:
        # ⟨q, x̃⟩ = ⟨Πq, n·c[idx]⟩ + (√(π/2)/D)·n·ρ·⟨S Πq, sign(S r)⟩: no D×D product per key.
        self._check_query(q)
        self._check_codes(codes)
        qr = self.rotation.forward(q.float())
        weighted_signs = self._signs(codes) * self._residual_norm(codes)
        out = self.scale * (qr @ self.sketch(qr).T) @ weighted_signs.mT
        mse = self._mse_part(codes)
        return out if mse is None else out + qr @ mse.mT
