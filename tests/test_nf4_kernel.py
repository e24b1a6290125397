"""The C++ nf4 product (`accel.quant_cpp.nf4_linear`, taken by `Nf4WeightLinear` at decode and short-prompt rows)
against the plain dequantize-then-matmul reference, and NF4 double quantization (`weights="nf4:dq[:g<block>]"`:
8-bit absmax codes with a float32 step per 256): the round trip, the exact byte count, the parser, the kernel on it,
and a model decoding as its dequantized twin."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import recurrent_depth as rd
from recurrent_depth.inference import generate
from recurrent_depth.weight_quant import (
    NF4_CPP_ROWS,
    NF4_DQ_BLOCK,
    NF4_DQ_LEVELS,
    NF4_LEVELS,
    Nf4WeightLinear,
    check_weights,
    dequantize_weights,
    held_weights,
    nf4_absmax,
    parse_weights,
    quantize_nf4,
    quantize_weights,
    quantized_weight_bytes,
    unpack_nibbles,
)
from tests.test_weight_quant import _on_two_threads, cpp_kernels  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def gaussian_linear(out_features: int, in_features: int, seed: int, bias: bool = True) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=g) * in_features ** -0.5)
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=g))
    return linear


def _reference(layer: Nf4WeightLinear, x: torch.Tensor) -> torch.Tensor:
    """Dequantize in float32, then multiply in float32."""
    out = x.float() @ layer.dequantize().t()
    return out if layer.bias is None else out + layer.bias.float()


# Shapes: out 50 / 37 (a last block of two / one weight rows after the four-row ones), in_features a multiple of
# the block and not (75 = 2 x 32 + 11, 300 = 4 x 64 + 44, 1000 = 3 x 256 + 232: padded to whole blocks).
@pytest.mark.parametrize("out_features,in_features,block", [(50, 64, 32), (50, 75, 32), (37, 300, 64),
                                                            (12, 1000, 256)])
@pytest.mark.parametrize("dq", [False, True], ids=["absmax", "dq"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_cpp_product_equals_dequantize_then_matmul(cpp_kernels, out_features, in_features, block, dq,  # noqa: F811
                                                       dtype):
    """At 1, 3 and NF4_CPP_ROWS rows (a decode step, a batch, a short prompt) the C++ product, two threads
    splitting the weight rows: within float32 rounding of the float32 reference (bf16 activations: within one
    output rounding), as the int4 product's test; one row more, or a graph through x, the reference exactly."""
    linear = gaussian_linear(out_features, in_features, seed=in_features + block, bias=block != 64).to(dtype)
    layer = Nf4WeightLinear.from_linear(linear, block, double_quant=dq)
    assert layer.double_quant == dq and layer.absmax.dtype == (torch.uint8 if dq else torch.bfloat16)
    g = torch.Generator().manual_seed(block)
    for rows in (1, 3, NF4_CPP_ROWS, NF4_CPP_ROWS + 1):
        x = torch.randn(rows, in_features, generator=g).to(dtype)
        reference = _reference(layer, x)
        out = _on_two_threads(layer, x.view(1, rows, in_features))
        assert layer.uses_cpp(x) == (rows <= NF4_CPP_ROWS) and out.dtype == dtype
        out = out.view(rows, out_features).float()
        scale = reference.abs().amax(-1, keepdim=True).clamp_min(1e-6)
        assert ((out - reference).abs() / scale).max() <= (1e-5 if dtype == torch.float32 else 2**-7), rows
        if rows > NF4_CPP_ROWS:
            assert torch.equal(out, layer._reference(x).float())
    assert not layer.uses_cpp(x[:1].clone().requires_grad_())


def test_a_nan_row_stays_in_its_row_and_no_cpp_keeps_the_reference(cpp_kernels, monkeypatch):  # noqa: F811
    layer = Nf4WeightLinear.from_linear(gaussian_linear(20, 96, seed=1), 32)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(2)).bfloat16()
    alone = [layer(x[i:i + 1]) for i in range(3)]
    x[1, 7] = float("nan")
    out = layer(x)
    assert out[1].isnan().all() and torch.equal(out[0], alone[0][0]) and torch.equal(out[2], alone[2][0])
    monkeypatch.setenv("RDEPTH_NO_CPP", "1")  # the pure-PyTorch path
    assert not layer.uses_cpp(x[:1]) and torch.equal(layer(x[:1]), layer._reference(x[:1]))


