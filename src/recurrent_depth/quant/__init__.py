"""KV-cache quantizers: TurboQuant (mse, prod), QJL, PolarQuant, and a raw 16-bit codec.

    from recurrent_depth.quant import build_quantizer
    quant = build_quantizer("prod:3.5", dim=128, seed=0)
    codes = quant.encode(keys)               # keys [..., N, 128] -> bit-packed Codes
    scores = quant.score(queries, codes)     # [..., M, N], = queries @ quant.decode(codes).mT
    codes.nbytes                             # exactly the bytes held, norms included

Every quantizer is recreated from (spec, dim, seed); see docs/quant.md for the methods, formulas
and the bit accounting.
"""

from recurrent_depth.quant.base import Quantizer
from recurrent_depth.quant.codebook import polar_angle_codebook, sphere_codebook
from recurrent_depth.quant.codes import Codes
from recurrent_depth.quant.packing import pack_bits, packed_nbytes, unpack_bits
from recurrent_depth.quant.polar import PolarQuant
from recurrent_depth.quant.qjl import QJL
from recurrent_depth.quant.raw import Raw16
from recurrent_depth.quant.rotation import DenseRotation, HadamardRotation, Rotation, make_rotation
from recurrent_depth.quant.spec import METHODS, QuantSpec, build_quantizer, kv_bytes_per_token, parse_kv_quant
from recurrent_depth.quant.split import ChannelSplit, select_outlier_channels, split_sizes
from recurrent_depth.quant.turboquant import TurboQuantMSE, TurboQuantProd

__all__ = [
    "METHODS",
    "QJL",
    "ChannelSplit",
    "Codes",
    "DenseRotation",
    "HadamardRotation",
    "PolarQuant",
    "QuantSpec",
    "Quantizer",
    "Raw16",
    "Rotation",
    "TurboQuantMSE",
    "TurboQuantProd",
    "build_quantizer",
    "kv_bytes_per_token",
    "make_rotation",
    "pack_bits",
    "packed_nbytes",
    "parse_kv_quant",
    "polar_angle_codebook",
    "select_outlier_channels",
    "sphere_codebook",
    "split_sizes",
    "unpack_bits",
]
