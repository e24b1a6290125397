"""The raw 16-bit codec: fp16 / bf16 values, bit-cast and stored through the same packing path.

Decoding returns the input exactly (rounded once to the codec's dtype), which checks the packed
storage end to end and gives a cache policy an uncompressed baseline with the same interface.
"""

from __future__ import annotations

import torch

from recurrent_depth.quant.base import Quantizer
from recurrent_depth.quant.codes import Codes
from recurrent_depth.quant.packing import pack_bits, packed_nbytes, unpack_bits

RAW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Raw16(Quantizer):
    method = "raw"

    def __init__(self, dim: int, dtype: str = "bf16") -> None:
        super().__init__(dim)
        if dtype not in RAW_DTYPES:
            raise ValueError(f"raw dtype must be one of {', '.join(RAW_DTYPES)}, got {dtype!r}")
        self.dtype_name, self.dtype = dtype, RAW_DTYPES[dtype]

    @property
    def bits(self) -> float:
        return 16

    @property
    def spec(self) -> str:
        return f"raw:16:{self.dtype_name}"

    @property
    def bytes_per_vector(self) -> int:
        return packed_nbytes(self.dim, 16)

    @property
    def state_nbytes(self) -> int:
        return 0

    def encode(self, x: torch.Tensor) -> Codes:
        self._check_input(x)
        values = x.to(self.dtype)
        # fp16 tops out at 65504: a silent inf would poison attention (bf16's range is float32's: no check, no sync)
        if self.dtype == torch.float16 and not torch.isfinite(values).all():
            raise ValueError(f"{self.spec} cannot hold values beyond {self.dtype_name}'s range "
                             f"({torch.finfo(self.dtype).max:g}): got {x.abs().max().item():g}; use raw:16 (bf16)")
        words = values.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
        return Codes(self.spec, self.dim, {"values": pack_bits(words, 16)})

    def decode(self, codes: Codes) -> torch.Tensor:
        self._check_codes(codes)
        words = unpack_bits(codes.fields["values"], 16, self.dim)
        words = torch.where(words >= 1 << 15, words - (1 << 16), words).to(torch.int16)
        return words.view(self.dtype).float()
