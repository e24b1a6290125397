"""The quantized layers' backward (QLoRA's input gradients): the same values as autograd through
`F.linear(x, layer.dequantize(), bias)`, without keeping the dequantized float weight until the backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from recurrent_depth.weight_quant import Int4WeightLinear, Int8WeightLinear, QuantizedLinear

pytestmark = pytest.mark.usefixtures("one_thread")
IN, OUT = 40, 48  # 40: int4 pads its last group of 32; OUT * IN is no activation's size here

MAKERS = {"int8": Int8WeightLinear.from_linear,
          "int4": lambda linear: Int4WeightLinear.from_linear(linear, 32, kernel_layout=False)}


def layer(weights: str, dtype: torch.dtype, bias: bool) -> QuantizedLinear:
    torch.manual_seed(0)
    return MAKERS[weights](nn.Linear(IN, OUT, bias=bias).to(dtype))


def run(fn, x: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    x = x.clone().requires_grad_(True)
    if bias is not None:
        bias.grad = None
    out = fn(x)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype))
    return out.detach(), x.grad, None if bias is None or bias.grad is None else bias.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [None, "frozen", "trained"])
@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_gradients_equal_autograd_through_the_dequantized_weight(weights, bias, dtype):
    q = layer(weights, dtype, bias is not None)
    if bias == "trained":  # (peft's bias="all" unfreezes the base layer's bias)
        q.bias.requires_grad_(True)
    x = torch.randn(3, 5, IN, generator=torch.Generator().manual_seed(1)).to(dtype)
    got = run(q, x, q.bias)
    want = run(lambda x: F.linear(x, q.dequantize(dtype), None if q.bias is None else q.bias.to(dtype)), x, q.bias)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None) and (g is None or torch.equal(g, w))
    assert (got[2] is not None) == (bias == "trained")


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_the_backward_keeps_no_float_copy_of_the_weight(weights):
    """autograd's F.linear saved the dequantized weight of every call until the backward (a QLoRA step held a float
    copy of each layer per call, more than the float model): now nothing weight-sized is saved."""
    q = layer(weights, torch.float32, bias=False)
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    x = torch.randn(3, 5, IN, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = q(x)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert not [s for s in saved if s.numel() == OUT * IN]


def test_no_autograd_graph_without_gradients():
    """Under no_grad (and for inputs without gradients) the plain product runs: no backward node."""
    q = layer("int4", torch.float32, bias=True)
    x = torch.randn(9, IN, generator=torch.Generator().manual_seed(1))
    assert q(x).grad_fn is None
    with torch.no_grad():
        assert q(x.requires_grad_(True)).grad_fn is None


def test_many_bf16_rows_take_the_reference_not_torchs_int8_kernel():
    """`aten._weight_int8pack_mm`'s time grows with the rows (at 128 rows 3x the reference's at 1024 x 5632): QLoRA's
    no-grad recurrence steps and long prompts (more than KERNEL_MAX_ROWS rows) take the reference, exactly."""
    from recurrent_depth.weight_quant import KERNEL_MAX_ROWS

    torch.manual_seed(0)
    q = Int8WeightLinear.from_linear(nn.Linear(OUT, OUT, bias=False).to(torch.bfloat16))  # (a width the kernel takes)
    short = torch.randn(2, KERNEL_MAX_ROWS // 2, OUT, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    long = torch.randn(3, KERNEL_MAX_ROWS // 2, OUT, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert q.uses_kernel(short) and not q.uses_kernel(long)
    assert torch.equal(q(long), F.linear(long, q.dequantize(torch.bfloat16)))
