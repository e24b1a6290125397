"""recurrent_depth.accel: each conversion against the plain model it replaces (outputs and gradients).

Tolerances: fp32 conversions are exact in the forward (the same operations in the same order) and agree
to 1e-5 in the backward (the RMSNorm backward is the same derivative in another order of operations);
bf16/fp16 products agree to 3e-2 (the GEMMs may sum in another order; a few ulps of bf16's 8-bit mantissa).
"""

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import recurrent_depth as rd
from recurrent_depth import accel
from recurrent_depth.accel import linear
from recurrent_depth.accel import norm as accel_norm
from recurrent_depth.accel.linear import (
    FastLowPrecisionLinear,
    _EmulatedLowPrecisionLinear,
    blocked_tn_mm,
    convert_linears,
)
from recurrent_depth.accel.norm import FastRMSNorm, convert_norms
from recurrent_depth.model.layers import RMSNorm
from tests.train_support import OneThread


def fast_linear(*args, **kwargs) -> FastLowPrecisionLinear:
    layer = torch.nn.Linear(*args, **kwargs)
    assert convert_linears(layer) == 1
    return layer


def pair(bias: bool, dtype: torch.dtype, features: tuple[int, int]) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    torch.manual_seed(0)
    ours = fast_linear(*features, bias=bias).to(dtype)
    ref = torch.nn.Linear(*features, bias=bias).to(dtype)
    ref.load_state_dict(ours.state_dict())
    return ours, ref


def run(module, x, grad, autocast_dtype):
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        y = module(x)
    y.backward(grad.to(y.dtype))
    grads = [x.grad] + [p.grad for p in module.parameters()]
    return y, grads


MODES = {  # name: (parameter dtype, autocast dtype)
    "fp32": (torch.float32, None),
    "autocast-bf16": (torch.float32, torch.bfloat16),
    "bf16-weights": (torch.bfloat16, None),
    "autocast-fp16": (torch.float32, torch.float16),
    "fp16-weights": (torch.float16, None),
}


def bf16_cpu(monkeypatch, emulated: bool) -> None:
    """The layouts of a CPU that emulates bf16 products, or of one where they are native."""
    monkeypatch.setattr(linear, "cpu_emulates_bf16", lambda: emulated)


