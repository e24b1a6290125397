"""TurboQuant (Zandieh et al., arXiv 2504.19874): TurboQuant_mse and TurboQuant_prod.

TurboQuant_mse (b bits): y = Π(x/‖x‖); idx_j = nearest Lloyd–Max centroid of the sphere-coordinate
density in dimension D; stores b·D bits + ‖x‖ (fp16). x̃ = ‖x‖·Πᵀ c[idx]. Theorem 1 (unit x):
E‖x − x̃‖² ≤ (√3·π/2)·4^{−b}.

TurboQuant_prod (b bits): TurboQuant_mse at b − 1 bits, then 1-bit QJL on the residual
r = y − c[idx] with a D×D Gaussian S: stores idx, sign(S r) (D bits), ‖x‖ and ‖x‖·‖r‖ (fp16 each).
x̃ = ‖x‖·Πᵀ(c[idx] + (√(π/2)/D)·‖r‖·Sᵀ sign(S r)) is unbiased for inner products (over S), with
Theorem 2: Var⟨y, x̃⟩ ≤ (√3·π²·‖y‖²/D)·4^{−b}. b = 1 is pure QJL on the rotated unit vector.
The residual is sketched in the rotated basis: S·Π is again iid Gaussian, so this is the paper's
estimator, and encoding and scoring skip the inverse rotation.
"""

from __future__ import annotations

import math

import torch

from recurrent_depth.quant.base import RotatedQuantizer, ScalarCodebook, derive_seed, store_norm, unit_and_norm
from recurrent_depth.quant.codebook import MAX_CODEBOOK_BITS, sphere_codebook
from recurrent_depth.quant.codes import Codes
from recurrent_depth.quant.packing import pack_bits, packed_nbytes, unpack_bits
from recurrent_depth.quant.rotation import gaussian_matrix, on_device


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
        return Codes(self.spec, self.dim, {"idx": idx, "norm": store_norm(norm, "vector norm")})

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
        self.scale = math.sqrt(math.pi / 2) / dim

    @property
    def bits(self) -> float:
        return self._bits

    @property
    def bytes_per_vector(self) -> int:
        mse = self.codebook.nbytes(self.dim) if self.codebook else 0
        return mse + packed_nbytes(self.dim, 1) + 2 + 2

    def sketch(self, like: torch.Tensor) -> torch.Tensor:
        """S [D, D] (rows are the sketch), on `like`'s device."""
        return on_device(gaussian_matrix, self.dim, self.dim, self._sketch_seed, device=like.device)

    def encode(self, x: torch.Tensor) -> Codes:
        unit, norm = unit_and_norm(self._check_input(x))
        y = self.rotation.forward(unit)
        fields: dict[str, torch.Tensor] = {}
        if self.codebook is not None:
            fields["idx"] = self.codebook.encode(y)
            y = y - self.codebook.decode(fields["idx"], self.dim)
        fields["signs"] = pack_bits((y @ self.sketch(y).T >= 0).to(torch.int64), 1)
        fields["norm"] = store_norm(norm, "vector norm")
        fields["residual_norm"] = store_norm(norm * y.norm(dim=-1, keepdim=True), "residual norm")
        return Codes(self.spec, self.dim, fields)

    def _signs(self, codes: Codes) -> torch.Tensor:
        return unpack_bits(codes.fields["signs"], 1, self.dim).float() * 2 - 1

    def _mse_part(self, codes: Codes) -> torch.Tensor | None:
        if self.codebook is None:
            return None
        return self.codebook.decode(codes.fields["idx"], self.dim) * codes.fields["norm"].float()

    def _rotated(self, codes: Codes) -> torch.Tensor:
        self._check_codes(codes)
        signs = self._signs(codes)
        out = self.scale * codes.fields["residual_norm"].float() * (signs @ self.sketch(signs))
        mse = self._mse_part(codes)
        return out if mse is None else out + mse

    def score(self, q: torch.Tensor, codes: Codes) -> torch.Tensor:
        # ⟨q, x̃⟩ = ⟨Πq, ‖x‖c[idx]⟩ + (√(π/2)/D)·‖x‖‖r‖·⟨S Πq, sign(S r)⟩: no D×D product per key.
        self._check_query(q)
        self._check_codes(codes)
        qr = self.rotation.forward(q.float())
        weighted_signs = self._signs(codes) * codes.fields["residual_norm"].float()
        out = self.scale * (qr @ self.sketch(qr).T) @ weighted_signs.mT
        mse = self._mse_part(codes)
        return out if mse is None else out + qr @ mse.mT
