"""Bit packing: b-bit indices in [0, 2^b) stored densely in uint8 bytes, ceil(n·b/8) bytes per vector.

One path for every code (1..8-bit indices, sign bits, and 16-bit raw values), so that the bytes a
code object reports are the bits the method claims, rounded up to a whole byte per field and vector.
Bits are written most significant first, value after value, across byte boundaries.
"""

from __future__ import annotations

import math

import torch

MAX_BITS = 16


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes that `count` values of `bits` bits take once packed."""
    return math.ceil(count * bits / 8)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits per packed value must be an int in [1, {MAX_BITS}], got {bits!r}")


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n] integers in [0, 2^bits) -> [..., ceil(n·bits/8)] uint8."""
    _check_bits(bits)
    n = values.shape[-1]
    v = values.to(torch.int32)
    shifts = torch.arange(bits - 1, -1, -1, device=v.device, dtype=torch.int32)
    stream = ((v.unsqueeze(-1) >> shifts) & 1).flatten(-2)  # [..., n*bits]
    pad = packed_nbytes(n, bits) * 8 - n * bits
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], device=v.device, dtype=torch.int32)
    stream = stream.unflatten(-1, (-1, 8))  # [..., nbytes, 8]
    return (stream * weights).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of `pack_bits`: [..., nbytes] uint8 -> [..., count] int64."""
    _check_bits(bits)
    if packed.dtype != torch.uint8 or packed.shape[-1] != packed_nbytes(count, bits):
        raise ValueError(
            f"packed codes must be uint8 [..., {packed_nbytes(count, bits)}] for {count} values of {bits} bits, "
            f"got {packed.dtype} {tuple(packed.shape)}"
        )
    shifts = torch.arange(7, -1, -1, device=packed.device, dtype=torch.int32)
    stream = ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1).flatten(-2)[..., : count * bits]
    stream = stream.unflatten(-1, (count, bits))  # [..., count, bits]
    weights = torch.tensor([1 << (bits - 1 - i) for i in range(bits)], device=packed.device, dtype=torch.int32)
    return (stream * weights).sum(-1).to(torch.int64)
