"""The CPU bf16/fp16 product: `convert_linears(model)` makes a model's nn.Linear layers compute their
low-precision training products in the fast GEMM layouts of the CPU (emulated bf16/fp16, or native bf16).

On CPUs without native bf16 (no AVX512-BF16 or AMX), oneDNN's low-precision GEMMs differ by up to
60x between layouts. Measured on a 2-core AVX2 EPYC at 2 threads, GFLOP/s of the products of one
linear layer ([256 tokens] x 1024 -> 5632; other shapes alike):

                                          bf16   fp16
    a @ b^T  (NT; the forward's layout)     21     22-27  (scales with threads)
    a @ b    (NN; autograd's input grad)   0.6    0.6
    a^T @ b  (TN; autograd's weight grad)    8      5     (one thread; bf16 18-25 below ~3000 rows)
    a^T @ b in blocks of 128 result rows,
      one block per worker thread          39     10

So bf16 computes all three products as blocked TN (`blocked_tn_mm`; the forward and the input
gradient copy the activation or its gradient transposed, tokens*features against tokens*in*out
multiply-adds, and use W^T / W cast once per parameter update), and fp16 computes all three as NT.
Blocks are fixed row ranges, so results do not depend on the thread count, and equal the unblocked
product (tested).

NATIVE_BF16: on CPUs with native bf16 products (AMX / AVX512-BF16) ATen's products are fast in every
layout but one: x @ W^T (the forward's a @ b^T) runs 1.3-1.5x slower than x @ (W^T contiguous) at the
MLP's shapes (a 2-core Xeon with AMX, 1024 tokens, medians of 7 interleaved rounds, two runs:
[1024 x 1024] x [1024 x 5632] 18.1-20.1 ms against 13.4-13.6; [1024 x 2816] x [2816 x 1024] 9.9-10.5
against 7.5-7.7; the other shapes within 5 %). There the forward multiplies by the cached contiguous
W^T, the input gradient by W (a @ b) and the weight gradient is autograd's grad^T @ x.

COMPILED: under torch.compile (the trainer's `compile: true` compiles each core block) the low-precision
product runs outside the graph (`torch.compiler.disable`: a graph break at each such layer), so the
graphs fuse the norms, RoPE, SwiGLU and residual adds between the products while the products keep the
fast layouts and the weights cast once per update. Traced instead, the block cast and transposed every
weight at every recurrent step, and `cpu_emulates_bf16()` broke the graph inside the layer anyway.

The worker count is `torch.get_num_threads()`: on the CPUs measured, the emulated bf16 a^T @ b
kernel runs on the calling thread only (process CPU time = wall time), so the blocks do not
oversubscribe the cores; where it is itself parallel (probed once per dtype), the blocks run one
after another in the caller.

The conversion changes each layer's class only (`FastLowPrecisionLinear`, a subclass of nn.Linear with
no parameters or buffers of its own): the parameters, their names and the state dict stay the model's.
`recurrent_depth.accel.apply` converts on every machine (fp32, other devices and, where bf16 is native,
fp16 calls take F.linear as before).
"""

from __future__ import annotations

import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from recurrent_depth.accel.cpu import cpu_emulates_bf16
from recurrent_depth.accel.swap import swap_class

# Result rows per product of `blocked_tn_mm`: fixed, so that results never depend on the thread count.
BLOCK_ROWS = 128

# Optimizer steps taken in this process (any `torch.optim.Optimizer`), part of the cached weights' key: fused
# kernels (`torch.optim.AdamW(fused=True)`, the trainer's on CPU) update parameters in place without moving
# their version counters, so the version alone would keep serving the weights of before the step.
_optimizer_steps = 0


def _count_optimizer_step(optimizer: object, args: object, kwargs: object) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)

_pool: tuple[int, ThreadPoolExecutor] | None = None  # (workers, pool)


