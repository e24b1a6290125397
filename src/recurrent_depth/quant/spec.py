"""Quantizer specs as text, `method:bits[:option]`, and the bytes they cost.

    mse:3          TurboQuant_mse, 3 bits (integer 1..8, or fractional by a channel split: mse:2.5)
    prod:3.5       TurboQuant_prod, 3.5 bits in total (b − 1 bits mse + 1-bit QJL per group)
    mse:4:hadamard the option names the rotation: qr (default) or hadamard
    qjl:2          QJL keys, 2 sign bits per coordinate (sketch m = 2·D; at most 16, MAX_QJL_BITS)
    qjl:2:out4     the same with 4 outlier channels per vector kept in bf16 outside the sketch (< D)
    polar          PolarQuant, the reference layout (3.875 bits; `polar:3.875` too)
    raw:16:fp16    the raw 16-bit codec (bf16 by default)

`parse_kv_quant("k=prod:3.5,v=mse:3.5")` reads a key and a value spec; `kv_bytes_per_token` prices
a pair for a model's attention shape, every norm counted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from recurrent_depth.quant.base import Quantizer
from recurrent_depth.quant.polar import REFERENCE_LEVEL_BITS, PolarQuant
from recurrent_depth.quant.qjl import MAX_QJL_BITS, QJL
from recurrent_depth.quant.raw import RAW_DTYPES, Raw16
from recurrent_depth.quant.rotation import ROTATIONS
from recurrent_depth.quant.split import ChannelSplit
from recurrent_depth.quant.turboquant import TurboQuantMSE, TurboQuantProd

METHODS = ("mse", "prod", "qjl", "polar", "raw")
POLAR_BITS = (sum(b << (len(REFERENCE_LEVEL_BITS) - level) for level, b in enumerate(REFERENCE_LEVEL_BITS, 1))
              + 16) / (1 << len(REFERENCE_LEVEL_BITS))
_BIT_RANGE = {"mse": (1, 8), "prod": (1, 9)}
MAX_QJL_OUTLIERS = 4096  # outN's N before any head dim is known; a built quantizer also needs N < D
MAX_SPEC_CHARS = 200  # the longest spec spelt out is under 100; error lines quote what they were given


def check_spec_text(text: str, what: str) -> None:
    """A ValueError for a spec string too long to be one (its error lines would quote all of it)."""
    if len(text) > MAX_SPEC_CHARS:
        raise ValueError(f"a {what} is at most {MAX_SPEC_CHARS} characters, got {len(text)} ({text[:40]!r}...)")


# Every spec is bounded here, before anything is built: a spec is text a server's client may send
# (`kv_quant` per request), and its bits set the sketch, the codebook and the bytes of every cached
# vector. No method may cost more than the raw bf16 vector it stands for (plus its norms).


def qjl_outlier_count(option: str | None) -> int:
    """The outlier channels a qjl option names: None -> 0, `out4` -> 4 (1..MAX_QJL_OUTLIERS; each must also
    be < D, checked when the quantizer is built for a head dim)."""
    if option is None:
        return 0
    digits = option[3:] if option.startswith("out") else ""
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 5 or not 1 <= int(digits) <= MAX_QJL_OUTLIERS:
        raise ValueError(f"qjl's option is outN, N outlier channels kept in bf16 (1..{MAX_QJL_OUTLIERS}, and < D), "
                         f"e.g. qjl:2:out4; got {option!r}")
    return int(digits)


@dataclass(frozen=True)
class QuantSpec:
    method: str
    bits: float
    option: str | None = None  # rotation for mse / prod / polar, dtype for raw, `outN` for qjl

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown quantization method {self.method!r}; expected one of {', '.join(METHODS)}")
        bits = self.bits
        if isinstance(bits, bool) or not isinstance(bits, int | float) or not math.isfinite(bits) or bits <= 0:
            raise ValueError(f"{self.method} bits must be a number > 0, got {bits!r}")
        if self.method in _BIT_RANGE:
            lo, hi = _BIT_RANGE[self.method]
            if not lo <= bits <= hi:
                raise ValueError(f"{self.method} bits must be in [{lo}, {hi}], got {bits:g}")
        if self.method == "qjl" and bits > MAX_QJL_BITS:
            raise ValueError(f"qjl bits must be in (0, {MAX_QJL_BITS}], got {bits:g} (a sketch of more than "
                             f"{MAX_QJL_BITS} sign bits per coordinate costs more than the bf16 vector)")
        if self.method == "polar" and bits != POLAR_BITS:
            raise ValueError(f"polar's reference layout is {POLAR_BITS:g} bits, got {bits:g} "
                             "(other layouts: PolarQuant(dim, level_bits=...))")
        if self.method == "raw" and bits != 16:
            raise ValueError(f"raw is a 16-bit codec, got {bits:g} bits")
        if self.method == "qjl":
            qjl_outlier_count(self.option)  # raises for a bad option
            return
        allowed = {"raw": tuple(RAW_DTYPES)}.get(self.method, ROTATIONS)
        if self.option is not None and self.option not in allowed:
            what = "dtype" if self.method == "raw" else "rotation"
            raise ValueError(f"unknown {what} {self.option!r} for {self.method}; expected one of {', '.join(allowed)}")

    @classmethod
    def parse(cls, text: str) -> QuantSpec:
        check_spec_text(text, "quantizer spec")
        parts = text.strip().split(":")
        if not parts[0] or len(parts) > 3:
            raise ValueError(f"a quantizer spec is method:bits[:option] (e.g. prod:3.5, mse:4:hadamard), got {text!r}")
        method = parts[0].strip().lower()
        if len(parts) == 1:
            defaults = {"polar": POLAR_BITS, "raw": 16}
            if method not in defaults:
                if method not in METHODS:
                    raise ValueError(f"unknown quantization method {method!r}; expected one of {', '.join(METHODS)}")
                raise ValueError(f"{method} needs a bit width, e.g. {method}:3.5")
            return cls(method, defaults[method])
        try:
            # float() also takes "1_6" (16) and non-ASCII digits: a bit width is plain ASCII digits
            if not parts[1].isascii() or "_" in parts[1]:
                raise ValueError
            bits = float(parts[1])
        except ValueError:
            raise ValueError(f"bits in {text!r} must be a number, got {parts[1]!r}") from None
        option = parts[2].strip().lower() if len(parts) > 2 else None
        return cls(method, int(bits) if bits.is_integer() else bits, option)

    def __str__(self) -> str:
        return f"{self.method}:{self.bits:g}" + (f":{self.option}" if self.option else "")

    def build(self, dim: int, seed: int = 0, outlier_channels: Sequence[int] | None = None) -> Quantizer:
        """The quantizer for vectors of size `dim` (a head dim)."""
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"quantizer dim must be a positive int, got {dim!r}")
        rotation = self.option or "qr"
        if self.method == "raw":
            return Raw16(dim, self.option or "bf16")
        if self.method == "polar":
            return PolarQuant(dim, REFERENCE_LEVEL_BITS, rotation, seed)
        if self.method == "qjl":
            m = self.bits * dim
            if abs(m - round(m)) > 1e-6:
                raise ValueError(f"qjl:{self.bits:g} at D = {dim} is a sketch of {m:g} bits; choose bits·D whole")
            outliers = qjl_outlier_count(self.option)
            if outlier_channels is not None and not outliers:
                raise ValueError(f"{self} keeps no outlier channels: give qjl:{self.bits:g}:outN to keep N")
            return QJL(dim, round(m), seed, outliers, outlier_channels)
        group = TurboQuantMSE if self.method == "mse" else TurboQuantProd
        if float(self.bits).is_integer():
            if outlier_channels is not None:
                raise ValueError(f"{self} has no channel split: outlier channels apply to fractional bits only")
            return group(dim, int(self.bits), rotation, seed)
        suffix = f":{self.option}" if self.option and self.option != "qr" else ""
        return ChannelSplit(self.method, dim, self.bits, lambda d, b, s: group(d, b, rotation, s), seed,
                            outlier_channels, suffix)


def build_quantizer(spec: str | QuantSpec, dim: int, seed: int = 0,
                    outlier_channels: Sequence[int] | None = None) -> Quantizer:
    """`build_quantizer("prod:3.5", 128)`: a quantizer from a spec string or a QuantSpec."""
    spec = QuantSpec.parse(spec) if isinstance(spec, str) else spec
    return spec.build(dim, seed, outlier_channels)


def parse_kv_quant(text: str) -> dict[str, QuantSpec]:
    """`"k=prod:3.5,v=mse:3.5"` -> {"k": QuantSpec, "v": QuantSpec}; k and v each at most once, both optional."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("a KV quantization spec is k=METHOD:BITS,v=METHOD:BITS (e.g. k=prod:3.5,v=mse:3.5), got "
                         f"{text!r}")
    check_spec_text(text, "KV quantization spec")
    specs: dict[str, QuantSpec] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("k", "v"):
            raise ValueError(f"each part of a KV quantization spec is k=... or v=..., got {item.strip()!r} in {text!r}")
        if key in specs:
            raise ValueError(f"{key}= is given twice in {text!r}")
        specs[key] = QuantSpec.parse(value)
    return specs


def kv_bytes_per_token(specs: dict[str, QuantSpec], head_dim: int, num_kv_heads: int, num_layers: int = 1) -> int:
    """Bytes one token's keys and values take in `num_layers` caches; a missing k or v is counted as bf16."""
    per_head = 0
    for key in ("k", "v"):
        spec = specs.get(key) or QuantSpec("raw", 16)
        per_head += spec.build(head_dim).bytes_per_vector
    return per_head * num_kv_heads * num_layers
