"""The quantizer interface shared by every method, and the helpers they share (norms, seeds, codebooks)."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod

import torch

from recurrent_depth.quant.codes import Codes
from recurrent_depth.quant.packing import pack_bits, packed_nbytes, unpack_bits
from recurrent_depth.quant.rotation import Rotation, make_rotation

NORM_DTYPE = torch.float16  # every stored norm and radius is fp16 (2 bytes), and counted


def derive_seed(seed: int, *tags: object) -> int:
    """A sub-seed for one component (a rotation, a sketch, a channel group), stable across runs."""
    digest = hashlib.blake2b(repr((int(seed), *tags)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Quantizer(ABC):
    """Encodes [..., D] float tensors to `Codes`, decodes them, and scores queries against them.

    - `encode(x)` -> Codes; `decode(codes)` -> [..., D] float32 (the dequantize path);
    - `score(q, codes)`: q [..., M, D] against codes of [..., N, D] -> [..., M, N], equal to
      `q @ decode(codes).mT` but computed from the codes (asymmetric: q stays full precision);
    - `bytes_per_vector`: the exact bytes one encoded vector holds, norms included;
    - `state_nbytes`: bytes of the shared state that recreates the quantizer (seeds, channel masks).
    """

    method: str
    # What besides (spec, D) its codes depend on: the seed, a calibration's outlier channels; carried
    # by every `Codes` it makes, so that another quantizer of the same spec refuses them.
    state_key: tuple = ()

    def __init__(self, dim: int) -> None:
        if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
            raise ValueError(f"quantizer dim must be a positive int, got {dim!r}")
        self.dim = dim

    @property
    @abstractmethod
    def bits(self) -> float:
        """The method's nominal bits per coordinate (indices and sign bits, norms not included)."""

    @property
    def spec(self) -> str:
        return f"{self.method}:{self.bits:g}"

    @property
    @abstractmethod
    def bytes_per_vector(self) -> int: ...

    @property
    def bits_per_coordinate(self) -> float:
        """Stored bits per coordinate, every norm counted."""
        return 8 * self.bytes_per_vector / self.dim

    @property
    def state_nbytes(self) -> int:
        return 8  # one seed

    @abstractmethod
    def encode(self, x: torch.Tensor) -> Codes: ...

    @abstractmethod
    def decode(self, codes: Codes) -> torch.Tensor: ...

    def score(self, q: torch.Tensor, codes: Codes) -> torch.Tensor:
        self._check_query(q)
        return q.float() @ self.decode(codes).mT

    def combine(self, weights: torch.Tensor, codes: Codes) -> torch.Tensor:
        """weights [..., M, N] times the decoded codes of [..., N, D] -> [..., M, D] (attention's
        value read); rotated methods sum in the rotated basis and rotate the M results back once."""
        return weights.float() @ self.decode(codes)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(spec={self.spec!r}, dim={self.dim})"

    def _check_input(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"{self.spec} encodes a floating-point tensor, got {type(x).__name__} "
                             f"{getattr(x, 'dtype', '')}")
        if x.dim() < 1 or x.shape[-1] != self.dim:
            raise ValueError(f"{self.spec} was built for D = {self.dim}, got a tensor of shape {tuple(x.shape)}")
        if not torch.isfinite(x).all():
            raise ValueError(f"{self.spec} cannot encode non-finite values (inf or nan)")
        return x.float()

    def _check_query(self, q: torch.Tensor) -> None:
        if q.dim() < 2 or q.shape[-1] != self.dim:
            raise ValueError(f"queries must be [..., M, {self.dim}], got {tuple(q.shape)}")

    def _check_codes(self, codes: Codes) -> None:
        if not isinstance(codes, Codes) or codes.method != self.spec or codes.dim != self.dim:
            got = f"{codes.method!r} (D={codes.dim})" if isinstance(codes, Codes) else type(codes).__name__
            raise ValueError(f"codes of {got} cannot be decoded by {self.spec!r} (D={self.dim})")
        if codes.state != self.state_key:
            made, this = (key[0] if key else None for key in (codes.state, self.state_key))
            why = "other outlier channels" if made == this else f"seed {made}, this one's {this}"
            raise ValueError(f"codes of {codes.method!r} (D={codes.dim}) were made by another quantizer state ({why}); "
                             "decode them with the quantizer that made them")


