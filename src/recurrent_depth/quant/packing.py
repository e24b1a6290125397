"""Bit packing: b-bit indices in [0, 2^b) stored densely in uint8 bytes, ceil(n·b/8) bytes per vector.

One path for every code (1..8-bit indices, sign bits, and 16-bit raw values), so that the bytes a
code object reports are the bits the method claims, rounded up to a whole byte per field and vector.
Bits are written most significant first, value after value, across byte boundaries; the work is
done on whole chunks of lcm(b, 8) bits (8 values of 3 bits in 3 bytes, 2 values of 4 bits in 1 byte),
each assembled as one int64 word.
"""

from __future__ import annotations

import functools
import math

import torch

MAX_BITS = 16


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes that `count` values of `bits` bits take once packed."""
    return math.ceil(count * bits / 8)


# Widths whose lcm(b, 8)-bit chunk fits an int64 word: every codebook width (1..8) and the raw 16.
PACKABLE_BITS = tuple(b for b in range(1, MAX_BITS + 1) if math.lcm(b, 8) <= 56)


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or bits not in PACKABLE_BITS:
        raise ValueError(f"bits per packed value must be one of {PACKABLE_BITS}, got {bits!r}")


def _chunk(bits: int) -> tuple[int, int]:
    """(values, bytes) of the smallest whole-byte chunk: lcm(bits, 8) bits, at most 56 (fits an int64)."""
    chunk_bits = math.lcm(bits, 8)
    return chunk_bits // bits, chunk_bits // 8


@functools.cache
def _shifts(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(value shifts, byte shifts) of one chunk, made once per width and device (cache hot paths
    pack and unpack a few values per call, where building them each time would cost as much)."""
    per_chunk, chunk_bytes = _chunk(bits)
    return (torch.arange(per_chunk - 1, -1, -1, device=device) * bits,
            torch.arange(chunk_bytes - 1, -1, -1, device=device) * 8)


@functools.cache
def _byte_values(bits: int, device: torch.device) -> torch.Tensor:
    """[256, 8 / bits] int64: the values one byte holds, for widths that divide 8 (unpack is one lookup)."""
    value_shifts, _ = _shifts(bits, device)
    return (torch.arange(256, device=device)[:, None] >> value_shifts) & ((1 << bits) - 1)


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., n] integers in [0, 2^bits) -> [..., ceil(n·bits/8)] uint8."""
    _check_bits(bits)
    n = values.shape[-1]
    per_chunk, chunk_bytes = _chunk(bits)
    v = values.to(torch.int64)
    if n % per_chunk:
        v = torch.nn.functional.pad(v, (0, per_chunk - n % per_chunk))
    v = v.unflatten(-1, (-1, per_chunk))  # [..., chunks, values]
    value_shifts, byte_shifts = _shifts(bits, v.device)
    words = (v << value_shifts).sum(-1, keepdim=True)  # disjoint bit ranges: sum = or
    if chunk_bytes == 1:  # widths dividing 8: a chunk is one byte
        return words.squeeze(-1).to(torch.uint8)
    packed = ((words >> byte_shifts) & 0xFF).flatten(-2).to(torch.uint8)
    return packed[..., : packed_nbytes(n, bits)]  # trailing bytes past the last value are padding


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of `pack_bits`: [..., nbytes] uint8 -> [..., count] int64."""
    _check_bits(bits)
    if packed.dtype != torch.uint8 or packed.shape[-1] != packed_nbytes(count, bits):
        raise ValueError(
            f"packed codes must be uint8 [..., {packed_nbytes(count, bits)}] for {count} values of {bits} bits, "
            f"got {packed.dtype} {tuple(packed.shape)}"
        )
    per_chunk, chunk_bytes = _chunk(bits)
    if chunk_bytes == 1:
        return _byte_values(bits, packed.device)[packed.long()].flatten(-2)[..., :count]
    b = packed.to(torch.int64)
    if b.shape[-1] % chunk_bytes:
        b = torch.nn.functional.pad(b, (0, chunk_bytes - b.shape[-1] % chunk_bytes))
    b = b.unflatten(-1, (-1, chunk_bytes))  # [..., chunks, bytes]
    value_shifts, byte_shifts = _shifts(bits, b.device)
    words = (b << byte_shifts).sum(-1, keepdim=True)
    return ((words >> value_shifts) & ((1 << bits) - 1)).flatten(-2)[..., :count]
