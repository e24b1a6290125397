"""The fused decode runner: `FastRunner` computes what `recurrent_depth.inference.runner.ModelRunner`
(the model's own methods) computes, for models whose blocks are all plain softmax attention (the
Huginn architecture), with far fewer tensor operations per recurrence step, because at batch 1
decoding is bound by per-operation overhead, not FLOPs:

- the adapter `W [s; e]` is split into `W_s s + W_e e`; `W_e e` is computed once per token and
  reused by every step (the input injection does not change between steps);
- the q/k biases are folded into one bias vector and RoPE is one complex multiplication on q
  and k together, with angles looked up from a table built once;
- RMSNorm takes four element-wise operations, with sqrt(h) folded into its weight;
- (bf16 / fp16 models instead round as the model's modules do: norms with their own weights, the q/k bias
  added to the rounded product, residuals added to the rounded products; only the split adapter and the
  C++ weight stream's float32 sums round differently, see `__init__` and `_bf16_stream`)
- keys and values stay in the cache's head-major layout `[B, Hkv, T, D]` (no transposes);
- decoding (T = 1, float32, no autograd) writes each block's intermediates into one preallocated
  `Workspace` (`out=` and in-place operations), so a step allocates only each block's output. Every
  `StepCache.update_heads` copies the k, v it is given, so the views into the workspace never outlive
  their block; a runner therefore serves one loop at a time (each engine builds its own);
- each weight is stored in the layout whose rows are the longer dimension. Decoding multiplies one
  row of activations by every weight once per step, which streams the weights from memory; on the
  CPUs measured here a `[1, 256] @ [256, 2048]` product runs ~1.9x faster from a contiguous
  `[in, out]` copy than from the transposed view of the `[out, in]` parameter, while a tall `[704,
  256]` product is not. Wide and square weights therefore get contiguous transposed copies,
  on CPUs and as long as those copies stay under `COPY_LIMIT_BYTES` (a 3.5B model keeps the
  views: doubling its weights in memory would cost more than it saves);
- a bf16 model's decode rows times those views take one C++ call a product (`_bf16_stream`:
  `accel.quant_cpp.bf16_linear`, each weight row streamed once, summed in float32), which reads the
  weights at about the memory bandwidth where ATen's bf16 product of one row reads ~0.55-0.6 of it
  (more rows: up to 8 where bf16 is emulated, only one where it is native; `stream_row_limit`); float32
  decode steps run whole in C++ (`accel.decode_cpp`).

Unmerged peft LoRA adapters (`recurrent_depth.train.lora`) on the blocks' linear layers and the adapter
are applied as peft's forward applies them: `x W^T + (x A^T) (s B)^T` after each product (see
`accel/lora.py`; a mixed batch's runner adds each row's own adapter); a model with LoRA layers the runner
cannot reproduce (DoRA, LoRA on the embedding or the head, ...) takes the reference runner.

Quantized weights (`weight_quant.quantize_weights`: int8 / int4 block linears, adapter, an untied head)
are multiplied by through their own layers, so decode rows take the C++ `int8_linear` / `int4_linear`
while the rest of the step stays this runner's; the adapter then runs whole on `[s | e]` at every step
(its halves are not split out of the quantized weight), and the float32 C++ decode step is off. LoRA
layers over quantized ones (QLoRA-style, `train.lora`) add their low-rank term to that layer's product,
as peft's forward does (a quantized adapter's term whole, on `[s | e]`).

Quantized caches attend from their codes through `cache.attend`, with the compiled kernels of
`recurrent_depth.accel.quant` for decode calls (off with `RDEPTH_NO_COMPILE=1`).

Sliding windows (`ModelConfig.attention_windows`, or mixer_options' `window`) limit each layer's keys as the
model's `Attention` does (`window_mask`: in the serving pool, each row from its own column); a windowed layer
over a quantized cache attends over its decoded columns, as `Attention` does, and a windowed model keeps the
Python decode (the C++ step takes one mask for every layer).

The runner scales attention by 1/sqrt(D) only: a model whose `config.attention_scale` differs (muP's
`attn_scale: "1/d"` with a grown head_dim) is not `uses_huginn_layout` and takes the reference runner.

Outputs agree with the reference to float rounding (tests compare both at odd sizes). The runtime
applies it from outside: `import recurrent_depth` registers `fast_runner` with
`recurrent_depth.inference.runner.make_runner` (off with `fast=False` or `RDEPTH_NO_ACCEL=1`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from recurrent_depth.accel import decode_cpp, enabled_by_default, quant_cpp
from recurrent_depth.accel.cpu import cpu_emulates_bf16
from recurrent_depth.accel.decode_cpp import DecodeKernel
from recurrent_depth.accel.lora import (
    LowRank,
    RowLowRank,
    add_low_rank,
    is_lora_layer,
    low_rank_term,
    split_low_rank,
    unsupported_lora,
)
from recurrent_depth.accel.quant import code_kernels
from recurrent_depth.inference.runner import ModelRunner, Step, register_fast_runner
from recurrent_depth.model.cache import ModelCache, combine_key_mask
from recurrent_depth.model.layers import RotaryTable
from recurrent_depth.model.mixers.attention import window_mask
from recurrent_depth.model.recurrent import all_attention, blocks_of
from recurrent_depth.weight_quant import QuantizedLinear

# Most bytes of contiguous transposed weight copies a fast runner makes (see the module docstring).
COPY_LIMIT_BYTES = 512 * 2**20
# bf16 activations of at most this many rows (a decode step) times a weight kept as the view of its
# `[out, in]` parameter take the C++ weight stream (`_bf16_stream`) on CPUs that emulate bf16 products.
STREAM_ROWS = 8
# Where bf16 products are native (AMX / AVX512-BF16), ATen's product of two or more rows beats the stream,
# whose float32 sums are compute-bound beyond one row (one Huginn-0125 MLP weight, 5280 x 17920, on a
# 2-core Xeon with AMX: 1 row 9.1 ms streamed against 14.9 ms in ATen; 2 rows 14.0 against 12.7; 8 rows
# 40.6 against 12.3).
NATIVE_BF16_STREAM_ROWS = 1
# The model dtypes this runner takes: its norms' statistics and RoPE are float32 (a float64 model's are not).
RUNNER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def stream_row_limit() -> int:
    """The most bf16 rows a product streams in C++ on this CPU (`STREAM_ROWS` or `NATIVE_BF16_STREAM_ROWS`)."""
    return STREAM_ROWS if cpu_emulates_bf16() else NATIVE_BF16_STREAM_ROWS


def _bf16_stream(x: Tensor, weight_t: Tensor) -> Any | None:
    """The C++ kernels (`accel.quant_cpp`) when `x @ weight_t` takes their bf16 weight stream, else None.

    On CPUs without native bf16, ATen's bf16 product of a few rows reads ~0.55 of the memory bandwidth
    (a 2-core AVX2 EPYC, Huginn-0125's shapes); `quant_cpp.bf16_linear` streams each `[out, in]` row once,
    widened to float32 in registers, summed in float32 and rounded once (ATen rounds `addmm` and then the
    bias: within bf16 rounding of each other, tested). With native bf16 ATen's one-row product reads ~0.6
    of the bandwidth too, but from two rows on its AMX product is faster (`stream_row_limit`). Decoding
    only: CPU, no autograd, not compiling."""
    rows = weight_t.t()  # [out, in]: each row contiguous, the rows at any stride (the adapter's halves)
    if (x.dtype != torch.bfloat16 or weight_t.dtype != torch.bfloat16 or x.device.type != "cpu"
            or x.shape[0] > stream_row_limit() or torch.is_grad_enabled() or torch.compiler.is_compiling()
            or rows.stride(1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1])
            or not quant_cpp.cpp_enabled()):
        return None
    return quant_cpp.load()


@dataclass
class Workspace:
    """Preallocated intermediates of one block for decoding (`[B, ...]`, one new token per row), shared
    by every block of a runner: each is consumed within the block that writes it, so a decode step
    allocates only each block's output. The fields are None where a call allocates its own (then
    `_block` computes the views itself)."""

    stat: Tensor | None = None  # [B, 1] a norm's statistic
    normed: Tensor | None = None  # [B, h] a norm's output that only a matrix product reads
    qkv: Tensor | None = None  # [B, (H + 2 Hkv) D]
    rope: Tensor | None = None  # complex view of qkv's q and k heads [B, 1, H + Hkv, D/2]
    qkv_heads: tuple[Tensor, Tensor, Tensor] | None = None  # q, k, v views [B, H(kv), 1, D]
    mixed: Tensor | None = None  # [B, h] attention out + residual, then normed in place
    gate_up: Tensor | None = None  # [B, 2 inner]
    gate_up_halves: tuple[Tensor, Tensor] | None = None
    mlp_out: Tensor | None = None  # [B, h] MLP out + residual


NO_WORKSPACE = Workspace()


class FastRunner(ModelRunner):
    """Fused-operation implementation for all-attention models (see the module docstring)."""

    name = "fast"

    @staticmethod
    def supports(model: Any) -> bool:
        # (its head counts are the config's: a mixer option num_kv_heads, MQA in some part, takes the reference;
        # its norms and RoPE compute in float32, so a float64 model takes the reference, in float64)
        return (model.config.uses_huginn_layout and model.dtype in RUNNER_DTYPES and all_attention(model)
                and all(b.attn.q_norm is None and b.attn.num_kv_heads == model.config.num_kv_heads
                        for b in blocks_of(model))
                and FastRunner._reads_every_layer(model))

    @staticmethod
    def _reads_every_layer(model: Any) -> bool:
        """One walk over `model`'s modules: every quantized layer (weight_quant.py) and every LoRA layer is one
        this runner reads (block and adapter linears, or their LoRA layers' base layers; a quantized head too), and
        LoRA is plain (`unsupported_lora`), over a float or a quantized base."""
        layers = [model.transformer.adapter] + [
            layer for block in blocks_of(model) for layer in FastRunner._block_linears(block).values()]
        read = {id(layer) for layer in layers} | {id(FastRunner._base(layer)) for layer in layers}
        return not any((isinstance(m, QuantizedLinear) and id(m) not in read and m is not model.lm_head)
                       or (is_lora_layer(m) and (id(m) not in read or unsupported_lora(m) is not None))
                       for m in model.modules())

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        if not self.supports(model):
            raise ValueError(
                "the fast runner needs every block to be plain softmax attention without QK-norm, "
                "with the config's num_kv_heads, at the 1/sqrt(d) scale (config.attention_scale), and float32, "
                "bfloat16 or float16 weights"
            )
        cfg = model.config
        t = model.transformer
        h = cfg.hidden_size
        self.H, self.Hkv, self.D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # A 0-d tensor, not a Python float: adding a float costs three more operations per call.
        self.norm_offset = torch.tensor(h * cfg.norm_eps, dtype=torch.float32, device=model.device)
        self.norm_root = self.norm_offset.sqrt()
        self.norm_eps = torch.tensor(cfg.norm_eps, dtype=torch.float32, device=model.device)  # (bf16 / fp16 norms)
        self.gqa = self.Hkv != self.H
        self.dtype = model.dtype
        self._freq_table = RotaryTable(cfg.head_dim, cfg.max_seq_len, cfg.rope_base, model.device,
                                       as_complex=True)  # [L, D/2]
        blocks = {"prelude": t.prelude, "core": t.core_block, "coda": t.coda}
        linears = [model.lm_head, t.adapter] + [
            layer for b in (*t.prelude, *t.core_block, *t.coda) for layer in self._block_linears(b).values()
        ]
        # Quantized layers (weight_quant.py) are multiplied by through their own kernels, never copied.
        self.quantized = any(isinstance(self._base(layer), QuantizedLinear) for layer in linears)
        matrices = [layer.weight[:, :h] if layer is t.adapter else layer.weight
                    for layer in linears if not isinstance(self._base(layer), QuantizedLinear)]
        copy_bytes = sum(w.numel() * w.element_size() for w in matrices if self._wide(w))
        # Measured on CPUs; GPU libraries read either layout at full speed, so no copies there.
        self.copy_weights = model.device.type == "cpu" and copy_bytes <= COPY_LIMIT_BYTES
        self.blocks = {part: [self._prepare(b, h) for b in parts] for part, parts in blocks.items()}
        # A quantized adapter runs whole at every step, on [s | e] as the model's own (`core_step`); a float
        # one splits, A [s; e] = A_s s + A_e e, so that A_e e + b is computed once per position (`inject`).
        # (In bf16 / fp16 the split rounds A_e e + b before adding A_s s, where the model's one product rounds once:
        # besides the C++ weight stream's float32 sums (`_bf16_stream`), the one place where this runner's
        # low-precision steps round differently from the model's; the whole product at every step would read h^2
        # more weights a step, ~1.7% more bytes in a Huginn-0125 core step.)
        adapter = self._base(t.adapter)
        self.adapter = adapter if isinstance(adapter, QuantizedLinear) else None
        w = None if self.adapter is not None else adapter.weight
        self.adapter_s = None if w is None else self._layout(w[:, :h])  # (a strided view of the adapter otherwise)
        self.adapter_e = None if w is None else w[:, h:].t()
        self.adapter_bias = adapter.bias
        # A LoRA term on the adapter splits as its weight does: A [s; e] = A_s s + A_e e (a quantized adapter's whole).
        self.adapter_term = low_rank_term(t.adapter, self.dtype)
        self.adapter_s_term = self.adapter_e_term = None
        if self.adapter_term is not None and self.adapter is None:
            self.adapter_s_term, self.adapter_e_term = split_low_rank(self.adapter_term, h)
        self.ln_f = t.ln_f.weight * self._norm_scale(h)
        self.wte = t.wte.weight
        self.lm_head = self._operand(model.lm_head)
        self.emb_scale = model.emb_scale
        self._workspaces: dict[int, Workspace] = {}  # by batch size (a runner serves one loop at a time)
        self.code_kernels = code_kernels()  # compiled attention from quantized caches' codes, or None
        # The C++ decode (`accel.decode_cpp`): made at the first decode call that it covers; None where it
        # cannot be (LoRA terms, another dtype or device, C++ off or not building).
        self._decode: DecodeKernel | None = None
        self._decode_tried = False

    def _workspace(self, B: int, T: int) -> Workspace:
        """The decode workspace for B rows: float32 decoding (T = 1) without autograd, else none."""
        if T != 1 or self.dtype != torch.float32 or torch.is_grad_enabled():
            return NO_WORKSPACE
        ws = self._workspaces.get(B)
        if ws is None:
            H, Hkv, D = self.H, self.Hkv, self.D
            h, inner2 = self.ln_f.shape[0], self._out_features(self.blocks["core"][0]["fc"])
            new = functools.partial(torch.empty, dtype=torch.float32)  # (not torch's default dtype)
            device = self.ln_f.device
            qkv = new(B, (H + 2 * Hkv) * D, device=device)
            gate_up = new(B, inner2, device=device)
            ws = self._workspaces[B] = Workspace(
                stat=new(B, 1, device=device), normed=new(B, h, device=device), qkv=qkv,
                rope=torch.view_as_complex(qkv.view(B, 1, H + 2 * Hkv, D // 2, 2)[:, :, : H + Hkv]),
                qkv_heads=qkv.view(B, 1, H + 2 * Hkv, D).transpose(1, 2).split((H, Hkv, Hkv), dim=1),
                mixed=new(B, h, device=device), gate_up=gate_up, gate_up_halves=gate_up.chunk(2, dim=1),
                mlp_out=new(B, h, device=device),
            )
        return ws

    @staticmethod
    def _wide(weight: Tensor) -> bool:
        """An `[out, in]` weight whose output side is the longer one, or square (see the module docstring)."""
        return weight.shape[0] >= weight.shape[1]

    def _layout(self, weight: Tensor) -> Tensor:
        """`weight^T` `[in, out]` for `x @ weight^T`: a contiguous copy of wide weights (when copies
        are allowed), else the view of the `[out, in]` parameter."""
        return weight.t().contiguous() if self.copy_weights and self._wide(weight) else weight.t()

    @staticmethod
    def _base(layer: Any) -> Any:
        """The layer whose weights a linear layer multiplies by: a LoRA layer's `base_layer` (peft's `weight` of one
        over a quantized layer is its int8 / packed codes), else the layer itself."""
        return layer.base_layer if is_lora_layer(layer) else layer

    def _operand(self, layer: Any) -> Tensor | QuantizedLinear:
        """What `_linear` multiplies by for a linear layer (or a LoRA layer over one): its weight's `_layout`, or a
        quantized layer itself (which takes its own kernels: the C++ int8 / int4 products at decode rows)."""
        base = self._base(layer)
        return base if isinstance(base, QuantizedLinear) else self._layout(base.weight)

    @staticmethod
    def _out_features(operand: Tensor | QuantizedLinear) -> int:
        return operand.out_features if isinstance(operand, QuantizedLinear) else operand.shape[1]

    @staticmethod
    def _block_linears(block: Any) -> dict[str, Any]:
        """A block's linear layers, by the names `_prepare` gives their weights' layouts."""
        attn, mlp = block.attn, block.mlp
        return {"qkv": attn.Wqkv, "proj": attn.proj, "fc": mlp.fc, "out": mlp.proj}

    def _norm_scale(self, h: int) -> float:
        """The factor folded into the stored norm weights: sqrt(h) in float32 (see `_norm`); 1 in bf16 / fp16,
        whose norms round as the model's `RMSNorm` does (a folded bf16 weight would round differently)."""
        return math.sqrt(h) if self.dtype == torch.float32 else 1.0

    def _prepare(self, block: Any, h: int) -> dict[str, Any]:
        """A block's weights as the fast path uses them: `[in, out]` (see `_layout`) or the quantized layer
        (`_operand`), the q/k bias folded into the qkv bias, norm weights times sqrt(h) (see `_norm`) (bf16 / fp16:
        neither folded, so that each rounds as in the model's modules)."""
        attn = block.attn
        H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
        linears = self._block_linears(block)
        # `_linear`'s bias term: a quantized layer adds its own bias, so only the q/k bias is left to add
        biases = {name: None if isinstance(self._base(layer), QuantizedLinear) else layer.bias
                  for name, layer in linears.items()}
        bias = biases["qkv"]
        if attn.has_qk_bias:
            qk = (
                torch.cat([attn.qk_bias[0].reshape(-1), attn.qk_bias[1].reshape(-1)])
                if Hkv == H
                else torch.cat([attn.q_bias.reshape(-1), attn.k_bias.reshape(-1)])
            )
            if self.dtype == torch.float32:
                extra = torch.cat([qk, qk.new_zeros(Hkv * D)])
                bias = extra if bias is None else bias + extra
                qk = None
        else:
            qk = None
        scale = self._norm_scale(h)
        return {
            "norm": [n.weight * scale for n in (block.norm_1, block.norm_2, block.norm_3, block.norm_4)],
            **{name: self._operand(layer) for name, layer in linears.items()},
            "qkv_bias": bias,
            # bf16 / fp16: the q/k bias added after the product (rounded as the model's `Attention`), else None
            "qk_bias": None if qk is None else qk.view(H + Hkv, D),
            "proj_bias": biases["proj"],
            "fc_bias": biases["fc"],
            "out_bias": biases["out"],
            "low_rank": {name: low_rank_term(layer, self.dtype) for name, layer in linears.items()},
            "window": attn.window,  # the layer's sliding window (None: full attention), as `Attention` reads it
        }

    # ------------------------------------------------------------------ pieces
    def context(
        self, input_ids: Tensor, attention_mask: Tensor | None, cache: ModelCache | None,
        position_ids: Tensor | None = None, row_columns: list[int] | None = None,
    ) -> Step:
        ctx = self.model.make_context(input_ids, attention_mask, position_ids, cache, row_columns)
        return Step(ctx, self._freq_table[ctx.positions].unsqueeze(2))  # [B, T, 1, D/2]

    def _norm(self, x: Tensor, weight: Tensor, out: Tensor | None = None, stat: Tensor | None = None) -> Tensor:
        """RMSNorm in four operations: x / sqrt(mean(x^2) + eps) * w = x / hypot(|x|, sqrt(h eps)) * (sqrt(h) w),
        with sqrt(h) folded into the stored weight (`hypot` adds the epsilon without squaring the norm back);
        bf16 / fp16: the model's `RMSNorm` operation for operation, with the unfolded weight (`_norm_scale`).
        out, stat: float32 buffers for the result `[N, h]` and the statistic `[N, 1]` (None: new ones)."""
        if self.dtype != torch.float32:  # the model's RMSNorm operation for operation (statistics in float32)
            x32 = x.float()
            return (x32 * (x32 * x32).mean(-1, keepdim=True).add_(self.norm_eps).rsqrt_()).to(x.dtype) * weight
        root = torch.hypot(torch.linalg.vector_norm(x, dim=-1, keepdim=True, out=stat), self.norm_root, out=stat)
        scaled = torch.div(x, root, out=out)
        # (in place on this call's own quotient when no graph needs it: one allocation less per norm)
        return scaled * weight if scaled.requires_grad else scaled.mul_(weight)

    @staticmethod
    def _linear(x: Tensor, weight_t: Tensor | QuantizedLinear, bias: Tensor | None, residual: Tensor | None = None,
                out: Tensor | None = None, low_rank: LowRank | RowLowRank | None = None,
                sum_once: bool = False) -> Tensor:
        """x @ W^T (+ bias) (+ residual) (+ a LoRA term `(x A^T) (s B)^T`) on 2-D `[N, in]` activations, in
        one `addmm` when possible, or one C++ call for bf16 decode rows (`_bf16_stream`), or a quantized
        layer's own product (with its own bias; then in the model's order: the product, + bias, + residual)
        (out: a buffer for the result, which then must not be `residual`; None: a new tensor). bf16 / fp16 rows add
        the residual to the rounded product, as the model's blocks do, unless `sum_once` (the split adapter)."""
        if isinstance(weight_t, QuantizedLinear):
            y = weight_t(x)
            if low_rank is not None:  # (peft's order: the base layer's output, + the adapter's term)
                y = add_low_rank(y, x, low_rank)
            for term in (bias, residual):
                if term is not None:
                    y = y.add_(term) if not y.requires_grad else y + term
            return y if out is None else out.copy_(y)
        if residual is not None and x.dtype != torch.float32 and not sum_once:  # the model's: (x W^T + b) + residual
            y = FastRunner._linear(x, weight_t, bias, low_rank=low_rank)
            y = y.add_(residual) if not y.requires_grad else y + residual
            return y if out is None else out.copy_(y)
        stream = _bf16_stream(x, weight_t)
        if stream is not None:
            y = stream.bf16_linear(x, weight_t.t(), bias, residual)
            y = y if out is None else out.copy_(y)
        elif residual is not None:
            y = torch.addmm(residual, x, weight_t, out=out)
            y = y if bias is None else (y + bias if out is None else y.add_(bias))
        else:
            y = torch.mm(x, weight_t, out=out) if bias is None else torch.addmm(bias, x, weight_t, out=out)
        if low_rank is None:  # (no call: the decode step runs this for every linear of every step)
            return y
        return add_low_rank(y, x, low_rank)  # (a mixed batch's runner: each row's own adapter)

    def _block(self, x: Tensor, p: dict[str, Any], step: Step, key: tuple, B: int, T: int) -> Tensor:
        """One sandwich block on 2-D activations `x` `[B * T, h]`."""
        H, Hkv, D = self.H, self.Hkv, self.D
        n1, n2, n3, n4 = p["norm"]
        ws = self._workspace(B, T)
        low_rank = p["low_rank"]
        qkv = self._linear(self._norm(x, n1, ws.normed, ws.stat), p["qkv"], p["qkv_bias"], out=ws.qkv,
                           low_rank=low_rank["qkv"])
        # In-place updates of this call's own buffers save allocations, but autograd needs the originals.
        inplace = not qkv.requires_grad
        # Interleaved RoPE on q and k at once: pairs (x0, x1) as complex numbers times e^{i angle}.
        if ws.rope is not None:
            ws.rope.mul_(step.freqs)
            q, k, v = ws.qkv_heads
        elif inplace and self.dtype == torch.float32:
            torch.view_as_complex(qkv.view(B, T, H + 2 * Hkv, D // 2, 2)[:, :, : H + Hkv]).mul_(step.freqs)
            q, k, v = qkv.view(B, T, H + 2 * Hkv, D).transpose(1, 2).split((H, Hkv, Hkv), dim=1)  # [B, H(kv), T, D]
        else:  # (no complex half types: rotate a float32 copy)
            heads = qkv.view(B, T, H + 2 * Hkv, D)
            qk = heads[:, :, : H + Hkv] if p["qk_bias"] is None else heads[:, :, : H + Hkv] + p["qk_bias"]
            pairs = torch.view_as_complex(qk.float().unflatten(-1, (D // 2, 2)))
            qk = torch.view_as_real(pairs * step.freqs).flatten(-2).to(self.dtype)
            q, k = qk[:, :, :H].transpose(1, 2), qk[:, :, H:].transpose(1, 2)
            v = heads[:, :, H + Hkv :].transpose(1, 2)
        ctx = step.ctx
        cache = ctx.cache
        mask, is_causal = ctx.attn_mask, ctx.is_causal
        window = p["window"]
        # a quantized storage (inference/kv_codec.py); a windowed layer reads its decoded columns, as `Attention`
        from_codes = cache is not None and cache.attends_from_codes and window is None
        key_mask = None
        if cache is not None and not from_codes:  # a `ModelCache` (model/cache.py), in its head-major layout
            k, v = cache.update_heads(key, k, v)
            key_mask = cache.key_mask(key)
        if window is not None:  # the last `window` keys of each query (each row's own, `window_mask`)
            mask, is_causal = window_mask(ctx, k.shape[2], window), False
        if key_mask is not None:
            mask, is_causal = combine_key_mask(mask, key_mask, T), False
        if from_codes:
            att = cache.attend(key, q, k, v, mask, is_causal, self.code_kernels)  # [B, H, T, D]
        else:
            att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=self.gqa)
        att = att.transpose(1, 2).reshape(B * T, H * D)
        mixed = self._linear(att, p["proj"], p["proj_bias"], residual=x, out=ws.mixed, low_rank=low_rank["proj"])
        x = self._norm(mixed, n2, ws.mixed, ws.stat)
        gate_up = self._linear(self._norm(x, n3, ws.normed, ws.stat), p["fc"], p["fc_bias"], out=ws.gate_up,
                               low_rank=low_rank["fc"])
        gate, up = ws.gate_up_halves or gate_up.chunk(2, dim=1)
        hidden = F.silu(gate, inplace=True).mul_(up) if inplace else F.silu(gate) * up
        out = self._linear(hidden, p["out"], p["out_bias"], residual=x, out=ws.mlp_out, low_rank=low_rank["out"])
        return self._norm(out, n4, stat=ws.stat)

    # ------------------------------------------------------------------ the C++ decode
    def _decode_kernel(self, step: Step, T: int) -> DecodeKernel | None:
        """The C++ decode where it covers this call (one float32 column per row on CPU, no autograd,
        no LoRA, a cache), else None (then the Python path below)."""
        if T != 1 or step.ctx.cache is None or step.freqs is None or torch.is_grad_enabled():
            return None
        if not self._decode_tried:
            self._decode_tried = True
            plain = not self.quantized and self.adapter_term is None and all(
                term is None for part in self.blocks.values() for p in part for term in p["low_rank"].values())
            # (one attention mask for every layer: a model with per-layer windows keeps the Python path)
            windowless = all(p["window"] is None for part in self.blocks.values() for p in part)
            usable = plain and windowless and self.dtype == torch.float32 and self.ln_f.device.type == "cpu"
            module = decode_cpp.load_decoder() if usable else None
            self._decode = DecodeKernel(module, self) if module is not None else None
        return self._decode

    def core_steps(self, state: Tensor, injected: Tensor, e: Tensor, steps: range, step: Step) -> Tensor:
        B, T, h = state.shape
        kernel = self._decode_kernel(step, T) if len(steps) else None
        out = kernel.core_steps(state, injected, steps, step) if kernel is not None else None
        return out.view(B, T, h) if out is not None else super().core_steps(state, injected, e, steps, step)

    def embed(self, input_ids: Tensor, step: Step, inputs_embeds: Tensor | None = None) -> Tensor:
        B, T = input_ids.shape
        kernel = self._decode_kernel(step, T) if inputs_embeds is None else None
        e = kernel.embed(input_ids, step) if kernel is not None else None
        if e is not None:
            return e.view(B, T, -1)
        x = F.embedding(input_ids.reshape(-1), self.wte) if inputs_embeds is None else inputs_embeds.reshape(B * T, -1)
        x = x * self.emb_scale
        for i, p in enumerate(self.blocks["prelude"]):
            x = self._block(x, p, step, ("prelude", i), B, T)
        return x.view(B, T, -1)

    def inject(self, e: Tensor) -> Tensor:
        if self.adapter is not None:
            return e
        flat = e.flatten(0, 1)
        return self._linear(flat, self.adapter_e, self.adapter_bias, low_rank=self.adapter_e_term).view(e.shape)

    def core_step(self, state: Tensor, injected: Tensor, e: Tensor, index: int, step: Step) -> Tensor:
        B, T, h = state.shape
        kernel = self._decode_kernel(step, T)  # (one step in C++: the exit criteria's loop, while no row stopped)
        out = kernel.core_steps(state, injected, range(index, index + 1), step) if kernel is not None else None
        if out is not None:
            return out.view(B, T, h)
        if self.adapter is not None:
            x = self._linear(torch.cat([state, e], dim=-1).reshape(B * T, 2 * h), self.adapter, None,
                             low_rank=self.adapter_term)
        else:
            x = self._linear(state.reshape(B * T, h), self.adapter_s, None, residual=injected.reshape(B * T, h),
                             low_rank=self.adapter_s_term, sum_once=True)
        for j, p in enumerate(self.blocks["core"]):
            x = self._block(x, p, step, ("core", j, index), B, T)
        return x.view(B, T, h)

    def final_norm(self, state: Tensor) -> Tensor:
        B, T, h = state.shape
        return self._norm(state.reshape(B * T, h), self.ln_f).view(B, T, h)

    def predict(self, state: Tensor, step: Step, last_only: bool = False) -> Tensor:
        B, T, h = state.shape
        kernel = self._decode_kernel(step, T)
        logits = kernel.predict(state, step) if kernel is not None else None
        if logits is not None:
            return logits.view(B, T, -1)
        x = self._norm(state.reshape(B * T, h), self.ln_f)
        for c, p in enumerate(self.blocks["coda"]):
            x = self._block(x, p, step, ("coda", c), B, T)
        if last_only and T > 1:
            x = x.view(B, T, h)[:, -1]
            T = 1
        logits = self._linear(self._norm(x, self.ln_f), self.lm_head, None).view(B, T, -1)
        return logits if logits.dtype == torch.float32 else logits.float()


def fast_runner(model: Any) -> FastRunner | None:
    """`make_runner`'s fast runner (see `register_fast_runner`): a `FastRunner` where the accel switch
    allows it and the model is supported, else None. Building one costs about 7 ms for the `small`
    preset and 80 ms at h 1024 (58 M parameters) here."""
    if not (enabled_by_default() and FastRunner.supports(model)):
        return None
    with torch.no_grad():  # the copies and folded weights are constants, not graph nodes
        return FastRunner(model)


register_fast_runner(fast_runner)  # (see integrations/autoregister.py)