@pytest.mark.parametrize("cpu", ["emulated-bf16", "native-bf16"])
@pytest.mark.parametrize("shape", ["one-block", "several-blocks"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("mode", list(MODES))
def test_linear_matches_nn_linear(monkeypatch, bias, mode, shape, cpu):
    bf16_cpu(monkeypatch, cpu == "emulated-bf16")
    dtype, autocast_dtype = MODES[mode]
    # Odd token counts and non-square weights; the second has several blocks of rows in every product.
    (batch, tokens), features = ((3, 7), (60, 36)) if shape == "one-block" else ((2, 131), (60, 300))
    ours, ref = pair(bias, dtype, features)
    x = torch.randn(batch, tokens, features[0], dtype=dtype)
    grad = torch.randn(batch, tokens, features[1])
    y, grads = run(ours, x, grad, autocast_dtype)
    y_ref, grads_ref = run(ref, x, grad, autocast_dtype)
    assert y.dtype == y_ref.dtype
    tol = 0 if mode == "fp32" else 3e-2  # low-precision GEMMs may sum in another order
    torch.testing.assert_close(y, y_ref, atol=tol, rtol=tol)
    for a, b in zip(grads, grads_ref):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("mode", ["autocast-fp16", "fp16-weights"])
def test_fp16_products_use_the_a_b_transposed_layout(monkeypatch, mode):
    # On CPUs emulating fp16, a @ b (b contiguous) is ~40x slower than a @ b^T: every product of the
    # fp16 path must take its right operand as the transpose of a contiguous matrix.
    bf16_cpu(monkeypatch, True)
    dtype, autocast_dtype = MODES[mode]
    layer, _ = pair(True, dtype, (60, 36))
    right_operands = []
    matmul = torch.Tensor.__matmul__

    def recording_matmul(a, b):
        right_operands.append(b)
        return matmul(a, b)

    monkeypatch.setattr(torch.Tensor, "__matmul__", recording_matmul)
    run(layer, torch.randn(2, 7, 60, dtype=dtype), torch.randn(2, 7, 36), autocast_dtype)
    assert len(right_operands) == 3  # forward, input gradient, weight gradient
    assert all(b.dim() == 2 and b.t().is_contiguous() and not b.is_contiguous() for b in right_operands)


def test_native_bf16_products_take_the_forward_from_the_contiguous_transpose(monkeypatch):
    """Where bf16 is native: x @ (W^T contiguous) forward, grad @ W for the input, grad^T @ x for the weight;
    fp16 there takes F.linear (its layouts were measured where it is emulated)."""
    bf16_cpu(monkeypatch, False)
    layer, _ = pair(True, torch.float32, (60, 36))
    operands = []
    matmul = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: operands.append((a, b)) or matmul(a, b))
    run(layer, torch.randn(2, 7, 60), torch.randn(2, 7, 36), torch.bfloat16)
    (x, w_t), (grad, w), (grad_t, flat_x) = operands
    assert w_t.shape == (60, 36) and w_t.is_contiguous() and w.shape == (36, 60) and w.is_contiguous()
    assert grad_t.shape == (36, 14) and flat_x.shape == (14, 60)
    half, _ = pair(True, torch.float16, (60, 36))
    assert half._emulated_dtype(torch.randn(2, 60, dtype=torch.float16)) is None
    bf16_cpu(monkeypatch, True)
    assert half._emulated_dtype(torch.randn(2, 60, dtype=torch.float16)) == torch.float16


@pytest.mark.parametrize("rows,cols", [(1, 5), (130, 7), (257, 300)])
def test_the_blocked_transposing_copy_is_the_transpose(rows, cols):
    t = torch.randn(rows, cols)
    for dtype in (torch.float32, torch.bfloat16):
        copy = linear._contiguous_t(t, dtype)
        assert copy.is_contiguous() and torch.equal(copy, t.t().to(dtype))


def test_low_precision_function_in_float64():
    # float64 takes the NT formulas (as fp16 does); create_graph the plain ones.
    torch.manual_seed(1)
    x = torch.randn(4, 5, 9, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 9, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, dtype=torch.float64, requires_grad=True)

    def f(x, w, b):  # the cached low-precision copies are detached: rebuilt from the perturbed w
        return _EmulatedLowPrecisionLinear.apply(x, w, b, w.detach().clone(), w.detach().t().contiguous())

    assert torch.autograd.gradcheck(f, (x, w, b))
    assert torch.autograd.gradcheck(f, (x, w, None))
    assert torch.autograd.gradgradcheck(f, (x, w, b))


def test_cached_low_precision_weights_follow_the_parameter(monkeypatch):
    torch.manual_seed(3)
    layer = fast_linear(40, 24).train()
    x = torch.randn(2, 9, 40, requires_grad=True)

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return layer(x)

    forward()
    cached = layer._low_precision_cache[1]
    forward()
    assert layer._low_precision_cache[1] is cached  # unchanged parameter: no new cast
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # what an optimizer step does: the version counter moves
    y = forward()
    assert layer._low_precision_cache[1] is not cached
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(y, expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("fused", [True, False], ids=["fused-adamw", "adamw"])
def test_cached_low_precision_weights_follow_a_fused_optimizer_step(fused):
    """Fused AdamW (the trainer's on CPU) updates the weight without moving its version counter: the cast
    weights must still be those of after the step, as the plain layer's."""
    torch.manual_seed(5)
    ours, ref = pair(True, torch.float32, (16, 8))
    ours.train(), ref.train()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1, fused=fused) for m in (ours, ref)]
    x = torch.randn(4, 16)
    for _ in range(3):
        outs = []
        for module, optimizer in zip((ours, ref), optimizers):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = module(x)
            y.float().pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            outs.append(y.detach().float())
        torch.testing.assert_close(outs[0], outs[1], atol=3e-2, rtol=3e-2)


def test_no_grad_rows_in_training_mode_take_the_fast_layouts(monkeypatch):
    torch.manual_seed(4)
    layer = fast_linear(40, 300)
    x = torch.randn(2, linear.BLOCK_ROWS + 3, 40)  # the no-grad recurrent steps of truncated backprop
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = F.linear(x, layer.weight, layer.bias)
        layer.eval()
        assert torch.equal(layer(x), expected)  # evaluation and generation: F.linear, nothing cached
        assert layer._low_precision_cache is None
        layer.train()
        y = layer(x)
    assert layer._low_precision_cache is not None and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, expected, atol=3e-2, rtol=3e-2)
    layer.eval()
    assert layer._low_precision_cache is None  # the cached copies are freed for evaluation


