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


# ---------------------------------------------------------------- RMSNorm's hand-written backward
def composite_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The plain formula (the official implementation's), differentiated by autograd."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("shape", [(2, 7, 48), (1, 1, 5), (3, 33), (4, 2, 3, 16)], ids=str)
@pytest.mark.parametrize("grads_of", ["both", "input-only", "weight-only"])
def test_rms_norm_fast_path_matches_the_composite(shape, grads_of):
    torch.manual_seed(1)
    norm = layers.RMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    norm.weight.requires_grad_(grads_of != "input-only")
    x = (torch.randn(*shape) * 3).requires_grad_(grads_of != "weight-only")
    ref_x = x.detach().clone().requires_grad_(x.requires_grad)
    ref_w = norm.weight.detach().clone().requires_grad_(norm.weight.requires_grad)
    y = norm(x)
    assert type(y.grad_fn).__name__ == "_RMSNormFunctionBackward"  # the fast path was taken
    y_ref = composite_rms_norm(ref_x, ref_w, 1e-5)
    assert torch.equal(y, y_ref)  # same ops in the same order forward: bit for bit
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    if x.requires_grad:
        torch.testing.assert_close(x.grad, ref_x.grad, atol=1e-5, rtol=1e-5)
    if norm.weight.requires_grad:
        torch.testing.assert_close(norm.weight.grad, ref_w.grad, atol=1e-5, rtol=1e-5)


def test_rms_norm_fast_path_gradients_are_exact_in_float64():
    torch.manual_seed(2)
    x = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True)
    w = torch.rand(12, dtype=torch.float64).add_(0.5).requires_grad_()

    def fn(x, w):
        return layers._RMSNormFunction.apply(x, w, 1e-6)

    assert torch.autograd.gradcheck(fn, (x, w))
    assert torch.autograd.gradgradcheck(fn, (x, w))  # create_graph=True sees 1/rms depend on x


def test_rms_norm_takes_the_plain_formula_where_the_fast_path_does_not_apply():
    norm = layers.RMSNorm(8)
    x = torch.randn(2, 3, 8)
    with torch.no_grad():  # inference: unchanged, no autograd node
        assert torch.equal(norm(x), composite_rms_norm(x, norm.weight, norm.eps))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert type(norm(x.requires_grad_()).grad_fn).__name__ != "_RMSNormFunctionBackward"
    y = norm(x.to(torch.bfloat16).requires_grad_())  # a bf16 input takes the plain formula (fp32 weight)
    assert type(y.grad_fn).__name__ != "_RMSNormFunctionBackward" and y.dtype == torch.float32