def test_double_quantized_absmax_round_trip():
    """Per group of 256 blocks (the last partial) a float32 step, its largest absmax / 255, and each block's code the
    nearest multiple, at least 1; the weights are then rounded to the nearest level of those absmax."""
    linear = gaussian_linear(40, 200, seed=3)  # 40 x 7 blocks of 32: 280 codes, a group of 256 and one of 24
    with torch.no_grad():
        linear.weight[5, 64:96] *= 1e-4  # a block far below its group's largest: code 1, not a 0 scale
        linear.weight[39] = 0.0  # all-zero blocks
    layer = Nf4WeightLinear.from_linear(linear, 32, double_quant=True)
    codes, steps = layer.absmax, layer.absmax_steps
    assert codes.shape == (40, 7) and steps.shape == (2,) and steps.dtype == torch.float32
    true = torch.nn.functional.pad(linear.weight.detach().abs(), (0, 24)).view(40, 7, 32).amax(-1)
    groups = torch.nn.functional.pad(true.reshape(-1), (0, 2 * NF4_DQ_BLOCK - 280)).view(2, NF4_DQ_BLOCK)
    assert torch.equal(steps, groups.amax(-1) / NF4_DQ_LEVELS)
    assert int(codes.min()) >= 1 and int(codes.max()) == NF4_DQ_LEVELS and int(codes[5, 2]) == 1
    absmax = nf4_absmax(codes, steps)
    assert torch.equal(absmax.reshape(-1), codes.reshape(-1).float() * steps.repeat_interleave(NF4_DQ_BLOCK)[:280])
    big = true >= steps.repeat_interleave(NF4_DQ_BLOCK)[:280].view(40, 7)
    assert ((absmax - true).abs()[big] <= steps.max() / 2 * (1 + 1e-6)).all()
    # each weight on the level nearest weight / its dequantized absmax (argmin: independent of the bucketize)
    normed = torch.nn.functional.pad(linear.weight.detach(), (0, 24)).view(40, 7, 32) / absmax[..., None]
    nearest = (normed[..., None] - NF4_LEVELS).abs().argmin(-1).view(40, 224)
    assert torch.equal(unpack_nibbles(layer.qweight).long(), nearest)
    plain = Nf4WeightLinear.from_linear(linear, 32)
    errors = [(m.dequantize() - linear.weight).pow(2).mean().sqrt().item() for m in (layer, plain)]
    assert errors[0] <= errors[1] * 1.01, errors  # the 8-bit absmax costs under 1 % of the round trip's error
    assert plain.absmax.shape == codes.shape and torch.equal(quantize_nf4(linear.weight, 32)[1], plain.absmax)


def test_double_quantized_bytes_format_and_model_decode(cpp_kernels):  # noqa: F811
    """Bytes exactly: half a byte a weight (rows padded to whole blocks), a byte a block and 4 a group of 256 blocks
    of each layer; the format held and parsed back; greedy decoding through the C++ product as the dequantized
    twin (the reference)."""
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(dataclasses.replace(rd.ModelConfig.from_preset("tiny"), hidden_size=64)).eval()
    shapes = [m.weight.shape for m in model.transformer.modules() if type(m) is nn.Linear]
    assert quantize_weights(model, "nf4:dq:g32") == len(shapes) > 0 and held_weights(model) == "nf4:dq:g32"
    blocks = [(o, -(-i // 32)) for o, i in shapes]
    assert quantized_weight_bytes(model) == sum(o * b * 32 // 2 + o * b + 4 * -(-o * b // NF4_DQ_BLOCK)
                                                for o, b in blocks)
    assert parse_weights(held_weights(model)) == ("nf4:dq", 32) and quantize_weights(model, "nf4:dq:g32") == 0
    with pytest.raises(ValueError, match="already holds nf4:dq:g32 weights"):
        quantize_weights(model, "nf4:g32")
    layers = [m for m in model.modules() if isinstance(m, Nf4WeightLinear)]
    assert all(m.uses_cpp(torch.zeros(1, m.in_features)) for m in layers)
    twin = copy.deepcopy(model)
    dequantize_weights(twin)
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=4, num_steps=3, init_scale=0.0, output_logits=True)
    out, ref = generate(model, ids, **kw), generate(twin, ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)


def test_the_parser_takes_nf4_dq_and_refuses_other_spellings_in_one_line():
    assert parse_weights("nf4:dq") == ("nf4:dq", 64) and parse_weights("nf4:dq:g128") == ("nf4:dq", 128)
    assert parse_weights("nf4:g32") == ("nf4", 32) and check_weights("nf4:dq:g256") == "nf4:dq:g256"
    for bad in ("nf4:g64:dq", "nf4:dq:g48", "nf4:dq:", "nf4:dqg64", "nf4:DQ", "nf4:dq:g64:dq"):
        with pytest.raises(ValueError, match=rf"^weights='{bad}' is invalid: expected .*'nf4:dq' \(8-bit absmax\) "
                                             r"or 'nf4:dq:g<block>' for any nf4 block, .* \(or None\)$"):
            check_weights(bad)


def test_an_adapter_trained_on_nf4_dq_records_its_base_format(tmp_path):
    pytest.importorskip("peft")
    from recurrent_depth.train.lora import WEIGHTS_KEY, LoraSpec, add_lora, recorded_base, save_adapter

    torch.manual_seed(0)
    base = rd.RecurrentDepthLM(dataclasses.replace(rd.ModelConfig.from_preset("tiny"), hidden_size=64))
    model = add_lora(base, LoraSpec(rank=2, weights="nf4:dq"), seed=1)
    save_adapter(model, tmp_path / "adapter")
    assert recorded_base(tmp_path / "adapter")[WEIGHTS_KEY] == "nf4:dq:g64"