def _worker_pool(threads: int) -> ThreadPoolExecutor:
    """One pool per process, rebuilt when the thread count changes."""
    global _pool
    if _pool is None or _pool[0] != threads:
        if _pool is not None:
            _pool[1].shutdown(wait=False)
        _pool = (threads, ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rdepth-blocked-mm"))
    return _pool[1]


def _forget_pool_in_child() -> None:
    # A forked child (e.g. a DataLoader worker) inherits the pool object but not its threads.
    global _pool
    _pool = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


def single_threaded_tn_kernel(dtype: torch.dtype) -> bool:
    """Whether torch.mm's a^T @ b in `dtype` runs on the calling thread only (process CPU time about
    equal to wall time over a few block-sized products).

    When it does not (a CPU whose kernel is itself parallel), worker threads would oversubscribe the
    cores, so `blocked_tn_mm` runs its blocks one after another instead. Either way each block is
    the same product, so this timed probe changes speed, never results.
    """
    return _probe_tn_kernel(dtype, torch.get_num_threads())


@functools.cache
def _probe_tn_kernel(dtype: torch.dtype, torch_threads: int) -> bool:
    if torch_threads == 1:
        return True
    # Constant operands: the probe must not draw from torch's global generator (a resumed run would differ).
    a, b = torch.full((512, BLOCK_ROWS), 0.5, dtype=dtype), torch.full((512, 1024), 0.25, dtype=dtype)
    torch.mm(a.t(), b)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(3):
        torch.mm(a.t(), b)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return cpu < 1.3 * wall


def blocked_tn_mm(a: Tensor, b: Tensor, threads: int | None = None) -> Tensor:
    """a^T @ b for a [K, M] and b [K, N], as products of BLOCK_ROWS rows of the [M, N] result.

    The blocks run on `threads` worker threads (default `torch.get_num_threads()`) when the torch.mm
    kernel is single-threaded (`single_threaded_tn_kernel`); otherwise, or on one thread, they run in
    the caller. Not differentiable: for forward and backward passes of a Function.
    """
    rows = a.shape[1]
    result = a.new_empty(rows, b.shape[1])
    starts = range(0, rows, BLOCK_ROWS)

    inference = torch.is_inference_mode_enabled()  # thread-local, like grad mode: carried to the workers

    def block(start: int) -> None:
        stop = min(start + BLOCK_ROWS, rows)
        with torch.inference_mode(inference), torch.no_grad():  # this order: inference_mode(False) enables grad
            torch.mm(a[:, start:stop].t(), b, out=result[start:stop])

    threads = torch.get_num_threads() if threads is None else threads
    if threads <= 1 or len(starts) == 1 or not single_threaded_tn_kernel(a.dtype):
        for start in starts:
            block(start)
    else:
        list(_worker_pool(threads).map(block, starts))  # list(): waits, and re-raises a block's error
    return result


def _contiguous_t(t: Tensor, dtype: torch.dtype) -> Tensor:
    """t^T (t 2-D) as a contiguous tensor of `dtype`: one pass for the cast and the transpose together,
    BLOCK_ROWS rows of t at a time.

    (`t.t().to(dtype, memory_format=torch.contiguous_format)` returns the strided view as is when the
    dtype already matches. ATen's transposing copy of a whole matrix is 1.3-3.5x slower than in blocks
    of 128 rows, whose columns stay in cache: a bf16 [5632, 1024] weight 12.4 ms whole, 5.1 ms in blocks,
    [1024, 5632] 13.2 against 4.4, on a 2-core AVX-512 Xeon.)
    """
    out = t.new_empty((t.shape[1], t.shape[0]), dtype=dtype)
    for start in range(0, t.shape[0], BLOCK_ROWS):
        out[:, start:start + BLOCK_ROWS].copy_(t[start:start + BLOCK_ROWS].t())
    return out


def _use_blocked(dtype: torch.dtype) -> bool:
    """Blocked a^T @ b for emulated bf16 (the fast layout there)."""
    return dtype == torch.bfloat16 and cpu_emulates_bf16()


def _native(dtype: torch.dtype) -> bool:
    """bf16 on a CPU with native bf16 products (AMX / AVX512-BF16): ATen's products in the plain layouts,
    the forward from the contiguous W^T (a @ b: see NATIVE_BF16 in the module docstring)."""
    return dtype == torch.bfloat16 and not cpu_emulates_bf16()


def _forward_product(x2d: Tensor, low_weight: Tensor, low_weight_t: Tensor, bias: Tensor | None,
                     blocked: bool) -> Tensor:
    """x W^T (+ b): blocked a^T @ b of x^T and W^T for emulated bf16, a @ b of x and W^T for native bf16,
    else a @ b^T of x and W."""
    dtype = low_weight.dtype
    if blocked:
        out = blocked_tn_mm(_contiguous_t(x2d.to(dtype), dtype), low_weight_t)
    elif _native(dtype):
        out = x2d.to(dtype) @ low_weight_t
    else:
        out = x2d.to(dtype) @ low_weight.t()
    if bias is not None:
        out += bias.to(dtype)
    return out


class _EmulatedLowPrecisionLinear(torch.autograd.Function):
    """y = x W^T + b computed in the dtype of `low_weight` (bf16 or fp16) in the fast layouts.

    `low_weight` and `low_weight_t` are W and W^T, contiguous in that dtype, not differentiable
    (the Linear caches them while the parameter does not change); the gradient is returned for
    `weight`, in its own dtype (fp32 under autocast). Results equal F.linear's up to the summation
    order of the GEMMs. See the module docstring for the layouts.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, low_weight: Tensor,
                low_weight_t: Tensor) -> Tensor:
        dtype = low_weight.dtype
        x = x.to(dtype)
        ctx.save_for_backward(x, weight, low_weight, low_weight_t)
        ctx.has_bias = bias is not None
        out = _forward_product(x.reshape(-1, x.shape[-1]), low_weight, low_weight_t, bias, _use_blocked(dtype))
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, low_weight, low_weight_t = ctx.saved_tensors
        dtype = low_weight.dtype
        grad = grad.to(dtype).reshape(-1, grad.shape[-1])
        flat_x = x.reshape(-1, x.shape[-1])
        if torch.is_grad_enabled():
            # backward(create_graph=True): plain products of the differentiable weight.
            low_weight = weight.to(dtype)
            low_weight_t = low_weight.t()
        plain = torch.is_grad_enabled()  # differentiable products
        blocked = not plain and _use_blocked(dtype)
        grad_x = grad_w = grad_b = None
        native = _native(dtype)
        if ctx.needs_input_grad[0]:
            if blocked:
                grad_x = blocked_tn_mm(_contiguous_t(grad, dtype), low_weight)
            elif native:
                grad_x = grad @ low_weight
            else:
                grad_x = grad @ low_weight_t.t()  # a @ b^T, not a @ b
            grad_x = grad_x.view(x.shape)
        if ctx.needs_input_grad[1]:
            if blocked:
                grad_w = blocked_tn_mm(grad, flat_x)
            elif plain or native:
                grad_w = grad.t() @ flat_x
            else:  # a @ b^T from transposed copies (fp16: 3-5x faster than a^T @ b)
                grad_w = _contiguous_t(grad, dtype) @ _contiguous_t(flat_x, dtype).t()
            grad_w = grad_w.to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(0, dtype=torch.promote_types(dtype, torch.float32))  # sum in fp32 at least
        return grad_x, grad_w, grad_b, None, None


class FastLowPrecisionLinear(nn.Linear):
    """nn.Linear (same parameters and state dict) whose bf16/fp16 products on CPU use the fast layouts
    (see `_EmulatedLowPrecisionLinear`); fp32, other devices and other calls go to F.linear.

    Taken when a gradient is needed, or in training mode for rows of at least BLOCK_ROWS tokens
    (the no-grad recurrent steps of truncated backprop). In training mode W and W^T in the low
    dtype are cached until the parameter changes (its version counter moves: an in-place update, a
    load; or any `torch.optim` optimizer steps, fused ones included, which move no version counter),
    instead of being cast again at every recurrent step. Made by `convert_linears`.
    """

    _low_precision_cache: tuple[tuple, Tensor, Tensor] | None = None

    def forward(self, x: Tensor) -> Tensor:
        dtype = self._emulated_dtype(x)
        if dtype is None:
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            return self._product_outside_graph(x)
        # Not cached under inference_mode: its tensors cannot be saved for a later backward.
        cache = self.training and not torch.is_inference_mode_enabled()
        low_weight, low_weight_t = self._low_precision_weights(dtype, cache=cache)
        with torch.autocast("cpu", enabled=False):
            if torch.is_grad_enabled():
                return _EmulatedLowPrecisionLinear.apply(x, self.weight, self.bias, low_weight, low_weight_t)
            out = _forward_product(x.reshape(-1, x.shape[-1]), low_weight, low_weight_t, self.bias,
                                   _use_blocked(dtype))
            return out.view(*x.shape[:-1], self.out_features)

    def _product_outside_graph(self, x: Tensor) -> Tensor:
        """Under torch.compile (`compile_core`), the product runs here, between the graphs: in the fast
        layout with the cached low-precision weights, while the graphs around it fuse the element-wise
        work. Traced, it would cast and transpose the weights again at every call and take the slow
        layouts (COMPILED in the module docstring). `convert_linears` marks it `torch.compiler.disable`."""
        return self.forward(x)

    def train(self, mode: bool = True) -> FastLowPrecisionLinear:
        if not mode:
            self._low_precision_cache = None  # evaluation and generation do not use it: free the memory
        return super().train(mode)

    def _emulated_dtype(self, x: Tensor) -> torch.dtype | None:
        """The low-precision dtype this call computes in, when the fast layouts apply; else None."""
        if x.device.type != "cpu":
            return None
        if not torch.is_grad_enabled() and not (self.training and x.numel() >= BLOCK_ROWS * x.shape[-1]):
            return None
        if torch.is_autocast_enabled("cpu"):
            dtype = torch.get_autocast_dtype("cpu")
        elif x.dtype == self.weight.dtype:
            dtype = x.dtype
        else:
            return None
        if dtype == torch.float16 and not cpu_emulates_bf16():
            return None  # (the fp16 layouts were measured where bf16 is emulated only)
        return dtype if dtype in (torch.bfloat16, torch.float16) else None

    def _low_precision_weights(self, dtype: torch.dtype, cache: bool) -> tuple[Tensor, Tensor]:
        """(W, W^T) as contiguous `dtype` tensors without autograd history."""
        weight = self.weight.detach()
        key = (dtype, weight.data_ptr(), weight._version, _optimizer_steps)
        if cache and self._low_precision_cache is not None and self._low_precision_cache[0] == key:
            return self._low_precision_cache[1:]
        low_weight = weight.to(dtype).contiguous()
        low_weight_t = _contiguous_t(low_weight, dtype)
        if cache:
            self._low_precision_cache = (key, low_weight, low_weight_t)
        return low_weight, low_weight_t


def convert_linears(model: nn.Module) -> int:
    """Make every plain nn.Linear of `model` a `FastLowPrecisionLinear` in place; returns how many.

    Only the class changes (parameters, hooks and state dict are the layer's own), so the conversion
    can come before or after the optimizer is built. Subclasses of nn.Linear are left alone."""
    _keep_product_outside_graphs()
    return swap_class(model, nn.Linear, FastLowPrecisionLinear)


def _keep_product_outside_graphs() -> None:
    """Mark `FastLowPrecisionLinear._product_outside_graph` `torch.compiler.disable` (a graph break), once, when
    the first layers are made: the decorator imports torch._dynamo (about 1 s), which every command paid at
    start-up as a decorator at class definition, while only runs that convert layers (training) can need it."""
    method = FastLowPrecisionLinear.__dict__["_product_outside_graph"]
    if not getattr(method, "_torchdynamo_disable", False):
        FastLowPrecisionLinear._product_outside_graph = torch.compiler.disable(method)


def restore_linears(model: nn.Module) -> int:
    """Undo `convert_linears`: plain nn.Linear layers again (cached low-precision weights dropped)."""
    for module in model.modules():
        if type(module) is FastLowPrecisionLinear:
            module.__dict__.pop("_low_precision_cache", None)
    return swap_class(model, FastLowPrecisionLinear, nn.Linear)
