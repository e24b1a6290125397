"""Seeded random rotations Π (orthogonal D×D), applied to the last axis: `forward(x)` = Πx, `inverse(y)` = Πᵀy.

- `DenseRotation`: the Q factor of the QR decomposition of an iid N(0, 1) matrix, columns sign-fixed
  by diag(R) so that Π is Haar-distributed (TurboQuant's Π). Any D ≥ 1; D² floats when materialised.
- `HadamardRotation`: Π = H·diag(s)/√D with H the Sylvester–Hadamard matrix and s iid ±1 signs;
  O(D log D) per vector and D signs of state. H exists only for D a power of two: other sizes raise.

Both are stored as a seed (8 bytes): the matrix or the signs are regenerated from it, on CPU in
float64, so the same seed gives the same rotation on every device.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod

import torch

ROTATIONS = ("qr", "hadamard")


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed))


@functools.lru_cache(maxsize=64)
def _haar_matrix(dim: int, seed: int) -> torch.Tensor:
    gauss = torch.randn(dim, dim, generator=_generator(seed), dtype=torch.float64)
    q, r = torch.linalg.qr(gauss)
    return (q * torch.sign(torch.diagonal(r))).to(torch.float32)  # sign fix: Haar, not QR-biased


@functools.lru_cache(maxsize=64)
def _random_signs(dim: int, seed: int) -> torch.Tensor:
    return (torch.randint(0, 2, (dim,), generator=_generator(seed)) * 2 - 1).to(torch.float32)


@functools.lru_cache(maxsize=256)
def on_device(make: object, *args: object, device: torch.device) -> torch.Tensor:
    """`make(*args)` (a cached CPU tensor) copied once per device, not once per call."""
    return make(*args).to(device)


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised fast Walsh–Hadamard transform over the last axis (a power of two): x @ H."""
    n = x.shape[-1]
    h = 1
    while h < n:
        pairs = x.unflatten(-1, (n // (2 * h), 2, h))  # [..., blocks, 2, h]
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return x


class Rotation(ABC):
    """An orthogonal map of the last axis, recreated from (dim, seed)."""

    kind: str

    def __init__(self, dim: int, seed: int = 0) -> None:
        if not isinstance(dim, int) or dim < 1:
            raise ValueError(f"rotation dim must be a positive int, got {dim!r}")
        self.dim, self.seed = dim, int(seed)

    @abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def inverse(self, y: torch.Tensor) -> torch.Tensor: ...

    def matrix(self) -> torch.Tensor:
        """Π as a dense [D, D] float32 matrix (forward(x) = x @ Πᵀ)."""
        return self.forward(torch.eye(self.dim)).T

    @property
    def state_nbytes(self) -> int:
        """Bytes needed to recreate Π: its seed."""
        return 8

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dim={self.dim}, seed={self.seed})"


class DenseRotation(Rotation):
    kind = "qr"

    def _pi(self, like: torch.Tensor) -> torch.Tensor:
        return on_device(_haar_matrix, self.dim, self.seed, device=like.device).to(like.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self._pi(x).T

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return y @ self._pi(y)


class HadamardRotation(Rotation):
    kind = "hadamard"

    def __init__(self, dim: int, seed: int = 0) -> None:
        super().__init__(dim, seed)
        if dim & (dim - 1):
            raise ValueError(
                f"a Hadamard rotation needs a power-of-two size, got {dim}; use rotation='qr' for this size"
            )

    def _signs(self, like: torch.Tensor) -> torch.Tensor:
        return on_device(_random_signs, self.dim, self.seed, device=like.device).to(like.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Π = H·diag(s)/√D, H symmetric: Πx is the row vector (x ⊙ s) @ H / √D.
        return fwht(x * self._signs(x)) / math.sqrt(self.dim)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return fwht(y) * self._signs(y) / math.sqrt(self.dim)


def make_rotation(kind: str, dim: int, seed: int = 0) -> Rotation:
    if kind == "qr":
        return DenseRotation(dim, seed)
    if kind == "hadamard":
        return HadamardRotation(dim, seed)
    raise ValueError(f"unknown rotation {kind!r}; expected one of {', '.join(ROTATIONS)}")


@functools.lru_cache(maxsize=64)
def gaussian_matrix(rows: int, cols: int, seed: int) -> torch.Tensor:
    """An iid N(0, 1) [rows, cols] float32 matrix from a seed (QJL's S), made on CPU for reproducibility."""
    return torch.randn(rows, cols, generator=_generator(seed), dtype=torch.float64).to(torch.float32)
