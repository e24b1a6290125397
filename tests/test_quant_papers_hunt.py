"""KV quantizers checked as a user meets them: codes refused by a quantizer of another state, the raw fp16
codec's range, spec strings that float() takes but a bit width is not, kv_quant options given twice,
and exact bytes at head dims that are not a power of two (CPU, seeded, small sizes)."""

from __future__ import annotations

import math

import pytest
import torch

from recurrent_depth.inference.kv_codec import KVQuant
from recurrent_depth.quant import Codes, QuantSpec, build_quantizer
from recurrent_depth.quant.rows import RowCodec


def _loud(n: int = 40, dim: int = 64) -> torch.Tensor:
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(0))
    x[:, 50] *= 10  # channel 50 is the loud one: calibration picks it, the default split does not
    return x


@pytest.mark.parametrize("spec", ["mse:3", "prod:3", "polar", "qjl:2", "mse:2.5"])
def test_codes_of_another_seed_are_refused(spec: str) -> None:
    x = _loud()
    made, other = build_quantizer(spec, 64, seed=0), build_quantizer(spec, 64, seed=1)
    codes = made.encode(x)
    for read in (lambda: other.decode(codes), lambda: other.score(x[:2], codes)):
        with pytest.raises(ValueError, match="seed 0, this one's 1"):
            read()
    with pytest.raises(ValueError, match="different seeds"):
        Codes.cat([codes, other.encode(x)], axis=0)
    # the quantizer that made them still reads them, also after slicing, moving and concatenating
    joined = Codes.cat([codes.narrow(0, 0, 3).to("cpu"), codes.narrow(0, 3, 2)], axis=0)
    torch.testing.assert_close(made.decode(joined), made.decode(codes.narrow(0, 0, 5)))


@pytest.mark.parametrize("spec", ["mse:2.5", "prod:3.5", "qjl:2:out4"])
def test_codes_of_another_calibration_are_refused(spec: str) -> None:
    x = _loud()
    default = build_quantizer(spec, 64)
    calibrated = default.calibrated(x)
    assert 50 in calibrated.outlier_channels and 50 not in default.outlier_channels
    with pytest.raises(ValueError, match="other outlier channels"):
        default.decode(calibrated.encode(x))
    rows = RowCodec(calibrated)  # the row path carries the state too
    torch.testing.assert_close(rows.decode(rows.encode(x)), calibrated.decode(calibrated.encode(x)))


def test_raw_fp16_refuses_values_beyond_its_range() -> None:
    codec = build_quantizer("raw:16:fp16", 8)
    with pytest.raises(ValueError, match=r"raw:16:fp16 cannot hold values beyond fp16's range \(65504\)"):
        codec.encode(torch.full((2, 8), 1e5))
    big = torch.full((2, 8), 1e5)  # bf16 holds it
    bf16 = build_quantizer("raw:16", 8)
    assert torch.equal(bf16.decode(bf16.encode(big)), big.bfloat16().float())


@pytest.mark.parametrize("text", ["qjl:1_6", "mse:3_0", "mse:\u0663", "prod:\uff13"])
def test_bit_widths_are_plain_numbers(text: str) -> None:
    with pytest.raises(ValueError, match="must be a number"):
        QuantSpec.parse(text)


@pytest.mark.parametrize("option", ["seed=1", "attn=codes", "outliers=first", "window=2"])
def test_kv_quant_options_given_twice_raise(option: str) -> None:
    with pytest.raises(ValueError, match=f"{option.split('=')[0]}= is given twice"):
        KVQuant.parse(f"k=mse:3,{option},v=mse:3,{option}")


def test_kv_quant_option_values_ignore_case_like_methods() -> None:
    parsed = KVQuant.parse("K=MSE:3,v=mse:3,ATTN=Dequantize,outliers=FIRST")
    assert (str(parsed.k), parsed.attention, parsed.outliers) == ("mse:3", "dequantize", "first")


def _group_bytes(method: str, bits: int, dim: int) -> int:
    """A plain recount: packed index bits, (prod) sign bits, fp16 norm, (prod) the residual byte."""
    if method == "mse":
        return math.ceil(bits * dim / 8) + 2
    return math.ceil((bits - 1) * dim / 8) + math.ceil(dim / 8) + 3


@pytest.mark.parametrize("dim", [20, 48])
@pytest.mark.parametrize("spec", ["mse:3", "prod:4", "mse:2.5", "prod:3.5", "qjl:2:out3"])
def test_exact_bytes_at_head_dims_not_a_power_of_two(dim: int, spec: str) -> None:
    method, bits = spec.split(":")[:2]
    if method == "qjl":
        expected = math.ceil(2 * dim / 8) + 2 + 2 * 3
    elif "." in bits:
        n_out = dim // 2  # .5 bits: half the channels one bit higher
        lo = int(float(bits))
        expected = _group_bytes(method, lo + 1, n_out) + _group_bytes(method, lo, dim - n_out)
    else:
        expected = _group_bytes(method, int(bits), dim)
    quant = build_quantizer(spec, dim)
    x = torch.randn(1, 3, dim, generator=torch.Generator().manual_seed(1)).bfloat16()  # batch 1, bf16 input
    codes = quant.encode(x)
    assert quant.bytes_per_vector == expected and codes.nbytes == 3 * expected
    assert quant.decode(codes).shape == x.shape