def test_under_torch_compile_the_product_runs_outside_the_graph_on_the_cached_weights():
    """compile_core's case: the graphs hold the element-wise work; each product breaks out of them and
    runs the eager fast path (cached low-precision weights), so results equal the eager module's."""
    from torch._dynamo.utils import counters

    torch.manual_seed(5)
    mlp = torch.nn.Sequential(fast_linear(40, 64), torch.nn.SiLU(), fast_linear(64, 40)).train()
    eager = copy.deepcopy(mlp)
    x = torch.randn(2, linear.BLOCK_ROWS + 1, 40, requires_grad=True)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(mlp, backend="aot_eager", dynamic=False)  # dynamo's graphs without inductor's build
    outputs, grads = [], []
    for module in (compiled, eager):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = module(x)
        x.grad = None
        y.float().square().sum().backward()
        outputs.append(y)
        grads.append([x.grad] + [p.grad for p in module.parameters()])
    breaks = counters["graph_break"]
    torch._dynamo.reset()
    assert breaks and all("_product_outside_graph" in reason for reason in breaks), dict(breaks)
    assert all(layer._low_precision_cache is not None for layer in (mlp[0], mlp[2]))
    torch.testing.assert_close(outputs[0], outputs[1], atol=0, rtol=0)
    for ours, ref in zip(*grads):
        torch.testing.assert_close(ours, ref, atol=0, rtol=0)


def test_inference_mode_in_training_mode_does_not_poison_the_cache(monkeypatch):
    layer = fast_linear(40, 24).train()
    x = torch.randn(2, linear.BLOCK_ROWS, 40)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x.requires_grad_())
    y.float().sum().backward()  # would fail if an inference tensor had been cached and saved
    assert layer.weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blocked_tn_mm_is_the_same_product_on_any_thread_count(dtype):
    torch.manual_seed(2)
    rows = 2 * linear.BLOCK_ROWS + 45  # a short last block
    a, b = torch.randn(37, rows, dtype=dtype), torch.randn(37, 53, dtype=dtype)
    results = [blocked_tn_mm(a, b, threads=n) for n in (1, 2, 3)]
    with torch.inference_mode():  # thread-local, like grad mode: the workers must follow the caller
        results.append(blocked_tn_mm(a, b, threads=2))
    for other in results[1:]:
        assert torch.equal(other, results[0])  # fixed blocks: deterministic whatever the thread count
    reference = a.double().t() @ b.double()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(results[0].double(), reference, atol=tol, rtol=tol)
    assert results[0].shape == (rows, 53) and results[0].dtype == dtype and results[0].is_contiguous()


def test_blocked_tn_mm_reports_a_block_error():
    a, b = torch.randn(5, 300), torch.randn(6, 8)  # inner sizes differ
    with pytest.raises(RuntimeError):
        blocked_tn_mm(a, b, threads=2)


def test_blocked_tn_mm_runs_in_the_caller_when_the_kernel_is_parallel(monkeypatch):
    monkeypatch.setattr(linear, "single_threaded_tn_kernel", lambda dtype: False)
    monkeypatch.setattr(linear, "_worker_pool", lambda threads: pytest.fail("no worker threads expected"))
    a, b = torch.randn(9, 300), torch.randn(9, 5)
    torch.testing.assert_close(blocked_tn_mm(a, b, threads=2), a.t() @ b)


def test_the_kernel_probe_answers_per_dtype_and_thread_count_without_touching_the_rng():
    with OneThread():
        assert linear.single_threaded_tn_kernel(torch.float32)  # one torch thread: nothing to oversubscribe
    linear._probe_tn_kernel.cache_clear()
    before = torch.get_rng_state()
    assert isinstance(linear.single_threaded_tn_kernel(torch.bfloat16), bool)
    assert torch.equal(torch.get_rng_state(), before)  # a resumed run must draw the same numbers


def _product_in_child(queue) -> None:
    ones = torch.ones(4, 300, dtype=torch.bfloat16), torch.ones(4, 3, dtype=torch.bfloat16)
    queue.put(blocked_tn_mm(*ones, threads=2).sum().item())


