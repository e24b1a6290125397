"""Weight-only int8 quantization for decoding: `quantize_weights(model, "int8")` swaps the model's linear
layers for `Int8WeightLinear` (int8 weights, one scale per output channel, activations unquantized).

Decoding a large model streams every weight once per recurrence step, so it is bound by memory
bandwidth; int8 weights halve the bytes of bf16 ones. The product uses torch's CPU kernel
`aten._weight_int8pack_mm` where it is exact to its bf16 output (bf16 activations and `in_features` a
multiple of 16: measured here, other widths read past the rows and return NaN or crash), and otherwise
the plain reference: dequantize (`int8 * scale`, in the activations' dtype) then `F.linear`. Both
compute `x (q * s)^T + b` with the same `q` and `s`, so a model whose linears hold the dequantized
weights is the reference of a quantized one (tested).

Which layers: every `nn.Linear` of the transformer (the prelude, core and coda blocks' attention and
MLP linears and the recurrence adapter); the embedding and the output head stay as they are unless
`include_head=True` (the head is read once per token, not once per step, and carries the logits).

int4 is refused (`check_weights`): not implemented yet. torch's CPU group-wise int4 kernel
(`_weight_int4pack_mm_for_cpu`) would pay at batch 1 (measured in docs/inference.md), but its
packing and its checks against a reference are not written.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WEIGHT_FORMATS = ("int8",)

# The widths `aten._weight_int8pack_mm` computes correctly (measured: K % 16 != 0 gives NaN or a crash).
KERNEL_K_MULTIPLE = 16

_INT4_REFUSAL = ("weights='int4' is not implemented yet (group-wise int4 packing for torch's CPU kernel is not "
                 "written, see docs/inference.md 'Weight-only quantization'); use weights='int8'")


def check_weights(weights: str | None) -> str | None:
    """`weights` if it is a supported format (or None: keep the weights as loaded); else a one-line ValueError."""
    if weights is None or weights in WEIGHT_FORMATS:
        return weights
    if weights == "int4":
        raise ValueError(_INT4_REFUSAL)
    raise ValueError(f"weights={weights!r} is invalid: expected one of {list(WEIGHT_FORMATS)} (or None)")


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8: (q int8 `[out, in]`, scales float32 `[out]`) with
    `weight ~ q * scales[:, None]`, |error| <= scale / 2 per entry.

    The scales are rounded to bf16 values before the rounding to int8, so the kernel (which takes
    them in the activations' dtype) and the float32 reference use the same scale exactly."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scales = (amax / 127).to(torch.bfloat16).float()
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row: q = 0 with any scale
    # bf16 rounding can put amax / scale slightly above 127: clamp (the error bound still holds, see the test)
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The weight `q * scales[:, None]` in `dtype` (computed in float32, then cast)."""
    return (q.float() * scales[:, None]).to(dtype)


class Int8WeightLinear(nn.Module):
    """A linear layer with int8 weights and per-output-channel scales: `y = x (q * s)^T + b`.

    Buffers `qweight` (int8 `[out, in]`) and `scales` (float32 `[out]`); the bias (if any) stays a
    parameter in the model's dtype. Made by `quantize_weights`; inference only (no weight gradient).
    """

    def __init__(self, qweight: Tensor, scales: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.weight_dtype = torch.float32 if bias is None else bias.dtype  # the dtype `dequantized` restores

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8WeightLinear:
        q, scales = quantize_int8(linear.weight)
        layer = cls(q.to(linear.weight.device), scales.to(linear.weight.device), linear.bias)
        layer.weight_dtype = linear.weight.dtype
        return layer

    def uses_kernel(self, x: Tensor) -> bool:
        """Whether this call takes torch's int8 kernel (bf16 on CPU at a supported width), else the reference."""
        return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and self.in_features % KERNEL_K_MULTIPLE == 0
                and not torch.compiler.is_compiling())

    def forward(self, x: Tensor) -> Tensor:
        if not self.uses_kernel(x):
            return F.linear(x, dequantize_int8(self.qweight, self.scales, x.dtype),
                            None if self.bias is None else self.bias.to(x.dtype))
        flat = x.reshape(-1, self.in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales.to(x.dtype))
        if self.bias is not None:
            out += self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> nn.Linear:
        """The plain nn.Linear holding this layer's dequantized weight (the reference model's layer)."""
        dtype = self.weight_dtype
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=self.qweight.device, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(dequantize_int8(self.qweight, self.scales, dtype))
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _replace_children(root: nn.Module, plain: type[nn.Module], make) -> int:
    count = 0
    # The parents only: a list holding the replaced layers would keep both copies in memory until the end.
    for parent in [m for m in root.modules() if type(m) is not plain]:
        for name, child in list(parent.named_children()):
            if type(child) is plain:
                setattr(parent, name, make(child))
                count += 1
    return count


def quantize_weights(model: nn.Module, weights: str | None = "int8", include_head: bool = False) -> int:
    """Quantize `model` (a `RecurrentDepthLM`) in place; returns the number of layers swapped.

    weights: "int8" (None: nothing). Every `nn.Linear` under `model.transformer` becomes an
    `Int8WeightLinear`; `include_head` also quantizes an untied `lm_head` (a tied one shares the
    embedding's storage: ValueError)."""
    if check_weights(weights) is None:
        return 0
    if include_head and model.config.tie_embeddings:
        raise ValueError("include_head=True needs an untied lm_head: this model ties it to the embedding")
    with torch.no_grad():
        count = _replace_children(model.transformer, nn.Linear, Int8WeightLinear.from_linear)
        if include_head and type(model.lm_head) is nn.Linear:
            model.lm_head = Int8WeightLinear.from_linear(model.lm_head)
            count += 1
    return count


def dequantize_weights(model: nn.Module) -> int:
    """Undo `quantize_weights` up to its rounding: every `Int8WeightLinear` becomes the plain
    nn.Linear holding its dequantized weight (in the dtype it was quantized from). Returns how many."""
    return _replace_children(model, Int8WeightLinear, Int8WeightLinear.dequantized)


def quantized_weights(model: nn.Module) -> bool:
    """Whether any layer of `model` holds int8 weights."""
    return any(isinstance(m, Int8WeightLinear) for m in model.modules())
