"""QJL (Zandieh, Daliri, Han, arXiv 2406.03482): 1-bit quantized Johnson–Lindenstrauss keys.

Stores sign(S k) ∈ {±1}^m (m bits) and ‖k‖ (fp16) with S ∈ R^{m×D} iid N(0, 1); the query stays
full precision: ⟨q, k⟩ ≈ (√(π/2)/m)·‖k‖·⟨S q, sign(S k)⟩, unbiased over S with variance
≤ (π/(2m))·‖q‖²‖k‖². The sketch size m is free (`sketch`); the official code keys 128-dim heads
with m = 256 (2 sign bits per coordinate), 512 in the first layers. No rotation is needed: S is
already rotation invariant. The dequantize path returns (√(π/2)/m)·‖k‖·Sᵀ sign(S k).
"""

from __future__ import annotations

import math

import torch

from recurrent_depth.quant.base import Quantizer, derive_seed, store_norm
from recurrent_depth.quant.codes import Codes
from recurrent_depth.quant.packing import pack_bits, packed_nbytes, unpack_bits
from recurrent_depth.quant.rotation import gaussian_matrix, on_device

# Sign bits per coordinate at most (m <= 16·D): past it the sketch costs more than the bf16 vector, and
# S [m, D] plus the per-vector signs grow without bound (a spec is text a server's client may send).
MAX_QJL_BITS = 16


class QJL(Quantizer):
    method = "qjl"

    def __init__(self, dim: int, sketch: int | None = None, seed: int = 0) -> None:
        super().__init__(dim)
        sketch = dim if sketch is None else sketch
        if isinstance(sketch, bool) or not isinstance(sketch, int) or sketch < 1:
            raise ValueError(f"qjl sketch size m must be a positive int, got {sketch!r}")
        if sketch > MAX_QJL_BITS * dim:
            raise ValueError(f"qjl sketch size m must be at most {MAX_QJL_BITS}·D = {MAX_QJL_BITS * dim}, got {sketch}")
        self.sketch_size, self.seed = sketch, int(seed)
        self._sketch_seed = derive_seed(seed, "qjl")
        self.scale = math.sqrt(math.pi / 2) / sketch

    @property
    def bits(self) -> float:
        return self.sketch_size / self.dim

    @property
    def bytes_per_vector(self) -> int:
        return packed_nbytes(self.sketch_size, 1) + 2

    def sketch(self, like: torch.Tensor) -> torch.Tensor:
        """S [m, D] on `like`'s device."""
        return on_device(gaussian_matrix, self.sketch_size, self.dim, self._sketch_seed, device=like.device)

    def encode(self, x: torch.Tensor) -> Codes:
        x = self._check_input(x)
        signs = pack_bits((x @ self.sketch(x).T >= 0).to(torch.int64), 1)
        norm = store_norm(x.norm(dim=-1, keepdim=True), "key norm")
        return Codes(self.spec, self.dim, {"signs": signs, "norm": norm})

    def _weighted_signs(self, codes: Codes) -> torch.Tensor:
        self._check_codes(codes)
        signs = unpack_bits(codes.fields["signs"], 1, self.sketch_size).float() * 2 - 1
        return self.scale * codes.fields["norm"].float() * signs  # [..., m]

    def decode(self, codes: Codes) -> torch.Tensor:
        ws = self._weighted_signs(codes)
        return ws @ self.sketch(ws)

    def score(self, q: torch.Tensor, codes: Codes) -> torch.Tensor:
        self._check_query(q)
        q = q.float()
        return (q @ self.sketch(q).T) @ self._weighted_signs(codes).mT