def test_blocked_tn_mm_works_in_a_forked_child(monkeypatch):
    # The parent's worker threads do not survive fork: the child must build its own pool, not hang.
    import multiprocessing

    monkeypatch.setattr(linear, "single_threaded_tn_kernel", lambda dtype: True)  # use the pool on any CPU
    blocked_tn_mm(torch.ones(4, 300), torch.ones(4, 3), threads=2)  # the parent's pool exists
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_product_in_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == 4 * 300 * 3


# ---------------------------------------------------------------- RMSNorm's hand-written backward
def fast_norm(*args, **kwargs) -> FastRMSNorm:
    norm = RMSNorm(*args, **kwargs)
    assert convert_norms(norm) == 1
    return norm


def composite_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The plain formula (the official implementation's), differentiated by autograd."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("shape", [(2, 7, 48), (1, 1, 5), (3, 33), (4, 2, 3, 16)], ids=str)
@pytest.mark.parametrize("grads_of", ["both", "input-only", "weight-only"])
def test_rms_norm_fast_path_matches_the_composite(shape, grads_of):
    torch.manual_seed(1)
    norm = fast_norm(shape[-1], eps=1e-5)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_cpp_pass_equals_the_plain_module_and_the_torch_backward(dtype, monkeypatch):
    """The C++ norm (where it builds): forward bit for bit the plain module's, with and without a graph;
    gradients those of the torch operations to rounding (70 rows: two weight-gradient chunks), and the
    same on one thread as on two."""
    from recurrent_depth.accel import quant_cpp

    monkeypatch.setenv("RDEPTH_NO_CPP", "0")  # (the suite's conftest turns C++ off)
    if accel_norm._kernels(torch.ones(2, 4), torch.ones(4)) is None:
        pytest.skip(f"the C++ kernels are unavailable: {quant_cpp.failure()}")
    torch.manual_seed(3)
    fast, plain = RMSNorm(96), RMSNorm(96)
    with torch.no_grad():
        fast.weight.uniform_(0.5, 1.5)
    plain.load_state_dict(fast.state_dict())
    convert_norms(fast)
    x = (torch.randn(2, 35, 96) * 3).to(dtype)
    grad = torch.randn(2, 35, 96)
    with torch.no_grad():
        assert torch.equal(fast(x), plain(x))

    def step(use_cpp: bool, threads: int = 2):
        xx = x.clone().requires_grad_()
        fast.weight.grad = None
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with monkeypatch.context() as patch:
                if not use_cpp:
                    patch.setattr(accel_norm, "_kernels", lambda *a: None)
                y = fast(xx)
                y.backward(grad)
        finally:
            torch.set_num_threads(before)
        return y, xx.grad, fast.weight.grad

    y, gx, gw = step(True)
    assert torch.equal(y, plain(x))
    y_torch, gx_torch, gw_torch = step(False)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 gx: an ulp of bf16 where a sum rounds the other way
    torch.testing.assert_close(gx.float(), gx_torch.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(gw, gw_torch, atol=1e-4, rtol=1e-5)
    _, gx_1, gw_1 = step(True, threads=1)
    assert torch.equal(gx, gx_1) and torch.equal(gw, gw_1)


def test_rms_norm_fast_path_gradients_are_exact_in_float64():
    torch.manual_seed(2)
    x = torch.randn(3, 5, 12, dtype=torch.float64, requires_grad=True)
    w = torch.rand(12, dtype=torch.float64).add_(0.5).requires_grad_()

    def fn(x, w):
        return accel_norm._RMSNormFunction.apply(x, w, 1e-6)

    assert torch.autograd.gradcheck(fn, (x, w))
    assert torch.autograd.gradgradcheck(fn, (x, w))  # create_graph=True sees 1/rms depend on x


def test_rms_norm_per_head_gain_matches_the_composite_and_its_gradients():
    # A gain per head [H, D] (QK-norm's qk_norm_per_head) for inputs [B, T, H, D]; the fast path's weight
    # gradient sums over every dimension the gain broadcasts over, never over the heads.
    torch.manual_seed(3)
    norm = fast_norm(16, eps=1e-5, heads=3)
    assert norm.weight.shape == (3, 16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = (torch.randn(2, 7, 3, 16) * 3).requires_grad_()
    ref_x, ref_w = x.detach().clone().requires_grad_(), norm.weight.detach().clone().requires_grad_()
    y, y_ref = norm(x), composite_rms_norm(ref_x, ref_w, 1e-5)
    assert type(y.grad_fn).__name__ == "_RMSNormFunctionBackward" and torch.equal(y, y_ref)
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    torch.testing.assert_close(x.grad, ref_x.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(norm.weight.grad, ref_w.grad, atol=1e-5, rtol=1e-5)
    x64 = torch.randn(2, 3, 3, 6, dtype=torch.float64, requires_grad=True)
    w64 = torch.rand(3, 6, dtype=torch.float64).add_(0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: accel_norm._RMSNormFunction.apply(x, w, 1e-6), (x64, w64))


def test_rms_norm_takes_the_plain_formula_where_the_fast_path_does_not_apply():
    norm = fast_norm(8)
    x = torch.randn(2, 3, 8)
    with torch.no_grad():  # inference: unchanged, no autograd node
        assert torch.equal(norm(x), composite_rms_norm(x, norm.weight, norm.eps))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast training takes the fast path (below)
        assert type(norm(x.requires_grad_()).grad_fn).__name__ == "_RMSNormFunctionBackward"
    assert type(fast_norm(8).double()(x.double()).grad_fn).__name__ != "_RMSNormFunctionBackward"  # fp64 gain


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 7, 48), (3, 33), (2, 5, 3, 16)], ids=str)
def test_rms_norm_fast_path_under_autocast_matches_the_plain_module(x_dtype, shape):
    # bf16 autocast training: fp32 residual inputs, and bf16 inputs (the sandwich norms after a bf16
    # product). The plain module is the reference: forward bit for bit, gradients through the same casts.
    torch.manual_seed(4)
    heads = shape[-2] if len(shape) == 4 else None
    norm = fast_norm(shape[-1], eps=1e-5, heads=heads)
    plain = RMSNorm(shape[-1], eps=1e-5, heads=heads)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        plain.weight.copy_(norm.weight)
    x = (torch.randn(*shape) * 3).to(x_dtype).requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, y_ref = norm(x), plain(ref_x)
    assert type(y.grad_fn).__name__ == "_RMSNormFunctionBackward"
    assert y.dtype == y_ref.dtype == torch.float32 and torch.equal(y, y_ref)
    grad = torch.randn_like(y)
    y.backward(grad)
    y_ref.backward(grad)
    assert x.grad.dtype == x_dtype
    tol = 1e-5 if x_dtype == torch.float32 else 1.6e-2  # bf16: one rounding of the input gradient apart
    torch.testing.assert_close(x.grad, ref_x.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(norm.weight.grad, plain.weight.grad, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- whole models: accel.apply from outside
def model_pair(**overrides) -> tuple[rd.RecurrentDepthLM, rd.RecurrentDepthLM]:
    """A plain tiny model (odd sizes: head dim 12, MLP 100) and a converted copy of it."""
    cfg = rd.ModelConfig.from_preset("tiny", hidden_size=36, num_heads=3, intermediate_size=100, **overrides)
    torch.manual_seed(0)
    plain = rd.RecurrentDepthLM(cfg)
    converted = rd.RecurrentDepthLM(cfg)
    converted.load_state_dict(plain.state_dict())
    convert_linears(converted)
    convert_norms(converted)
    return plain, converted


def forward_backward(model, ids, autocast_dtype=None):
    model.train()
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        out = model(ids, num_steps=(2, 2), init_scale=0.0)
    loss = F.cross_entropy(out.logits.flatten(0, 1).float(), ids.roll(-1, 1).flatten())
    loss.backward()
    return out.logits, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["fp32", "autocast-bf16"])
def test_a_converted_model_matches_the_plain_one(mode):
    plain, converted = model_pair()
    assert any(type(m) is FastLowPrecisionLinear for m in converted.modules())
    assert any(type(m) is FastRMSNorm for m in converted.modules())
    ids = torch.randint(0, 256, (2, 131))  # more than one block of rows in every product
    autocast_dtype = torch.bfloat16 if mode == "autocast-bf16" else None
    logits, grads = forward_backward(converted, ids, autocast_dtype)
    logits_ref, grads_ref = forward_backward(plain, ids, autocast_dtype)
    if mode == "fp32":
        assert torch.equal(logits, logits_ref)  # F.linear and the same norm formula forward: bit for bit
        tol = 1e-5
    else:
        tol = 3e-2
        torch.testing.assert_close(logits, logits_ref, atol=tol, rtol=tol)
    for name, grad in grads_ref.items():
        torch.testing.assert_close(grads[name], grad, atol=tol, rtol=tol, msg=name)


def test_a_converted_model_saves_the_plain_state_dict(tmp_path):
    plain, converted = model_pair()
    assert list(converted.state_dict()) == list(plain.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(converted.state_dict().values(), plain.state_dict().values()))
    plain.save_pretrained(tmp_path / "plain")
    converted.save_pretrained(tmp_path / "converted")
    a, b = load_file(tmp_path / "plain" / "model.safetensors"), load_file(tmp_path / "converted" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "plain" / "config.json").read_text()) == json.loads(
        (tmp_path / "converted" / "config.json").read_text())


def test_apply_converts_and_one_switch_turns_it_off(monkeypatch):
    plain, _ = model_pair()
    assert {type(m) for m in plain.modules()} & {FastLowPrecisionLinear, FastRMSNorm} == set()  # model/ is plain
    assert accel.apply(plain, enabled=False) == {}
    monkeypatch.setenv(accel.DISABLE_ENV, "1")
    assert accel.apply(plain) == {}
    assert not any(type(m) in (FastLowPrecisionLinear, FastRMSNorm) for m in plain.modules())
    monkeypatch.delenv(accel.DISABLE_ENV)
    norms = sum(type(m) is RMSNorm for m in plain.modules())
    linears = sum(type(m) is torch.nn.Linear for m in plain.modules())
    assert accel.apply(plain) == {"norms": norms, "linears": linears}  # (each layer picks its layouts per call)
    assert accel.apply(plain) == {"norms": 0, "linears": 0}  # converted already
    accel.restore(plain)
    assert {type(m) for m in plain.modules()} & {FastLowPrecisionLinear, FastRMSNorm} == set()


@pytest.mark.parametrize("enabled", [True, False], ids=["accel", "no-accel"])
def test_the_trainer_applies_accel_unless_switched_off(tmp_path, enabled):
    from recurrent_depth.train.config import TrainConfig
    from recurrent_depth.train.trainer import Trainer
    from tests.test_trainer_recipes import CountingBatches

    _, model = model_pair()
    accel.restore(model)
    cfg = TrainConfig(batch_size=2, max_steps=1, out=str(tmp_path), progress=False, tensorboard=False, accel=enabled)
    with OneThread():
        trainer = Trainer(cfg, model=model, data=CountingBatches("targets"), log=lambda _: None)
    assert any(type(m) is FastRMSNorm for m in model.modules()) == enabled
    assert json.loads((tmp_path / "run.json").read_text())["accel"] == trainer.accel


def test_bf16_training_steps_move_the_converted_linears_weights(tmp_path):
    """The trainer's AdamW is fused on CPU (no version counter moves): after its steps, the weights the
    converted linears multiply by in a bf16 training forward are the parameters' current ones."""
    from recurrent_depth.train.config import TrainConfig
    from recurrent_depth.train.optim import OptimConfig
    from recurrent_depth.train.trainer import Trainer
    from tests.test_trainer_recipes import CountingBatches

    _, model = model_pair()
    optim = OptimConfig(name="adamw", lr=1e-2, weight_decay=0.0, warmup_steps=0)
    cfg = TrainConfig(batch_size=2, max_steps=2, out=str(tmp_path), progress=False, tensorboard=False,
                      dtype="bfloat16", optim=optim)
    with OneThread():
        trainer = Trainer(cfg, model=model, data=CountingBatches("targets"), log=lambda _: None)
        for _ in range(2):
            trainer.train_step()
        layer = model.transformer.core_block[0].mlp.fc
        assert type(layer) is FastLowPrecisionLinear
        layer.train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(torch.ones(1, layer.in_features, requires_grad=True))
    assert torch.equal(layer._low_precision_cache[1], layer.weight.detach().to(torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(y, F.linear(torch.ones(1, layer.in_features), layer.weight, layer.bias))
