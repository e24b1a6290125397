"""PolarQuant (Han, Kacham, Karbasi, Mirrokni, Zandieh, arXiv 2502.02617).

After a random rotation, each block of 2^L coordinates goes through a recursive polar transform:
level 1 pairs coordinates (x_{2i}, x_{2i+1}) into a radius and an angle in [0, 2π); level ℓ ≥ 2
pairs radii into a radius and an angle in [0, π/2]. A block ends as one radius (fp16) and
2^L − 1 angles, each coded with a fixed per-level Lloyd–Max codebook (level 1 uniform, level ℓ
density ∝ sin^{2^{ℓ−1}−1}(2ψ)): no per-block scale or zero point. The reference layout is
L = 4 (16-coordinate blocks), 4 bits for the 8 level-1 angles and 2 bits for the 4 + 2 + 1 angles
above: (32 + 8 + 4 + 2 + 16)/16 = 3.875 bits per coordinate.
"""

from __future__ import annotations

import math

import torch

from recurrent_depth.quant.base import RotatedQuantizer, ScalarCodebook, store_norm
from recurrent_depth.quant.codebook import polar_angle_codebook
from recurrent_depth.quant.codes import Codes

REFERENCE_LEVEL_BITS = (4, 2, 2, 2)


def _interleave(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.stack((a, b), dim=-1).flatten(-2)


class PolarQuant(RotatedQuantizer):
    method = "polar"

    def __init__(self, dim: int, level_bits: tuple[int, ...] = REFERENCE_LEVEL_BITS, rotation: str = "qr",
                 seed: int = 0) -> None:
        level_bits = tuple(level_bits)
        if not level_bits or any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 8
                                 for b in level_bits):
            raise ValueError(f"polar level_bits must be 1..8-bit ints, one per level, got {level_bits!r}")
        self.level_bits = level_bits
        self.block = 1 << len(level_bits)
        if dim % self.block:
            raise ValueError(f"polar with {len(level_bits)} levels codes blocks of {self.block} coordinates; "
                             f"D = {dim} is not a multiple of {self.block}")
        super().__init__(dim, rotation, seed)
        self.blocks = dim // self.block
        self.codebooks = [ScalarCodebook(polar_angle_codebook(level, b), b) for level, b in enumerate(level_bits, 1)]

    def _angles_per_vector(self, level: int) -> int:
        return self.blocks * (self.block >> level)

    @property
    def bits(self) -> float:
        angle_bits = sum(b * (self.block >> level) for level, b in enumerate(self.level_bits, 1))
        return (angle_bits + 16) / self.block

    @property
    def spec(self) -> str:
        layout = "" if self.level_bits == REFERENCE_LEVEL_BITS else f"[{','.join(map(str, self.level_bits))}]"
        suffix = "" if self.rotation.kind == "qr" else f":{self.rotation.kind}"
        return f"polar:{self.bits:g}{layout}{suffix}"

    @property
    def bytes_per_vector(self) -> int:
        angles = sum(cb.nbytes(self._angles_per_vector(level)) for level, cb in enumerate(self.codebooks, 1))
        return angles + 2 * self.blocks

    def encode(self, x: torch.Tensor) -> Codes:
        y = self.rotation.forward(self._check_input(x))
        r = y.unflatten(-1, (self.blocks, self.block))  # [..., blocks, 2^L]
        fields = {}
        for level, cb in enumerate(self.codebooks, 1):
            a, b = r[..., 0::2], r[..., 1::2]
            angle = torch.atan2(b, a)
            if level == 1:
                angle = torch.remainder(angle, 2 * math.pi)
            fields[f"angles{level}"] = cb.encode(angle.flatten(-2))
            r = torch.hypot(a, b)
        fields["radius"] = store_norm(r.flatten(-2), "block radius")  # [..., blocks]
        return Codes(self.spec, self.dim, fields, self.state_key)

    def _rotated(self, codes: Codes) -> torch.Tensor:
        self._check_codes(codes)
        r = codes.fields["radius"].float().unsqueeze(-1)  # [..., blocks, 1]
        for level in range(len(self.codebooks), 0, -1):
            count = self._angles_per_vector(level)
            angle = self.codebooks[level - 1].decode(codes.fields[f"angles{level}"], count)
            angle = angle.unflatten(-1, (self.blocks, count // self.blocks))
            r = _interleave(r * torch.cos(angle), r * torch.sin(angle))
        return r.flatten(-2)
