"""Compiled kernels for quantized KV decoding: TurboQuant's encode and attention from codes through
`torch.compile`, which the fast runner passes to `QuantizedRecurrentCache.attend`.

A decode call of a quantized cache encodes one new key and value per head and then reads every
column's codes; eagerly that is ~100 small tensor operations per attention layer (bit cutting,
lookups, norms, rotations), whose per-operation overhead, not arithmetic, sets the speed at batch 1.
Compiled, the whole read (score, softmax, value sum) is a few fused loops, and the two encodes are one
more call. The functions compiled are the eager ones (`recurrent_depth.quant.rows.turbo_encode`,
`turbo_score`, `turbo_combine` and `ops.codes_attention.codes_attention`), which stay the reference:
tests compare both.

- Only decode calls (one new token per row, no autograd, both sides TurboRows) are compiled; prefill
  and every other codec run the eager functions.
- The first decode call of a process compiles (about 10-30 s on a 2-core machine, with a message
  and its time; inductor caches the result on disk, so later processes take a few seconds); the
  sequence length is marked dynamic, so a growing cache does not recompile.
- On CPU the hand-written C++ kernels (`accel.quant_cpp`: the encode, the same bytes as
  `turbo_encode`; the read, one call between two matmuls) are preferred, built at the first decode
  call of a machine; `RDEPTH_NO_CPP=1` skips them, and where they cannot build, the compiled ones run.
- Off with the accel switch (`RDEPTH_NO_ACCEL=1`, or `fast=False`, which skips the fast runner), or
  with `RDEPTH_NO_COMPILE=1` and `RDEPTH_NO_CPP=1` together (either alone leaves the other path).
  Where compiling fails (no C++ compiler, an unsupported device), the kernels warn once and run
  eagerly from then on.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
from torch import Tensor

from recurrent_depth.accel import quant_cpp
from recurrent_depth.ops.codes_attention import codes_attention
from recurrent_depth.quant.rows import TurboRows, TurboTables, turbo_combine, turbo_encode, turbo_score

NO_COMPILE_ENV = "RDEPTH_NO_COMPILE"
log = logging.getLogger(__name__)
OPTIONS = {"cpp_wrapper": True}


def _encode_pair(k: Tensor, v: Tensor, tk: TurboTables, tv: TurboTables) -> tuple[Tensor, Tensor, Tensor]:
    rows_k, finite_k = turbo_encode(k, tk)
    rows_v, finite_v = turbo_encode(v, tv)
    return rows_k, rows_v, finite_k & finite_v


def _turbo_attention(q: Tensor, rows_k: Tensor, rows_v: Tensor, tk: TurboTables, tv: TurboTables,
                     attn_mask: Tensor | None, is_causal: bool) -> Tensor:
    return codes_attention(q, rows_k, rows_v, lambda x, rows: turbo_score(x, rows, tk),
                           lambda w, rows: turbo_combine(w, rows, tv), attn_mask, is_causal)


class CodeKernels:
    """The fused encode and attention for TurboRows codecs: C++ on CPU where it builds, else `torch.compile`d (see
    the module docstring). compile / cpp: whether to use each (`code_kernels` passes the environment's)."""

    def __init__(self, compile: bool = True, cpp: bool = False) -> None:
        self._compiled: dict[Any, Any] = {}  # built at first use: `torch.compile` imports ~2 s of modules
        self.compile, self.cpp = compile, cpp
        self._cpp: quant_cpp.CppCodes | None = None  # loaded at the first read
        self.failure: str | None = None  # why compiling failed (then the compiled calls run eagerly)

    def fits(self, ck: Any, cv: Any, x: Tensor) -> bool:
        """Whether this call runs here: a decode call (T = 1) without autograd on TurboRows codecs."""
        return (x.shape[2] == 1 and isinstance(ck, TurboRows) and isinstance(cv, TurboRows)
                and not torch.is_grad_enabled())

    def cpp_kernel(self) -> quant_cpp.CppCodes | None:
        """The C++ read, built or loaded at the first call; None when off or where it cannot build."""
        if self.cpp and self._cpp is None:
            module = quant_cpp.load()
            if module is None:
                self.cpp = False
            else:
                self._cpp = quant_cpp.CppCodes(module)
        return self._cpp if self.cpp else None

    def _run(self, eager: Any, *args: Any) -> Any:
        if not self.compile or self.failure is not None:
            return eager(*args)
        try:
            compiled = self._compiled.get(eager)
            if compiled is not None:
                return compiled(*args)
            compiled = self._compiled[eager] = torch.compile(eager, dynamic=False, options=OPTIONS)
            what = eager.__name__.strip("_").replace("_", " ")
            log.warning("compiling the quantized-KV %s kernel (torch.compile, once per process)", what)
            start = time.monotonic()
            out = compiled(*args)
            log.warning("compiled the quantized-KV %s kernel in %.1f s", what, time.monotonic() - start)
            return out
        except Exception as exc:  # a compiler missing or failing: run eagerly from now on
            if self.failure is None:
                self.failure = quant_cpp.failure_line(exc)
                log.warning("compiled quantized-KV kernels are unavailable (%s); decoding eagerly", self.failure)
            return eager(*args)

    def encode(self, ck: TurboRows, cv: TurboRows, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v `[B, Hkv, 1, D]` -> their code rows, as `ck.encode(k), cv.encode(v)` (the C++ encode on
        CPU: the same bytes; else compiled)."""
        cpp = self.cpp_kernel() if k.device.type == "cpu" else None
        if cpp is not None:
            rows_k, rows_v, finite = cpp.encode(ck.tables(k.device), cv.tables(v.device), k, v)
        else:
            rows_k, rows_v, finite = self._run(_encode_pair, k, v, ck.tables(k.device), cv.tables(v.device))
        if not bool(finite):  # the eager encodes raise the clear error (a norm beyond fp16)
            ck.encode(k), cv.encode(v)
        return rows_k, rows_v

    def fuses(self, ck: Any, cv: Any, q: Tensor, k: Tensor, is_causal: bool) -> bool:
        """Whether `decode_attend` runs this call: the C++ kernels, on CPU, in a decode call (`fits`)."""
        return (self.cpp and self.fits(ck, cv, k) and quant_cpp.CppCodes.fits(q, is_causal)
                and self.cpp_kernel() is not None)

    def decode_attend(self, ck: TurboRows, cv: TurboRows, q: Tensor, k: Tensor, v: Tensor, store_k: Tensor,
                      store_v: Tensor, start: int, attn_mask: Tensor | None) -> Tensor:
        """Encode k, v into a storage's rows `[B, Hkv, capacity, bytes]` at columns [start, start + T) and
        read attention over columns [0, start + T), in one C++ call (where `fuses`): the bytes of
        `encode`, the result of `attend` over the written rows."""
        assert self._cpp is not None
        cpu = q.device
        out, finite = self._cpp.decode_attend(ck.tables(cpu), cv.tables(cpu), q, k, v, store_k, store_v, start,
                                              attn_mask)
        if not finite:  # the eager encodes raise the clear error (a norm beyond fp16)
            ck.encode(k), cv.encode(v)
        return out

    def attend(self, ck: TurboRows, cv: TurboRows, q: Tensor, rows_k: Tensor, rows_v: Tensor,
               attn_mask: Tensor | None, is_causal: bool) -> Tensor:
        """`codes_attention` with the codecs' score and combine: the C++ read, else compiled."""
        if quant_cpp.CppCodes.fits(q, is_causal):
            cpp = self.cpp_kernel()
            if cpp is not None:
                return cpp.attend(ck.tables(q.device), cv.tables(q.device), q, rows_k, rows_v, attn_mask)
        for rows in (rows_k, rows_v):
            torch._dynamo.maybe_mark_dynamic(rows, 2)  # the sequence grows every token: no recompiles
        if attn_mask is not None:
            torch._dynamo.maybe_mark_dynamic(attn_mask, attn_mask.dim() - 1)
        return self._run(_turbo_attention, q, rows_k, rows_v, ck.tables(q.device), cv.tables(q.device),
                         attn_mask, is_causal)


_KERNELS: CodeKernels | None = None


def compile_enabled() -> bool:
    """False when the environment says `RDEPTH_NO_COMPILE` (any value but "", "0")."""
    return os.environ.get(NO_COMPILE_ENV, "") in ("", "0")


def code_kernels() -> CodeKernels | None:
    """The process's quantized-KV kernels (built once, so each variant compiles once), or None when
    `RDEPTH_NO_COMPILE` and `RDEPTH_NO_CPP` both say so."""
    global _KERNELS
    if not compile_enabled() and not quant_cpp.cpp_enabled():
        return None
    if _KERNELS is None:
        _KERNELS = CodeKernels(compile=compile_enabled(), cpp=quant_cpp.cpp_enabled())
    return _KERNELS
