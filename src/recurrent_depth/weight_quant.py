"""Weight-only quantization for decoding: `quantize_weights(model, "int8" | "int4")` swaps the model's
linear layers for `Int8WeightLinear` (int8 weights, one scale per output channel) or
`Int4WeightLinear` (4-bit weights, a scale and a zero point per group of input columns);
activations stay unquantized.

Decoding a large model streams every weight once per recurrence step, so it is bound by memory
bandwidth; int8 weights halve the bytes of bf16 ones, int4 ones (group 32) take 0.625 bytes a weight.

int8: float32 or bf16 activations of at most 8 rows (decoding) take the C++
`accel.quant_cpp.int8_linear` (each int8 weight row streamed once, 1 byte read a weight; float32 rows
dotted in float32, times the scale: the reference to float32 rounding; bf16 rows as int16 multiples of
a power of two, dotted exactly in integers, rounded once: within bf16 rounding of the reference, plus
2^-16 of the row's scale for entries below 2^-8 of its largest; a Huginn-shape bf16 decode at ~0.78 of
the memory roofline on a 2-core AVX2 EPYC, where torch's kernel reached ~0.58); other bf16 calls
(short prompts: at most KERNEL_MAX_ROWS rows, past which the reference is faster) use torch's CPU kernel
`aten._weight_int8pack_mm` where it is exact to its bf16 output
(`in_features` a multiple of 16: measured here, other widths read past the rows and return NaN or
crash); otherwise (and for calls with autograd through the activations, e.g. GradMem's: torch's kernels
have no derivative) the plain reference: dequantize (`int8 * scale`, in the activations' dtype) then
`F.linear`.

int4 (`"int4"` = `"int4:g32"`; `"int4:g64"`, `"int4:g128"`, `"int4:g256"`): asymmetric per group,
`w = (q - 8) * scale + zero` with q in 0..15. Where the C++ kernels are on (the default), every layer
stores two 4-bit values a byte in plain order with its (scale, zero) pairs in bf16, row-major, and
float32 or bf16 activations of at most 8 rows (decoding) take the C++ `accel.quant_cpp.int4_linear`
(each packed row streamed once; bf16 rows dotted in integers as for int8: 1.3-2.2x the bf16 weight
stream per product at Huginn's shapes on a 2-core AVX2 EPYC, 1.24x a whole decode, where torch's int4
kernel is ~1x; compute-bound there, so below int8's 1.5x); other calls (prompts,
autograd) take the reference: dequantize in float32, then `F.linear` (under autograd its backward
dequantizes again rather than keep the float weight: `_DequantizedLinear`). With C++ off (`RDEPTH_NO_CPP=1`
or no compiler) a layer whose shape torch's CPU kernel `aten._weight_int4pack_mm_for_cpu` accepts
(`out_features % 16 == 0`, `in_features % group == 0`, weights on the CPU: the kernel refuses other
shapes with an error, and is accurate at every shape it accepts, measured) stores the kernel's packed
layout and takes it (but for autograd calls: the reference, its 4-bit values read back through the kernel once);
the others the reference. Group 32 is the default because it is the only size
that divides Huginn-0125's width 5280 (so the only one whose layers take torch's kernel there), and the
most accurate.

nf4 (`"nf4"` = `"nf4:g64"`; `"nf4:g32"`, `"nf4:g128"`, `"nf4:g256"`): QLoRA's 4-bit NormalFloat
(Dettmers et al. 2023): per block of `block` consecutive input weights of a row, `w = NF4_LEVELS[q] * absmax`
with q in 0..15, the 16 levels quantiles of N(0, 1) scaled to [-1, 1] with an exact 0 (`nf4_levels`), the
absmax stored as a bf16 value (QLoRA keeps float32), two codes a byte as int4's plain layout: 0.53125 bytes a weight
at block 64. `"nf4:dq"` (`"nf4:dq:g<block>"`) double-quantizes the absmax as QLoRA does: an 8-bit code a block and a
float32 step per 256 blocks (`quantize_nf4_dq`: 0.5159 bytes a weight at block 64). float32 or bf16 activations of
at most NF4_CPP_ROWS rows (decoding, short prompts) take the C++ `accel.quant_cpp.nf4_linear` (each packed row
streamed once; per block its 16 levels times its absmax, the reference's float32 weights, looked up a lane permute
at a time and summed in float32: ~1.1x the time of int4's C++ product for a bf16 decode row at 2048 x 5632,
docs/inference.md); other calls (longer prompts, autograd, `RDEPTH_NO_CPP=1`) take the reference (a table lookup
of each byte's two levels, times the block's absmax, then `F.linear`). Its point is accuracy per byte: one scale a
block where int4 keeps a scale and a zero, so at the same bytes its blocks are half as long, and on Gaussian
weights its round-trip error is below int4's at equal bytes (nf4:gN against int4:g2N, tested; at the same block
size int4's two parameters win at 32 and 64).

All formats compute `x W^T + b` with the weight their reference dequantizes, so a model whose
linears hold the dequantized weights (`dequantize_weights`) is the reference of a quantized one
(tested: bit-equal where a layer takes the reference, within the kernel's rounding where not).

Which layers: every `nn.Linear` of the transformer (the prelude, core and coda blocks' attention and
MLP linears and the recurrence adapter); the embedding and the output head stay as they are unless
`include_head=True` (the head is read once per token, not once per step, and carries the logits).

LoRA on quantized weights (QLoRA-style, unmerged): `train.lora` loads peft adapters onto these layers
(peft's LoRA layer over the quantized one, through peft's custom-module dispatch), and `quantize_weights`
on a model that already carries adapters quantizes each LoRA layer's `base_layer` only, never the
adapters' own `lora_A` / `lora_B`. Either way a layer computes `base(x) + scale B A x` with `base` this
module's product. Each layer keeps `source_samples`, the values of its float weight that the adapters'
base fingerprint (`train.lora.base_fingerprint`) hashes, so an adapter trained on the float model is
recognized on its quantized copy. DoRA (which reads the base weight's norm) and merging into these
weights are refused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WEIGHT_FORMATS = ("int8", "int4", "nf4", "nf4:dq")  # all but int8 also take a group (block) size: "int4:g64"

# The widths `aten._weight_int8pack_mm` computes correctly (measured: K % 16 != 0 gives NaN or a crash).
KERNEL_K_MULTIPLE = 16
# The most rows `aten._weight_int8pack_mm` takes: its time grows with the rows (~33 ps a weight a row, measured on
# a shared 2-core Xeon), the reference's (dequantize once, then a bf16 GEMM) hardly does, so more rows (a long prompt,
# QLoRA's no-grad recurrence steps) take the reference: at 128 rows 3x faster at 1024 x 5632, even at Huginn's
# 5280 x 15840; at 512 rows 4-8x. At 16 rows the kernel is 2-7x the faster.
KERNEL_MAX_ROWS = 64
# float32 or bf16 activations of at most this many rows (a decode step) take the C++ int8 product; more
# rows (a prompt) torch's kernel (bf16) or the reference, which read the weight once for all of them.
CPP_ROWS = 8
CPP_DTYPES = (torch.float32, torch.bfloat16)

INT4_GROUP_SIZES = (32, 64, 128, 256)  # the group sizes torch's CPU int4 kernel takes
INT4_DEFAULT_GROUP = 32
INT4_KERNEL_N_MULTIPLE = 16  # `_convert_weight_to_int4pack_for_cpu` needs out_features % 16 == 0
INT4_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT4_OFFSET = 8  # the kernel reads a stored 4-bit value q as q - 8
NF4_BLOCK_SIZES = (32, 64, 128, 256)  # (multiples of the C++ product's 32-column chunk: int4's, QLoRA's 64 the default)
NF4_DEFAULT_BLOCK = 64
# Double quantization ("nf4:dq"): the absmax of each block as an 8-bit code, a float32 step per NF4_DQ_BLOCK codes
# (QLoRA's 256) of the layer's flattened [out, blocks] codes: absmax = code * step, code in 1..NF4_DQ_LEVELS.
NF4_DQ_BLOCK = 256
NF4_DQ_LEVELS = 255
# The most rows the C++ nf4 product takes (decode steps and short prompts): far more than int8's and int4's CPP_ROWS,
# as nf4's reference dequantizes the whole layer through a table before its product (measured at 2048 x 5632, one
# thread, shared 2-core Xeon: bf16 rows 128 -> 72 ms against the reference's 95, 192 -> 110 against 92; fp32 at 128
# rows 75 against 122), so longer prompts take the reference.
NF4_CPP_ROWS = 128
# Values of each weight, spread evenly over it, that `train.lora.base_fingerprint` hashes; a quantized layer keeps
# those of the float weight it was made from (`QuantizedLinear.source_samples`).
FINGERPRINT_SAMPLES = 64
PEFT_ADAPTER_PREFIX = "lora_"  # peft's containers of a LoRA layer's adapters (lora_A, lora_B, lora_dropout, ...)


def spread_samples(tensor: Tensor, count: int = FINGERPRINT_SAMPLES) -> Tensor:
    """`count` values of `tensor` (flattened; all of a smaller one) spread evenly over it, first and last included."""
    flat = tensor.detach().reshape(-1)
    index = torch.linspace(0, flat.numel() - 1, min(flat.numel(), count), dtype=torch.float64).round().long()
    return flat[index.to(flat.device)]


# The group (block) sizes and the default of each format that takes one ("int4:g64", "nf4:g128", "nf4:dq:g128").
_GROUPED = {"int4": (INT4_GROUP_SIZES, INT4_DEFAULT_GROUP), "nf4": (NF4_BLOCK_SIZES, NF4_DEFAULT_BLOCK),
            "nf4:dq": (NF4_BLOCK_SIZES, NF4_DEFAULT_BLOCK)}


def _invalid(weights: object) -> ValueError:
    groups = ", ".join(f"'int4:g{g}'" for g in INT4_GROUP_SIZES)
    blocks = ", ".join(f"'nf4:g{g}'" for g in NF4_BLOCK_SIZES)
    return ValueError(f"weights={weights!r} is invalid: expected 'int8', 'int4' (group {INT4_DEFAULT_GROUP}) "
                      f"or one of {groups}, 'nf4:dq' (8-bit absmax) or 'nf4:dq:g<block>' for any nf4 block, "
                      f"'nf4' (block {NF4_DEFAULT_BLOCK}) or one of {blocks} (or None)")


def parse_weights(weights: str | None) -> tuple[str, int | None] | None:
    """("int8", None), ("int4", group), ("nf4", block) or ("nf4:dq", block) for a valid `weights` string
    (`KIND[:g<size>]`), None for None; else a one-line ValueError."""
    if weights is None:
        return None
    if weights == "int8":
        return "int8", None
    # the longest kind that prefixes it ("nf4:dq:g32" is nf4:dq's, not nf4's with a suffix ":dq:g32")
    kind = max((k for k in _GROUPED if isinstance(weights, str) and weights.startswith(k)), key=len, default=None)
    if kind is None:
        raise _invalid(weights)
    sizes, default = _GROUPED[kind]
    suffix = weights[len(kind):]
    if suffix == "":
        return kind, default
    if suffix.startswith(":g") and suffix[2:].isdigit() and int(suffix[2:]) in sizes:
        return kind, int(suffix[2:])
    raise _invalid(weights)


def check_weights(weights: str | None) -> str | None:
    """`weights` if it is a supported format (or None: keep the weights as loaded); else a one-line ValueError."""
    parse_weights(weights)
    return weights


# ---------------------------------------------------------------- int8, per output channel


def quantize_int8(weight: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8: (q int8 `[out, in]`, scales float32 `[out]`) with
    `weight ~ q * scales[:, None]`, |error| <= scale / 2 per entry.

    The scales are rounded to bf16 values before the rounding to int8, so the kernel (which takes
    them in the activations' dtype) and the float32 reference use the same scale exactly."""
    w = weight.detach().float()
    # (amax refuses an empty row: a zero-width layer's rows are all-zero ones)
    amax = w.abs().amax(dim=1) if w.shape[1] else w.new_zeros(w.shape[0])
    scales = (amax / 127).to(torch.bfloat16).float()
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero row: q = 0 with any scale
    # bf16 rounding can put amax / scale slightly above 127: clamp (the error bound still holds, see the test)
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The weight `q * scales[:, None]` in `dtype` (computed in float32, then cast)."""
    # in place on the one float32 copy (the same product): QLoRA dequantizes every call, and each fresh weight-sized
    # tensor costs a pass of page faults (measured: half the time of `q.float() * scales`)
    return q.to(torch.float32, copy=True).mul_(scales.float()[:, None]).to(dtype)


# ---------------------------------------------------------------- int4, group-wise


def _padded_blocks(weight: Tensor, size: int) -> Tensor:
    """`weight` `[out, in]` as float32 `[out, blocks, size]`, its input columns zero-padded up to a multiple of `size`
    (the groups of int4, the blocks of nf4)."""
    w = weight.detach().float()
    padded = -(-w.shape[1] // size) * size
    if padded != w.shape[1]:
        w = F.pad(w, (0, padded - w.shape[1]))
    return w.view(w.shape[0], padded // size, size)


def quantize_int4(weight: Tensor, group: int = INT4_DEFAULT_GROUP) -> tuple[Tensor, Tensor]:
    """Asymmetric group-wise 4-bit: (q uint8 `[out, padded_in]` holding 0..15, scales_and_zeros
    float32 `[groups, out, 2]`) with `weight[o, i] ~ (q[o, i] - 8) * scale[g, o] + zero[g, o]`,
    g = i // group. `padded_in` rounds `in` up to a multiple of `group` (zero columns).

    Per group: scale = (max - min) / 15 and zero = min + 8 * scale, both rounded to bf16 values (so
    the bf16 kernel and the float32 reference read the same ones); |error| <= scale / 2 plus half a
    bf16 step of the zero, per entry (tested)."""
    if group not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size {group} is invalid: expected one of {list(INT4_GROUP_SIZES)}")
    groups = _padded_blocks(weight, group)
    out_features, padded = groups.shape[0], groups.shape[1] * group
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((high - low) / 15).to(torch.bfloat16).float()
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a constant group: q = 8 gives it
    zeros = (low + INT4_OFFSET * scales).to(torch.bfloat16).float()
    q = torch.round((groups - zeros[..., None]) / scales[..., None] + INT4_OFFSET).clamp_(0, 15)
    scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()
    return q.to(torch.uint8).view(out_features, padded), scales_and_zeros


def dequantize_int4(q: Tensor, scales_and_zeros: Tensor, in_features: int,
                    dtype: torch.dtype = torch.float32) -> Tensor:
    """The weight `[out, in_features]` of `quantize_int4`'s (q, scales_and_zeros) in `dtype`
    (computed in float32, then cast)."""
    out_features, padded = q.shape
    n_groups = scales_and_zeros.shape[0]
    sz = scales_and_zeros.float().permute(1, 0, 2)  # [out, groups, 2]
    # in place on the one float32 copy (the same operations in the same order): QLoRA dequantizes every call, and
    # each fresh weight-sized tensor costs a pass of page faults
    w = q.to(torch.float32, copy=True).view(out_features, n_groups, padded // max(n_groups, 1))  # (0: zero-width)
    w.sub_(INT4_OFFSET).mul_(sz[..., :1]).add_(sz[..., 1:])
    return w.view(out_features, padded)[:, :in_features].to(dtype)


def pack_nibbles(q: Tensor) -> Tensor:
    """Two 4-bit values a byte, in plain order: column 2j in the low nibble, 2j + 1 in the high one."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """The inverse of `pack_nibbles`: uint8 `[out, 2 * bytes]` holding 0..15."""
    # (not -1: ambiguous for a layer of no output channels)
    return torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], 2 * packed.shape[1])


def unpack_kernel_layout(packed: Tensor, in_features: int, group: int, rows: int = 1024) -> Tensor:
    """The 4-bit values (uint8 `[out, in]`, 0..15) of weights in torch's CPU kernel layout.

    The layout is the kernel's own (blocked, and may differ between CPU builds), so this reads it
    back through the kernel: identity rows times the weight with scale 1 and zero 8 give each q
    exactly (small integers in bf16). `in_features` products of one row each: for tests and small
    models (the dequantized twin), not for Huginn-size layers."""
    out_features = packed.shape[0]
    ones = torch.tensor([1.0, float(INT4_OFFSET)], dtype=torch.bfloat16)
    sz = ones.expand(in_features // group, out_features, 2).contiguous()
    cols = []
    for start in range(0, in_features, rows):
        eye = torch.eye(in_features, dtype=torch.bfloat16)[start:start + rows]
        cols.append(torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, group, sz))
    return torch.cat(cols).t().to(torch.uint8).contiguous()


# ---------------------------------------------------------------- nf4, block-wise NormalFloat


def nf4_levels(bits: int = 4) -> Tensor:
    """QLoRA's `2**bits` NormalFloat levels (Dettmers et al. 2023, section 3), sorted float32 in [-1, 1]: quantiles of
    N(0, 1) at evenly spaced probabilities, scaled so the outermost are -1 and 1, with an exact 0.

    Asymmetric, as the paper builds it: 2^(bits-1) + 1 quantiles for the positive half and 2^(bits-1) for the
    negative one (each from probability 1/2, whose quantile is 0, out to `outer`), one of the two zeros dropped:
    8 positive levels, 7 negative and 0. The paper's quantile estimate is infinite at probabilities 0 and 1, so
    the outermost level takes the centre of the last of n equal-probability slices, 1 - 1/(2n): n = 2^bits for a
    symmetric type of this many levels, 2^bits - 1 for one with a zero; the asymmetric type sits between them,
    so the mean of the two."""
    n = 2**bits
    outer = ((1 - 1 / (2 * n)) + (1 - 1 / (2 * (n - 1)))) / 2
    quantiles = lambda count: torch.special.ndtri(torch.linspace(0.5, outer, count, dtype=torch.float64))[1:]  # noqa: E731
    positive, negative = quantiles(n // 2 + 1), -quantiles(n // 2)
    levels = torch.cat([negative.flip(0), torch.zeros(1, dtype=torch.float64), positive]) / positive[-1]
    return levels.float()


NF4_LEVELS = nf4_levels()
# Each byte's two levels (low nibble first, `pack_nibbles`' order): the dequantize's one lookup a byte.
NF4_BYTE_LEVELS = torch.stack([NF4_LEVELS.repeat(16), NF4_LEVELS.repeat_interleave(16)], dim=-1)
# Rows quantized at a time: the rounding's float32 and int64 temporaries stay near 2^22 weights, not a layer's.
_NF4_CHUNK_WEIGHTS = 1 << 22


def _nf4_blocks(weight: Tensor, block: int) -> Tensor:
    """`weight` as float32 `[out, blocks, block]` (`_padded_blocks`), after checking the block size."""
    if block not in NF4_BLOCK_SIZES:
        raise ValueError(f"nf4 block size {block} is invalid: expected one of {list(NF4_BLOCK_SIZES)}")
    return _padded_blocks(weight, block)


def quantize_nf4(weight: Tensor, block: int = NF4_DEFAULT_BLOCK) -> tuple[Tensor, Tensor]:
    """Block-wise NormalFloat 4-bit: (q uint8 `[out, padded_in]` holding 0..15, absmax bf16 `[out, blocks]`) with
    `weight[o, i] ~ NF4_LEVELS[q[o, i]] * absmax[o, i // block]`, each weight / its block's absmax rounded to the
    nearest level. `padded_in` rounds `in` up to a multiple of `block` (zero columns: the exact 0 level)."""
    blocks = _nf4_blocks(weight, block)
    # rounded to bf16 values first (stored as bf16: half of QLoRA's float32 absmax), so the codes are rounded against
    # the scale the dequantize reads; a block's largest weight may then sit a bf16 step past 1: level 1 is nearest
    absmax = blocks.abs().amax(dim=-1).to(torch.bfloat16)
    absmax = torch.where(absmax > 0, absmax, torch.ones_like(absmax))  # an all-zero block: the 0 level
    return _nf4_codes(blocks, absmax.float()), absmax


def quantize_nf4_dq(weight: Tensor, block: int = NF4_DEFAULT_BLOCK) -> tuple[Tensor, Tensor, Tensor]:
    """`quantize_nf4` with its absmax double-quantized (QLoRA's, section 3): (q as `quantize_nf4`'s, codes uint8
    `[out, blocks]`, steps float32 `[ceil(out * blocks / NF4_DQ_BLOCK)]`), the block's absmax `codes * step` of its
    group of NF4_DQ_BLOCK codes (`nf4_absmax`). Each group's step is its largest float32 absmax / 255 and each code
    the nearest multiple, at least 1 (a block far below its group's largest keeps a nonzero scale, whose rounding of
    its weights is then within half a step); the weights are rounded against those dequantized absmax. 8 bits a
    block and 32 per 256 blocks where `quantize_nf4` stores 16 a block: 4.127 bits a weight at block 64, not 4.25
    (QLoRA's float32 absmax: 4.5)."""
    blocks = _nf4_blocks(weight, block)
    absmax = blocks.abs().amax(dim=-1).reshape(-1)
    groups = -(-absmax.numel() // NF4_DQ_BLOCK)
    padded = F.pad(absmax, (0, groups * NF4_DQ_BLOCK - absmax.numel())).view(groups, NF4_DQ_BLOCK)
    steps = padded.amax(dim=-1) / NF4_DQ_LEVELS
    steps = torch.where(steps > 0, steps, torch.ones_like(steps))  # an all-zero group: code 1, the 0 level
    codes = torch.round(padded / steps[:, None]).clamp_(1, NF4_DQ_LEVELS).to(torch.uint8)
    codes = codes.view(-1)[:absmax.numel()].view(blocks.shape[:2])
    return _nf4_codes(blocks, nf4_absmax(codes, steps)), codes, steps


def nf4_absmax(absmax: Tensor, steps: Tensor | None = None) -> Tensor:
    """The float32 absmax `[out, blocks]` of stored nf4 scales: bf16 `absmax` as it is, or double-quantized codes
    (uint8) times their group's step (`quantize_nf4_dq`; one float32 product each, as the C++ product computes it)."""
    if steps is None:
        return absmax.float()
    per_code = steps.repeat_interleave(NF4_DQ_BLOCK)[:absmax.numel()].view(absmax.shape)
    return absmax.float() * per_code


def _nf4_codes(blocks: Tensor, absmax: Tensor) -> Tensor:
    """The 4-bit codes (uint8 `[out, padded_in]`) of float32 `blocks` `[out, blocks, block]`: each weight / its
    block's (float32, positive) absmax rounded to the nearest level."""
    out_features, padded = blocks.shape[0], blocks.shape[1] * blocks.shape[2]
    levels = NF4_LEVELS.to(blocks.device)
    midpoints = (levels[1:] + levels[:-1]) / 2  # (bucketize: the index of the nearest level)
    q = torch.empty(out_features, padded, dtype=torch.uint8, device=blocks.device)
    rows = max(1, _NF4_CHUNK_WEIGHTS // max(padded, 1))  # (padded 0: a zero-width layer)
    for start in range(0, out_features, rows):
        normed = blocks[start:start + rows] / absmax[start:start + rows, :, None]
        q[start:start + rows] = torch.bucketize(normed, midpoints).view(normed.shape[0], padded)
    return q


def dequantize_nf4(packed: Tensor, absmax: Tensor, in_features: int, dtype: torch.dtype = torch.float32,
                   steps: Tensor | None = None) -> Tensor:
    """The weight `[out, in_features]` of packed nf4 codes (`pack_nibbles` of `quantize_nf4`'s q) and their absmax
    (bf16; or `quantize_nf4_dq`'s uint8 codes with their `steps`), in `dtype` (computed in float32, then cast): each
    byte's two levels looked up, times the block's absmax (`nf4_absmax`)."""
    out_features, n_bytes = packed.shape
    n_blocks = absmax.shape[1]
    w = NF4_BYTE_LEVELS.to(packed.device).index_select(0, packed.reshape(-1).int())
    w = w.view(out_features, n_blocks, 2 * n_bytes // max(n_blocks, 1)).mul_(nf4_absmax(absmax, steps)[..., None])
    return w.view(out_features, 2 * n_bytes)[:, :in_features].to(dtype)


# ---------------------------------------------------------------- the layers


class QuantizedLinear(nn.Module):
    """What the quantized linear layers share: shape, bias, the dtype they were quantized from, and
    `dequantized()` (the plain nn.Linear holding the weight their reference path multiplies by)."""

    def __init__(self, out_features: int, in_features: int, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.weight_dtype = torch.float32 if bias is None else bias.dtype  # the dtype `dequantized` restores
        # `spread_samples` of the float weight quantized (None: not known), on the CPU: what the base fingerprint of
        # an adapter (train/lora.py) hashes of this layer, so its quantized copy matches the float base
        self.source_samples: Tensor | None = None

    def _record_source(self, weight: Tensor) -> None:
        """Remember what this layer was quantized from: the float weight's dtype and fingerprint samples."""
        self.weight_dtype = weight.dtype
        self.source_samples = spread_samples(weight).cpu()

    def _apply(self, fn, recurse: bool = True) -> QuantizedLinear:
        """`model.to(dtype)` / `.half()` / `.float()` keep the stored codes' scales (and zero points) in
        their own dtype, moving them only: cast, float32 int8 scales reached the C++ product as bf16
        (a RuntimeError) and bf16 int4 pairs lost bits as fp16. The dtype `dequantized` restores follows."""
        kept = {name: buffer for name, buffer in self._buffers.items() if buffer is not None}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after.dtype != before.dtype:
                self._buffers[name] = before.to(after.device)
        self.weight_dtype = fn(torch.empty(0, dtype=self.weight_dtype)).dtype
        return self

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The dequantized weight `[out, in]` in `dtype`."""
        raise NotImplementedError

    def quantized_bytes(self) -> int:
        """Bytes of the quantized weight as stored: its packed values and their scales (and zero points)."""
        raise NotImplementedError

    def weights_format(self) -> str:
        """The `weights` string of this layer's format ("int8", "int4:g32", "nf4:g64")."""
        raise NotImplementedError

    def _reference(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)) \
                and not torch.compiler.is_compiling():
            return _DequantizedLinear.apply(x, bias, self)
        return F.linear(x, self.dequantize(x.dtype), bias)

    def _with_bias(self, out: Tensor, x: Tensor) -> Tensor:
        if self.bias is not None:
            out += self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> nn.Linear:
        """The plain nn.Linear holding this layer's dequantized weight (the reference model's layer)."""
        dtype = self.weight_dtype
        weight = self.dequantize(dtype)
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=weight.device, dtype=dtype)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class _DequantizedLinear(torch.autograd.Function):
    """`F.linear(x, layer.dequantize(x.dtype), bias)` whose backward dequantizes the layer's codes again rather
    than keeping the float weight: autograd's own F.linear saves the dequantized copy of every call until the
    backward, so a QLoRA step held a float copy of each layer per call (the core's once per step backpropagated
    through: more than the float model's weights), the memory quantized training is for. Same values: the
    forward is that F.linear, grad_input the same product with the same weight."""

    @staticmethod
    def forward(ctx, x: Tensor, bias: Tensor | None, layer: QuantizedLinear) -> Tensor:
        ctx.layer = layer  # (its codes are frozen buffers: nothing to save)
        return F.linear(x, layer.dequantize(x.dtype), bias)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        grad_x = grad.matmul(ctx.layer.dequantize(grad.dtype)) if ctx.needs_input_grad[0] else None
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return grad_x, grad_bias, None


def _flat_rows(x: Tensor, in_features: int) -> Tensor:
    flat = x.reshape(x.shape[:-1].numel(), in_features)  # (not -1: ambiguous for a zero-width layer)
    return flat if flat.is_contiguous() else flat.contiguous()


class Int8WeightLinear(QuantizedLinear):
    """A linear layer with int8 weights and per-output-channel scales: `y = x (q * s)^T + b`.

    Buffers `qweight` (int8 `[out, in]`) and `scales` (float32 `[out]`); the bias (if any) stays a
    parameter in the model's dtype. Made by `quantize_weights`; frozen (no weight gradient), with the input's
    gradient through the reference's F.linear (what LoRA adapters above it train on, QLoRA)."""

    def __init__(self, qweight: Tensor, scales: Tensor, bias: Tensor | None) -> None:
        super().__init__(*qweight.shape, bias)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8WeightLinear:
        q, scales = quantize_int8(linear.weight)
        layer = cls(q.to(linear.weight.device), scales.to(linear.weight.device), linear.bias)
        layer._record_source(linear.weight)
        return layer

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_int8(self.qweight, self.scales, dtype)

    def quantized_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales))

    def weights_format(self) -> str:
        return format_weights("int8", None)

    def uses_kernel(self, x: Tensor) -> bool:
        """Whether this call takes torch's int8 kernel (bf16 on CPU at a supported width, at most KERNEL_MAX_ROWS
        rows, no autograd through x: the kernel has no derivative), else the reference."""
        return (x.device.type == "cpu" and x.dtype == torch.bfloat16 and self.in_features % KERNEL_K_MULTIPLE == 0
                and x.numel() <= KERNEL_MAX_ROWS * self.in_features
                and not (x.requires_grad and torch.is_grad_enabled()) and not torch.compiler.is_compiling())

    def uses_cpp(self, x: Tensor) -> bool:
        """Whether this call takes the C++ product (`accel.quant_cpp.int8_linear`, summed in float32): float32
        or bf16 CPU activations of at most CPP_ROWS rows (a decode step), no autograd through them, C++ on."""
        return _few_rows_for_cpp(self, x)

    def forward(self, x: Tensor) -> Tensor:
        if self.uses_cpp(x):
            out = _cpp_kernels().int8_linear(_flat_rows(x, self.in_features), self.qweight, self.scales, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.uses_kernel(x):
            flat = _flat_rows(x, self.in_features)
            return self._with_bias(torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales.to(x.dtype)), x)
        return self._reference(x)


def _cpp_kernels() -> object | None:
    """The C++ kernels' module (`accel.quant_cpp`, built at the first use of a machine) for `int8_linear`,
    `int4_linear` and `nf4_linear`, or None where C++ is off (`RDEPTH_NO_CPP=1`) or cannot build (then the
    reference runs)."""
    from recurrent_depth.accel import quant_cpp  # (accel imports this module)

    return quant_cpp.load() if quant_cpp.cpp_enabled() else None


def _few_rows_for_cpp(layer: QuantizedLinear, x: Tensor, rows: int = CPP_ROWS) -> bool:
    """Whether the C++ products take `layer(x)` (decode steps; nf4 also short prompts): float32 or bf16 CPU
    activations of at most `rows` rows, no autograd through them, not under torch.compile, a bias of those
    dtypes, C++ on."""
    return (x.device.type == "cpu" and x.dtype in CPP_DTYPES and x.numel() <= rows * layer.in_features
            and not (x.requires_grad and torch.is_grad_enabled()) and not torch.compiler.is_compiling()
            and (layer.bias is None or layer.bias.dtype in CPP_DTYPES) and _cpp_kernels() is not None)


def int4_kernel_fits(out_features: int, in_features: int, group: int, device: torch.device) -> bool:
    """Whether torch's CPU int4 kernel takes a layer of this shape (it refuses others with an error)."""
    # (a zero-size layer keeps the plain layout: the kernel layout's read-back has no columns to read)
    return (device.type == "cpu" and out_features > 0 and in_features > 0
            and out_features % INT4_KERNEL_N_MULTIPLE == 0 and in_features % group == 0)


class Int4WeightLinear(QuantizedLinear):
    """A linear layer with group-wise 4-bit weights: `y = x W^T + b`, `W = (q - 8) * scale + zero`
    per group of `group` input columns.

    Two stored layouts (`kernel_layout`):
    - plain (False): `qweight` uint8 `[out, padded_in / 2]` (see `pack_nibbles`) and `scales_and_zeros`
      bf16 `[out, groups, 2]` (each output channel's pairs together, as the C++ product streams them):
      decode rows take the C++ `int4_linear`, anything else the reference;
    - torch's CPU kernel layout (True; where C++ is off and the kernel takes the shape): `qweight` in
      the kernel's packed form and `scales_and_zeros` `[groups, out, 2]` in the model's dtype holding
      bf16 values (the kernel reads them in the activations' dtype).
    Made by `quantize_weights`; frozen, the input's gradient through the reference (QLoRA training).
    """

    def __init__(self, qweight: Tensor, scales_and_zeros: Tensor, bias: Tensor | None, in_features: int,
                 group: int, kernel_layout: bool) -> None:
        super().__init__(qweight.shape[0], in_features, bias)
        self.group, self.kernel_layout = group, kernel_layout
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales_and_zeros", scales_and_zeros)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: int = INT4_DEFAULT_GROUP,
                    kernel_layout: bool | None = None) -> Int4WeightLinear:
        """kernel_layout: None picks torch's kernel layout only where the C++ product is unavailable and
        the kernel takes the shape; True forces it (ValueError where the kernel refuses the shape)."""
        weight = linear.weight
        fits = int4_kernel_fits(*weight.shape, group, weight.device)
        if kernel_layout is None:
            kernel_layout = fits and _cpp_kernels() is None
        elif kernel_layout and not fits:
            raise ValueError(f"torch's int4 kernel does not take a {tuple(weight.shape)} weight at group {group} "
                             f"on {weight.device}")
        q, scales_and_zeros = quantize_int4(weight, group)
        if kernel_layout:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
            dtype = weight.dtype if weight.dtype.is_floating_point else torch.float32
            pairs = scales_and_zeros.to(dtype)
        else:
            packed = pack_nibbles(q)
            pairs = scales_and_zeros.transpose(0, 1).contiguous().to(torch.bfloat16)  # (bf16 values: exact)
        layer = cls(packed.to(weight.device), pairs.to(weight.device), linear.bias, weight.shape[1], group,
                    kernel_layout)
        layer._record_source(weight)
        return layer

    def unpacked(self) -> Tensor:
        """The stored 4-bit values, uint8 `[out, padded_in]` holding 0..15."""
        if self.kernel_layout:
            # Read back through the kernel once (in x in x out products: 0.4-0.9 s at 1024 x 2816, where the
            # plain layout's unpack is ~1 ms) and kept as plain nibbles: autograd calls (GradMem, TTT, a LoRA
            # on a model quantized before it) dequantize in the forward and again in the backward, every call.
            # Keyed by the buffer and its version: a move (`.to`) or an in-place load reads it back again. An
            # inference-mode tensor has no version counter (an in-place load under inference_mode would go
            # unseen), so it is read back every call, uncached.
            if self.qweight.is_inference():
                return unpack_kernel_layout(self.qweight, self.in_features, self.group)
            version = self.qweight._version
            cached = getattr(self, "_plain_codes", None)
            if cached is None or cached[0] is not self.qweight or cached[1] != version:
                codes = unpack_kernel_layout(self.qweight, self.in_features, self.group)
                cached = self._plain_codes = (self.qweight, version, pack_nibbles(codes))
            return unpack_nibbles(cached[2])
        return unpack_nibbles(self.qweight)

    def __getstate__(self) -> dict:
        """Pickles (torch.save of the module) and copy.deepcopy leave out `unpacked`'s cache: a copied tensor's
        version counter restarts (at 1), so a copy made after an in-place change could match a stale entry."""
        state = super().__getstate__()
        state.pop("_plain_codes", None)
        return state

    def _apply(self, fn, recurse: bool = True) -> Int4WeightLinear:
        super()._apply(fn, recurse)
        cached = self.__dict__.get("_plain_codes")
        if cached is not None and cached[0] is not self.qweight:  # moved: the cache held the old buffer alive
            del self._plain_codes
        return self

    def groups_first(self) -> Tensor:
        """The (scale, zero) pairs as `[groups, out, 2]` (`quantize_int4`'s order), whichever the layout."""
        return self.scales_and_zeros if self.kernel_layout else self.scales_and_zeros.transpose(0, 1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_int4(self.unpacked(), self.groups_first(), self.in_features, dtype)

    def quantized_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales_and_zeros))

    def weights_format(self) -> str:
        return format_weights("int4", self.group)

    def uses_kernel(self, x: Tensor) -> bool:
        """Whether this call takes torch's int4 kernel (a layer in its layout, CPU activations of a dtype
        it takes)."""
        return self.kernel_layout and x.device.type == "cpu" and x.dtype in INT4_KERNEL_DTYPES

    def uses_cpp(self, x: Tensor) -> bool:
        """Whether this call takes the C++ product (`accel.quant_cpp.int4_linear`): a plain-layout layer,
        float32 or bf16 CPU activations of at most CPP_ROWS rows, no autograd through them, C++ on."""
        return not self.kernel_layout and _few_rows_for_cpp(self, x)

    def forward(self, x: Tensor) -> Tensor:
        if self.uses_cpp(x):
            out = _cpp_kernels().int4_linear(_flat_rows(x, self.in_features), self.qweight, self.scales_and_zeros,
                                             self.group, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if not self.kernel_layout:
            return self._reference(x)
        if not self.uses_kernel(x):
            raise ValueError(f"int4 weights in torch's CPU kernel layout take float32/bfloat16/float16 "
                             f"activations on the CPU, got {x.dtype} on {x.device}: quantize on the device "
                             f"the model runs on")
        if x.requires_grad and torch.is_grad_enabled():  # (GradMem's input gradients: the kernel has no derivative)
            return self._reference(x)
        sz = self.scales_and_zeros
        if sz.dtype != x.dtype:
            sz = sz.to(x.dtype)
        flat = _flat_rows(x, self.in_features)
        return self._with_bias(torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.qweight, self.group, sz), x)


