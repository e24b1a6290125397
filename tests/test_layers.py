"""The layout-aware Linear equals nn.Linear (outputs and gradients) on every path it takes."""

import pytest
import torch

from recurrent_depth.model import layers
from recurrent_depth.model.layers import Linear, _TransposedWeightGradLinear


def pair(bias: bool, dtype: torch.dtype = torch.float32) -> tuple[Linear, torch.nn.Linear]:
    torch.manual_seed(0)
    ours = Linear(60, 36, bias=bias).to(dtype)
    ref = torch.nn.Linear(60, 36, bias=bias).to(dtype)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def run(module, x, grad, autocast):
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = module(x)
    y.backward(grad.to(y.dtype))
    grads = [x.grad] + [p.grad for p in module.parameters()]
    return y, grads


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("mode", ["fp32", "autocast-bf16", "bf16-weights"])
def test_linear_matches_nn_linear(monkeypatch, bias, mode):
    monkeypatch.setattr(layers, "CPU_EMULATES_BF16", True)  # take the emulated-bf16 path on any CPU
    dtype = torch.bfloat16 if mode == "bf16-weights" else torch.float32
    ours, ref = pair(bias, dtype)
    x = torch.randn(3, 7, 60, dtype=dtype)  # odd token count, non-square weight
    grad = torch.randn(3, 7, 36)
    y, grads = run(ours, x, grad, autocast=mode == "autocast-bf16")
    y_ref, grads_ref = run(ref, x, grad, autocast=mode == "autocast-bf16")
    assert y.dtype == y_ref.dtype
    tol = 0 if mode == "fp32" else 2e-2  # bf16 GEMMs may sum in another order
    torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)
    for a, b in zip(grads, grads_ref):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_transposed_weight_function_in_float64():
    torch.manual_seed(1)
    x = torch.randn(4, 5, 9, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 9, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(_TransposedWeightGradLinear.apply, (x, w, b))
    assert torch.autograd.gradcheck(_TransposedWeightGradLinear.apply, (x, w, None))


def rope_reference(x, cos, sin):
    """Rotate pairs (x[2i], x[2i+1]) by the angle whose cosine and sine are given, in float32."""
    out = torch.empty(x.shape, dtype=torch.float32)
    a, b = x[..., 0::2].float(), x[..., 1::2].float()
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = b * cos + a * sin
    return out.to(x.dtype)


@pytest.mark.parametrize("compiling", [False, True], ids=["complex", "real-under-compile"])
@pytest.mark.parametrize("layout", ["contiguous", "odd-offset-slice", "bf16"])
def test_apply_rope_matches_the_pairwise_formula(monkeypatch, compiling, layout):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    torch.manual_seed(0)
    table = layers.rope_table(60, 37, 50000.0)  # odd length, head dim 60
    cos, sin = table[..., 0][None, :, None], table[..., 1][None, :, None]
    if layout == "odd-offset-slice":  # a view into a fused projection starting at an odd column
        x = torch.randn(2, 37, 1 + 3 * 60)[..., 1 : 1 + 3 * 60].unflatten(-1, (3, 60))
    else:
        x = torch.randn(2, 37, 3, 60, dtype=torch.bfloat16 if layout == "bf16" else torch.float32)
    # The complex product may fuse a multiply-add: equal to one rounding (1 ulp of float32 / bfloat16).
    torch.testing.assert_close(layers.apply_rope(x, cos, sin), rope_reference(x, cos, sin), atol=1e-6, rtol=1e-6)
