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
