"""QJL (Zandieh, Daliri, Han, arXiv 2406.03482): 1-bit quantized Johnson–Lindenstrauss keys.

Stores sign(S k) ∈ {±1}^m (m bits) and ‖k‖ (fp16) with S ∈ R^{m×D} iid N(0, 1); the query stays
full precision: ⟨q, k⟩ ≈ (√(π/2)/m)·‖k‖·⟨S q, sign(S k)⟩, unbiased over S with variance
≤ (π/(2m))·‖q‖²‖k‖². The sketch size m is free (`sketch`); the official code keys 128-dim heads
with m = 256 (2 sign bits per coordinate), 512 in the first layers. No rotation is needed: S is
already rotation invariant. The dequantize path returns (√(π/2)/m)·‖k‖·Sᵀ sign(S k).

Outlier channels (`outliers=n`, spec `qjl:2:out4`): the published method keeps a head's few
large-magnitude key channels out of the sketch, because the estimator's variance scales with
‖k‖² and a handful of channels can hold most of it. Here the n outlier channels are stored as bf16
(2 bytes each) and the sketch, S ∈ R^{m×(D−n)}, codes the D − n regular channels with their own
norm: ⟨q, k⟩ ≈ ⟨q_out, bf16(k_out)⟩ + (√(π/2)/m)·‖k_reg‖·⟨S q_reg, sign(S k_reg)⟩, so the
variance drops to ≤ (π/(2m))·‖q_reg‖²‖k_reg‖². (The official code codes the outliers with a second,
larger sketch instead of bf16.) Which channels: `outlier_channels` (default 0..n−1), chosen from
calibration data by `calibrated(x)` (the n channels of largest mean square, as the paper picks them
per head from the prompt); the cache calibrates each KV head from its first write (`outliers=`
rule of `KVQuant`). The channel set is quantizer state (a D-bit mask).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from recurrent_depth.quant.base import Quantizer, derive_seed, store_norm
from recurrent_depth.quant.codes import Codes
from recurrent_depth.quant.packing import pack_bits, packed_nbytes, unpack_bits
from recurrent_depth.quant.rotation import gaussian_matrix, on_device
from recurrent_depth.quant.split import checked_outlier_channels, select_outlier_channels

# Sign bits per coordinate at most (m <= 16·D): past it the sketch costs more than the bf16 vector, and
# S [m, D] plus the per-vector signs grow without bound (a spec is text a server's client may send).
MAX_QJL_BITS = 16
OUTLIER_DTYPE = torch.bfloat16  # the outlier channels' stored values, 2 bytes each


class QJL(Quantizer):
    method = "qjl"

    def __init__(self, dim: int, sketch: int | None = None, seed: int = 0, outliers: int = 0,
                 outlier_channels: Sequence[int] | None = None) -> None:
        super().__init__(dim)
        sketch = dim if sketch is None else sketch
        if isinstance(sketch, bool) or not isinstance(sketch, int) or sketch < 1:
            raise ValueError(f"qjl sketch size m must be a positive int, got {sketch!r}")
        if sketch > MAX_QJL_BITS * dim:
            raise ValueError(f"qjl sketch size m must be at most {MAX_QJL_BITS}·D = {MAX_QJL_BITS * dim}, got {sketch}")
        if isinstance(outliers, bool) or not isinstance(outliers, int) or not 0 <= outliers < dim:
            raise ValueError(f"qjl outlier channels must be an int in [0, D − 1] = [0, {dim - 1}] (at least one "
                             f"channel stays in the sketch), got {outliers!r}")
        if sketch + 16 * outliers > MAX_QJL_BITS * dim:  # signs + bf16 outliers: at most the bf16 vector's bits
            raise ValueError(f"qjl with sketch m = {sketch} and {outliers} bf16 outlier channels stores "
                             f"{sketch + 16 * outliers} bits, more than the {16 * dim} of the bf16 vector (D = {dim})")
        channels = checked_outlier_channels(outlier_channels, outliers, dim, f"qjl with {outliers} outlier channels "
                                            f"at D = {dim}")
        self.sketch_size, self.seed, self.outliers = sketch, int(seed), outliers
        self.outlier_channels = channels
        self.state_key = (self.seed, tuple(channels))
        self.regular_channels = sorted(set(range(dim)) - set(channels))
        self._out_idx, self._reg_idx = torch.tensor(channels, dtype=torch.long), torch.tensor(self.regular_channels)
        self._sketch_seed = derive_seed(seed, "qjl")  # unchanged by outliers: qjl:b without them is as before
        self.scale = math.sqrt(math.pi / 2) / sketch

    @property
    def bits(self) -> float:
        return self.sketch_size / self.dim

    @property
    def spec(self) -> str:
        return f"{self.method}:{self.bits:g}" + (f":out{self.outliers}" if self.outliers else "")

    @property
    def bytes_per_vector(self) -> int:
        out = self.outliers * torch.tensor([], dtype=OUTLIER_DTYPE).element_size()
        return packed_nbytes(self.sketch_size, 1) + 2 + out

    @property
    def state_nbytes(self) -> int:
        return 8 + (math.ceil(self.dim / 8) if self.outliers else 0)  # seed (+ the outlier-channel mask)

    def calibrated(self, x: torch.Tensor) -> QJL:
        """The same quantizer with its outlier channels chosen from calibration data x [..., D]."""
        if not self.outliers:
            return self
        return QJL(self.dim, self.sketch_size, self.seed, self.outliers, select_outlier_channels(x, self.outliers))

    def sketch(self, like: torch.Tensor) -> torch.Tensor:
        """S [m, D − n] on `like`'s device."""
        return on_device(gaussian_matrix, self.sketch_size, self.dim - self.outliers, self._sketch_seed,
                         device=like.device)

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., D] -> (outlier channels [..., n], regular channels [..., D − n]); no copy without outliers."""
        if not self.outliers:
            return x[..., :0], x
        return x.index_select(-1, self._out_idx.to(x.device)), x.index_select(-1, self._reg_idx.to(x.device))

    def encode(self, x: torch.Tensor) -> Codes:
        out, reg = self._split(self._check_input(x))
        signs = pack_bits((reg @ self.sketch(reg).T >= 0).to(torch.int64), 1)
        norm = store_norm(reg.norm(dim=-1, keepdim=True), "key norm")
        fields = {"signs": signs, "norm": norm}
        if self.outliers:
            fields["outliers"] = out.to(OUTLIER_DTYPE)
        return Codes(self.spec, self.dim, fields, self.state_key)

    def _weighted_signs(self, codes: Codes) -> torch.Tensor:
        self._check_codes(codes)
        signs = unpack_bits(codes.fields["signs"], 1, self.sketch_size).float() * 2 - 1
        return self.scale * codes.fields["norm"].float() * signs  # [..., m]

    def decode(self, codes: Codes) -> torch.Tensor:
        ws = self._weighted_signs(codes)
        reg = ws @ self.sketch(ws)
        if not self.outliers:
            return reg
        x = reg.new_empty((*reg.shape[:-1], self.dim))
        x[..., self._reg_idx.to(x.device)] = reg
        x[..., self._out_idx.to(x.device)] = codes.fields["outliers"].float()
        return x

    def score(self, q: torch.Tensor, codes: Codes) -> torch.Tensor:
        self._check_query(q)
        q_out, q_reg = self._split(q.float())
        scores = (q_reg @ self.sketch(q_reg).T) @ self._weighted_signs(codes).mT
        if self.outliers:
            scores = scores + q_out @ codes.fields["outliers"].float().mT
        return scores
