"""Found by a differential fuzz of the nf4 C++ product and the int4 kernel-layout code cache (session 34):
`Int4WeightLinear.unpacked()`'s cache of the codes read back through torch's kernel went stale in copies
(copy.deepcopy, torch.save of the module: a copied tensor's version counter restarts) and for inference-mode
buffers changed in place, and held a moved layer's old buffer alive; a zero-width nf4 layer crashed. Plus the fuzz's
edge cases of the C++ nf4 product (strided, 3-D and non-finite activations, the NF4_CPP_ROWS boundary, zero and
subnormal blocks) pinned against the float64 reference."""

from __future__ import annotations

import copy
import gc
import io
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from recurrent_depth import weight_quant as wq
from tests.test_weight_quant import cpp_kernels  # noqa: F401 - the fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def _int4_kernel_layer(seed: int) -> wq.Int4WeightLinear:
    torch.manual_seed(seed)
    return wq.Int4WeightLinear.from_linear(nn.Linear(64, 32), 32, kernel_layout=True)


def _codes_read_now(layer: wq.Int4WeightLinear) -> torch.Tensor:
    """The layer's 4-bit values read back through the kernel now, past any cache."""
    return wq.unpack_kernel_layout(layer.qweight, layer.in_features, layer.group)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_a_copy_of_an_int4_layer_changed_after_its_cached_read_uses_its_own_codes(how):
    layer = _int4_kernel_layer(0)
    with torch.no_grad():
        layer.qweight.copy_(_int4_kernel_layer(1).qweight)  # version 1
    layer.unpacked()  # cached at version 1
    with torch.no_grad():
        layer.qweight.copy_(_int4_kernel_layer(2).qweight)  # version 2; a copy's tensor restarts at 1
    if how == "deepcopy":
        copied = copy.deepcopy(layer)
    else:
        buffer = io.BytesIO()
        torch.save(layer, buffer)
        buffer.seek(0)
        copied = torch.load(buffer, weights_only=False)
    assert torch.equal(copied.unpacked(), _codes_read_now(copied))
    assert "_plain_codes" not in copy.deepcopy(layer).__dict__  # (nor pickled: a derived copy of the codes)
    assert torch.equal(layer.unpacked(), _codes_read_now(layer))


def test_an_inference_mode_int4_buffer_changed_in_place_is_read_again():
    with torch.inference_mode():  # (no version counter on these tensors)
        layer = _int4_kernel_layer(3)
        layer.unpacked()
        layer.qweight.copy_(_int4_kernel_layer(4).qweight)
    assert torch.equal(layer.unpacked(), _codes_read_now(layer))
    x = torch.randn(2, 64, requires_grad=True)  # an autograd call dequantizes the current codes
    layer(x).sum().backward()
    expected = wq.dequantize_int4(_codes_read_now(layer), layer.groups_first(), 64).sum(0)
    torch.testing.assert_close(x.grad, expected.expand(2, 64))


def test_a_moved_int4_layer_lets_its_old_buffer_go():
    layer = _int4_kernel_layer(5)
    layer.unpacked()
    old = weakref.ref(layer.qweight)
    layer._apply(lambda t: t.clone())  # (as a move to another device: new buffers)
    gc.collect()
    assert old() is None
    assert torch.equal(layer.unpacked(), _codes_read_now(layer))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # (nn.Linear(0, 6)'s init)
@pytest.mark.parametrize("double_quant", [False, True], ids=["absmax", "dq"])
@pytest.mark.parametrize("cpp", [True, False], ids=["cpp", "reference"])
def test_a_zero_width_nf4_layer_quantizes_and_returns_its_bias(cpp_kernels, monkeypatch, double_quant, cpp):  # noqa: F811
    monkeypatch.setenv("RDEPTH_NO_CPP", "0" if cpp else "1")
    linear = nn.Linear(0, 6)
    layer = wq.Nf4WeightLinear.from_linear(linear, 32, double_quant=double_quant)
    assert layer.dequantize().shape == (6, 0) and layer.quantized_bytes() == 0
    x = torch.randn(2, 3, 0)
    assert layer.uses_cpp(x) == cpp
    with torch.no_grad():
        torch.testing.assert_close(layer(x), linear.bias.detach().expand(2, 3, 6))