class Nf4WeightLinear(QuantizedLinear):
    """A linear layer with block-wise NormalFloat 4-bit weights (QLoRA's NF4): `y = x W^T + b`,
    `W[o, i] = NF4_LEVELS[q[o, i]] * absmax[o, i // block]`.

    Buffers `qweight` (uint8 `[out, padded_in / 2]`, two codes a byte: `pack_nibbles`) and `absmax`: bf16
    `[out, blocks]`, or double-quantized ("nf4:dq", `quantize_nf4_dq`) uint8 codes `[out, blocks]` with the
    float32 `absmax_steps` (None otherwise). float32 or bf16 CPU activations of at most NF4_CPP_ROWS rows, without
    autograd through them, take the C++ `accel.quant_cpp.nf4_linear` where C++ is on (each packed row streamed
    once, a lookup of each block's 16 levels times its absmax: the reference's float32 weights, summed in float32);
    anything else the reference (dequantize, then `F.linear`; under autograd `_DequantizedLinear`, QLoRA
    training). Made by `quantize_weights`; frozen."""

    def __init__(self, qweight: Tensor, absmax: Tensor, bias: Tensor | None, in_features: int, block: int,
                 absmax_steps: Tensor | None = None) -> None:
        super().__init__(qweight.shape[0], in_features, bias)
        self.block = block
        self.register_buffer("qweight", qweight)
        self.register_buffer("absmax", absmax)
        self.register_buffer("absmax_steps", absmax_steps)

    @classmethod
    def from_linear(cls, linear: nn.Linear, block: int = NF4_DEFAULT_BLOCK,
                    double_quant: bool = False) -> Nf4WeightLinear:
        """double_quant: the absmax as 8-bit codes with a float32 step per NF4_DQ_BLOCK of them ("nf4:dq")."""
        if double_quant:
            q, absmax, steps = quantize_nf4_dq(linear.weight, block)
        else:
            (q, absmax), steps = quantize_nf4(linear.weight, block), None
        layer = cls(pack_nibbles(q), absmax, linear.bias, linear.weight.shape[1], block, steps)
        layer._record_source(linear.weight)
        return layer

    @property
    def double_quant(self) -> bool:
        return self.absmax_steps is not None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return dequantize_nf4(self.qweight, self.absmax, self.in_features, dtype, self.absmax_steps)

    def quantized_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.absmax, self.absmax_steps)
                   if t is not None)

    def weights_format(self) -> str:
        return format_weights("nf4:dq" if self.double_quant else "nf4", self.block)

    def uses_cpp(self, x: Tensor) -> bool:
        """Whether this call takes the C++ product (`accel.quant_cpp.nf4_linear`): float32 or bf16 CPU activations
        of at most NF4_CPP_ROWS rows, no autograd through them, C++ on."""
        return _few_rows_for_cpp(self, x, NF4_CPP_ROWS)

    def forward(self, x: Tensor) -> Tensor:
        if self.uses_cpp(x):
            out = _cpp_kernels().nf4_linear(_flat_rows(x, self.in_features), self.qweight, self.absmax,
                                            self.absmax_steps, NF4_DQ_BLOCK, NF4_LEVELS, self.block, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        return self._reference(x)


QUANTIZED_LAYERS = (Int8WeightLinear, Int4WeightLinear, Nf4WeightLinear)  # `quantize_weights`' layers, by format


def _replace_children(root: nn.Module, plain: type[nn.Module], make) -> int:
    count = 0
    # The parents only: a list holding the replaced layers would keep both copies in memory until the end. Inside a
    # peft LoRA layer only its `base_layer` is the model's: its adapters' layers (in peft's lora_A, lora_B, ...
    # containers) stay as they are.
    for parent in [m for name, m in root.named_modules() if type(m) is not plain
                   and not any(part.startswith(PEFT_ADAPTER_PREFIX) for part in name.split("."))]:
        for name, child in list(parent.named_children()):
            if type(child) is plain:
                setattr(parent, name, make(child))
                count += 1
    return count


def quantize_weights(model: nn.Module, weights: str | None = "int8", include_head: bool = False,
                     kernel_layout: bool | None = None) -> int:
    """Quantize `model` (a `RecurrentDepthLM`) in place; returns the number of layers swapped.

    weights: "int8", "int4" (group 32), "int4:g<group>", "nf4" (block 64), "nf4:g<block>", "nf4:dq" or
    "nf4:dq:g<block>" (double-quantized absmax) (None: nothing). Every
    `nn.Linear` under `model.transformer` becomes an `Int8WeightLinear` / `Int4WeightLinear` / `Nf4WeightLinear`;
    `include_head` also
    quantizes an untied `lm_head` (a tied one shares the embedding's storage: ValueError). A model already
    holding this format keeps its codes (only a float head that include_head asks for is quantized); one
    holding another format is a ValueError. kernel_layout: the int4 layers' (`Int4WeightLinear.from_linear`'s;
    QLoRA training passes False: its products take the reference, which reads the plain layout directly, not
    through one kernel call per input column, and on any device)."""
    parsed = parse_weights(weights)
    if parsed is None:
        return 0
    if not isinstance(model, nn.Module) or not isinstance(getattr(model, "transformer", None), nn.Module):
        raise ValueError(f"quantize_weights takes a RecurrentDepthLM (or our transformers model), got "
                         f"{type(model).__name__}: it quantizes the linear layers under model.transformer")
    held = held_weights(model)
    # the same format again keeps the transformer's codes (quantizing them again would compound the rounding),
    # but still quantizes a head that include_head asks for
    same = held == format_weights(*parsed)
    if held is not None and not same:
        raise ValueError(f"weights={weights!r} cannot be applied: this model already holds {held} weights; "
                         f"call recurrent_depth.weight_quant.dequantize_weights(model) first, or load the "
                         f"float model with weights={weights!r}")
    if include_head and model.config.tie_embeddings:
        raise ValueError("include_head=True needs an untied lm_head: this model ties it to the embedding")
    # (peft's LoRA layers hold `use_dora`, by adapter)
    dora = next((name for name, m in model.named_modules() if any(getattr(m, "use_dora", {}).values())), None)
    if dora is not None:
        raise ValueError(f"weights={weights!r} cannot go under the DoRA adapter on {dora} (its forward reads the "
                         "float base weight's norm): merge it into the float weights first "
                         "(recurrent_depth.train.lora.merge_lora), then quantize")
    kind, group = parsed

    def make(linear: nn.Linear) -> QuantizedLinear:
        if kind == "int8":
            return Int8WeightLinear.from_linear(linear)
        if kind in ("nf4", "nf4:dq"):
            return Nf4WeightLinear.from_linear(linear, group, double_quant=kind == "nf4:dq")
        return Int4WeightLinear.from_linear(linear, group, kernel_layout)

    from recurrent_depth.accel.linear import restore_linears  # (accel imports this module)

    with torch.no_grad():
        count = 0
        # an `accel.apply`d model (the trainer's) holds its linears as a subclass: plain ones again first
        if not same:
            restore_linears(model.transformer)
            count = _replace_children(model.transformer, nn.Linear, make)
        if include_head:
            restore_linears(model.lm_head)
            if type(model.lm_head) is nn.Linear:
                model.lm_head = make(model.lm_head)
                count += 1
            else:  # a head carrying a peft LoRA adapter: its base layer, as inside the transformer (it stayed float)
                count += _replace_children(model.lm_head, nn.Linear, make)
    for hook in _AFTER_QUANTIZE:  # (train.lora's: peft's LoRA layers over the layers just quantized)
        hook(model)
    return count


# Called with the model at the end of each `quantize_weights`. `train.lora` registers the one that turns peft's LoRA
# layers over the layers just quantized into its quantized-base LoRA layer (as an adapter loaded onto quantized
# layers is made), so that either order gives the same layers; it is imported wherever peft is (the import hook's
# `integrations.hf_peft`). This module imports nothing of peft's or of train/ and inference/, which import it.
_AFTER_QUANTIZE: list[Callable[[nn.Module], None]] = []


def register_after_quantize(hook: Callable[[nn.Module], None]) -> None:
    """Call `hook(model)` at the end of every `quantize_weights` (once, however often registered)."""
    if hook not in _AFTER_QUANTIZE:
        _AFTER_QUANTIZE.append(hook)


def dequantize_weights(model: nn.Module) -> int:
    """Undo `quantize_weights` up to its rounding: every quantized layer becomes the plain nn.Linear
    holding its dequantized weight (in the dtype it was quantized from). Returns how many."""
    return sum(_replace_children(model, cls, cls.dequantized) for cls in QUANTIZED_LAYERS)


def format_weights(kind: str, group: int | None) -> str:
    """The `weights` string of a parsed format: "int8", "int4:g<group>", "nf4:g<block>" or "nf4:dq:g<block>"."""
    return kind if group is None else f"{kind}:g{group}"


def held_weights(model: nn.Module) -> str | None:
    """The format of the quantized layers `model` holds ("int8", "int4:g32", "nf4:g64", "nf4:dq:g64", or
    "int8+int4:g32" for a mix), None for none."""
    formats = {m.weights_format() for m in model.modules() if isinstance(m, QuantizedLinear)}
    return "+".join(sorted(formats)) or None


def quantized_weights(model: nn.Module) -> bool:
    """Whether any layer of `model` holds quantized (int8, int4 or nf4) weights."""
    return any(isinstance(m, QuantizedLinear) for m in model.modules())


def check_saveable(model: object, path: object) -> None:
    """Refuse to save a model with quantized layers: their `qweight` / `scales` tensors are names no
    loader reads, so the directory written would not load (quantize at load instead)."""
    if isinstance(model, nn.Module) and quantized_weights(model):
        raise ValueError(f"cannot save to {path}: this model's linear layers hold quantized (int8 / int4 / nf4) "
                         f"weights, which no loader reads; save the float model and quantize at load "
                         f"(weights='int8' / --weights), or call recurrent_depth.weight_quant.dequantize_weights"
                         f"(model) first")


def quantized_weight_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s quantized weights as stored: packed values, scales and zero points (not biases)."""
    return sum(m.quantized_bytes() for m in model.modules() if isinstance(m, QuantizedLinear))


def logical_parameters(model: nn.Module) -> int:
    """Unique parameters `model` stands for: a quantized layer's weight counts its out x in values (its
    codes are buffers, outside `model.parameters()`), so a quantized model counts as its float original."""
    params = sum(p.numel() for p in model.parameters())  # (parameters() yields a shared one once)
    return params + sum(m.out_features * m.in_features for m in model.modules() if isinstance(m, QuantizedLinear))