class RotatedQuantizer(Quantizer):
    """Shared by methods that code Πx: rotation from (kind, seed), spec suffix for non-default rotations."""

    def __init__(self, dim: int, rotation: str, seed: int) -> None:
        super().__init__(dim)
        self.seed = int(seed)
        self.state_key = (self.seed,)
        self.rotation: Rotation = make_rotation(rotation, dim, derive_seed(seed, "rotation"))

    @property
    def spec(self) -> str:
        suffix = "" if self.rotation.kind == "qr" else f":{self.rotation.kind}"
        return f"{self.method}:{self.bits:g}{suffix}"

    def decode(self, codes: Codes) -> torch.Tensor:
        return self.rotation.inverse(self._rotated(codes))

    def score(self, q: torch.Tensor, codes: Codes) -> torch.Tensor:
        self._check_query(q)
        return self.rotation.forward(q.float()) @ self._rotated(codes).mT

    def combine(self, weights: torch.Tensor, codes: Codes) -> torch.Tensor:
        return self.rotation.inverse(weights.float() @ self._rotated(codes))

    @abstractmethod
    def _rotated(self, codes: Codes) -> torch.Tensor:
        """The decoded vectors in the rotated basis, Πx̃ [..., D]."""



def store_norm(norm: torch.Tensor, what: str) -> torch.Tensor:
    """A float32 [..., 1] norm as fp16, refusing values fp16 cannot hold (a silent inf would poison decode)."""
    stored = norm.to(NORM_DTYPE)
    if not torch.isfinite(stored).all():
        raise ValueError(f"a {what} exceeds the fp16 range ({torch.finfo(NORM_DTYPE).max:g}): "
                         f"got {norm.max().item():g}; scale the input down")
    return stored


def stored_ratio(norm: torch.Tensor, stored: torch.Tensor) -> torch.Tensor:
    """‖x‖ / n for the fp16 norm n that was stored (1 where n is 0: nothing is rebuilt from it)."""
    stored = stored.float()
    return torch.where(stored > 0, norm / stored.clamp_min(torch.finfo(torch.float32).tiny), 1.0)


def unit_and_norm(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x / ‖x‖ (zero stays zero) and ‖x‖ as [..., 1] float32."""
    norm = x.norm(dim=-1, keepdim=True)
    return x / norm.clamp_min(torch.finfo(torch.float32).tiny), norm


class ScalarCodebook:
    """A sorted codebook as tensors: nearest-centroid indices, packed storage, lookup."""

    def __init__(self, centroids: tuple[float, ...], bits: int) -> None:
        self.bits, self.centroids = bits, centroids
        centroids_cpu = torch.tensor(centroids, dtype=torch.float32)
        self._tables = {torch.device("cpu"): (centroids_cpu, (centroids_cpu[1:] + centroids_cpu[:-1]) / 2)}

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(centroids, boundaries) on `device`, copied there once."""
        if device not in self._tables:
            self._tables[device] = tuple(t.to(device) for t in self._tables[torch.device("cpu")])
        return self._tables[device]

    def nbytes(self, count: int) -> int:
        return packed_nbytes(count, self.bits)

    def encode(self, y: torch.Tensor) -> torch.Tensor:
        """[..., n] values -> packed nearest-centroid indices [..., nbytes]."""
        return pack_bits(torch.bucketize(y.contiguous(), self._on(y.device)[1]), self.bits)

    def decode(self, packed: torch.Tensor, count: int) -> torch.Tensor:
        return self._on(packed.device)[0][unpack_bits(packed, self.bits, count)]
