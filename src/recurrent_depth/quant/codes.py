"""`Codes`: the packed code of a [..., D] tensor, the only thing a quantized cache needs to keep.

Every field is a tensor whose leading shape is the input's leading shape: packed indices and sign
bits as uint8 [..., nbytes], norms and radii as fp16 [..., k]. `nbytes` is the sum of the fields'
storage, so the bytes reported are exactly the bytes held; the quantizer's own state (a seed, a
channel split) is shared by every vector and reported separately (`Quantizer.state_nbytes`).
Codes of one quantizer concatenate and slice along leading axes, e.g. the token axis of a cache.
`state` names the quantizer state that made them (its seed, its outlier channels: `Quantizer.state_key`),
so that codes handed to a quantizer of the same spec but another seed or calibration are refused rather
than decoded to noise.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Codes:
    method: str  # the quantizer's spec string, e.g. "prod:3.5"
    dim: int  # D of the encoded vectors
    fields: dict[str, torch.Tensor]
    state: tuple = ()  # the quantizer state that made them (`Quantizer.state_key`), not stored per vector

    def __post_init__(self) -> None:
        shapes = {tuple(t.shape[:-1]) for t in self.fields.values()}
        assert len(shapes) == 1, f"code fields disagree on the leading shape: {shapes}"

    @property
    def shape(self) -> tuple[int, ...]:
        """The encoded tensor's shape, [..., D]."""
        return (*next(iter(self.fields.values())).shape[:-1], self.dim)

    def tensors(self) -> Iterator[torch.Tensor]:
        yield from self.fields.values()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.fields.values())

    @property
    def bytes_per_vector(self) -> int:
        return sum(t.shape[-1] * t.element_size() for t in self.fields.values())

    def _leading_axis(self, axis: int) -> int:
        n = len(self.shape) - 1
        if not -n <= axis < n:
            raise ValueError(f"axis {axis} is not a leading axis of codes for a tensor of shape {self.shape}")
        return axis % n

    def narrow(self, axis: int, start: int, length: int) -> Codes:
        axis = self._leading_axis(axis)
        return replace(self, fields={k: t.narrow(axis, start, length) for k, t in self.fields.items()})

    def to(self, device: torch.device | str) -> Codes:
        return replace(self, fields={k: t.to(device) for k, t in self.fields.items()})

    @staticmethod
    def cat(codes: Sequence[Codes], axis: int) -> Codes:
        """Concatenate codes of the same quantizer along a leading axis (e.g. tokens)."""
        if not codes:
            raise ValueError("Codes.cat needs at least one code object")
        first = codes[0]
        for c in codes[1:]:
            if (c.method, c.dim, c.fields.keys()) != (first.method, first.dim, first.fields.keys()):
                raise ValueError(f"cannot concatenate codes of {c.method!r} (D={c.dim}) with {first.method!r} "
                                 f"(D={first.dim})")
            if c.state != first.state:
                raise ValueError(f"cannot concatenate codes of {c.method!r} (D={c.dim}) made by quantizers with "
                                 "different seeds or outlier channels")
        axis = first._leading_axis(axis)
        return replace(first, fields={k: torch.cat([c.fields[k] for c in codes], axis) for k in first.fields})


def prefixed(prefix: str, codes: Codes) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{k}": t for k, t in codes.fields.items()}


def unprefixed(prefix: str, codes: Codes, method: str, dim: int, state: tuple) -> Codes:
    start = f"{prefix}."
    return Codes(method, dim, {k[len(start):]: t for k, t in codes.fields.items() if k.startswith(start)}, state)