# (out, in, rows, block, dq, dtype, x's layout, the weight's case): in_features not a multiple of the block, a
# last group of 1-3 weight rows, rows at and past NF4_CPP_ROWS
CASES = [(7, 75, 1, 32, False, torch.float32, "transposed", "zero_blocks"),
         (37, 300, 3, 64, True, torch.bfloat16, "sliced", "outlier"),
         (5, 257, 4, 128, False, torch.float32, "3d", "subnormal"),
         (9, 700, 2, 256, True, torch.float32, "non_finite", "normal"),
         (6, 33, wq.NF4_CPP_ROWS, 32, True, torch.float32, "expanded", "tiny_blocks"),
         (6, 33, wq.NF4_CPP_ROWS + 1, 32, False, torch.bfloat16, "plain", "normal")]


def _fuzz_x(rows: int, in_features: int, layout: str, g: torch.Generator) -> torch.Tensor:
    if layout == "transposed":
        return torch.randn(in_features, rows, generator=g).t()
    if layout == "sliced":
        return torch.randn(rows, 2 * in_features + 1, generator=g)[:, 1::2]
    if layout == "expanded":
        return torch.randn(1, in_features, generator=g).expand(rows, in_features)
    if layout == "3d":
        return torch.randn(2, rows, in_features, generator=g)
    x = torch.randn(rows, in_features, generator=g)
    if layout == "non_finite":
        x[0, 3], x[-1, 5] = float("nan"), float("inf")
    return x


def _fuzz_weight(out_features: int, in_features: int, case: str, g: torch.Generator) -> torch.Tensor:
    w = torch.randn(out_features, in_features, generator=g) * in_features ** -0.5
    if case == "zero_blocks":
        w[:, :32], w[out_features // 2] = 0, 0
    elif case == "outlier":
        w[3, 17] = 1e4
    elif case == "subnormal":
        w *= 1e-40
    elif case == "tiny_blocks":
        w[:, ::2] *= 1e-6
    return w


@pytest.mark.parametrize("out_features,in_features,rows,block,dq,dtype,layout,case", CASES)
def test_the_nf4_product_at_the_fuzzed_edges_is_the_float64_reference(cpp_kernels, out_features, in_features,  # noqa: F811
                                                                       rows, block, dq, dtype, layout, case):
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    linear = nn.Linear(in_features, out_features)
    with torch.no_grad():
        linear.weight.copy_(_fuzz_weight(out_features, in_features, case, g))
    layer = wq.Nf4WeightLinear.from_linear(linear, block, double_quant=dq).to(dtype)
    x = _fuzz_x(rows, in_features, layout, g).to(dtype)
    assert layer.uses_cpp(x) == (x.numel() <= wq.NF4_CPP_ROWS * in_features)
    with torch.no_grad():
        out = layer(x)
    assert out.shape == (*x.shape[:-1], out_features) and out.dtype == dtype
    weight = layer.dequantize().double()
    reference = F.linear(x.double(), weight, layer.bias.double()).to(dtype).double().reshape(-1, out_features)
    out = out.double().reshape(-1, out_features)
    finite = torch.isfinite(reference)
    assert torch.equal(finite, torch.isfinite(out)) and torch.equal(reference.isnan(), out.isnan())
    # the documented tolerance of the row's largest output, with a float32 rounding floor of sum |x||w| (subnormal
    # weights: the products' own spacing) for rows whose outputs cancel
    largest = torch.where(finite, reference.abs(), 0).amax(dim=1, keepdim=True)
    magnitude = x.double().reshape(-1, in_features).abs().nan_to_num(0, 0, 0) @ weight.abs().t()
    tolerance = (1e-5 if dtype == torch.float32 else 2 ** -7) * largest
    floor = 8 * torch.finfo(torch.float32).eps * magnitude + (in_features + 1) * 2.0 ** -149
    error = torch.where(finite, (out - reference).abs(), 0)
    assert (error <= torch.maximum(tolerance, floor)).all()
