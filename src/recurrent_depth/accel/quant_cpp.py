"""Hand-written CPU kernels for decoding from TurboQuant code rows (`torch.utils.cpp_extension.
load_inline`): the encode of a decode call's new keys and values, and softmax attention of one query
row per head over every column's codes, one C++ call each.

A compiled call (`accel.quant`) costs ~25 µs of overhead at batch 1. The read here is one C++ pass
per (batch row, kv head), with no ATen call inside: each query row's weight on each entry (`q @
query`, as `turbo_score`, so rotations, sketches, QJL scales and calibrated per-head permutations
are folded into that matrix), each key row scored straight from its bytes (the layout
`turbo_entries` reads: fp16 group norms, prod's residual byte, centroid indices, sign bits; on AVX2
builds eight entries at a time, a lane shift and a table permute, multiplied into the query rows'
sums in registers: no decoded row), the mask and softmax, each value row's table values added into
the weighted sums, times the back matrix (as `turbo_combine`). The C++ decode (`accel.decode_cpp`)
calls the encode and read on raw pointers (`decode_attend_rows`: no ATen call at all).

- Built once per user's cache directory, torch build, Python ABI and CPU (~30-60 s, with a message and
  its time; ahead of use with `rdepth info --build-kernels`), cached under `$XDG_CACHE_HOME/recurrent_depth/` or
  `~/.cache/recurrent_depth/`, keyed by the source, flags, torch and Python ABI and the CPU's features
  (it is built with -march=native), not by the environment's paths: virtualenvs share the build.
  `KernelCache` loads only the library its build recorded (sha256, size, a private directory of this
  user's), rebuilding anything else; concurrent first uses wait on an flock, which a killed builder
  cannot leave held. Where it cannot build (no compiler) it warns once, with the compiler's reason
  (`failure_line`), and `accel.quant` runs its compiled or eager path.
- Off with `RDEPTH_NO_CPP=1` (the torch.compile path then runs, unless `RDEPTH_NO_COMPILE=1`).
- The read: decode only (T = 1 query row per head), CPU, float32 accumulation (its sums and two small
  matmuls in another order than the reference's, FMA where built with it: within 1e-5 of it). The encode: the same bytes
  as `turbo_encode` (its matmuls and norms are the same ATen kernels: equal-sized groups' norms one
  call on a `[..., G, size]` view, the same last-dim reduction per group; the elementwise steps one
  IEEE rounding each, built with `-ffp-contract=off`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import stat
import sysconfig
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from recurrent_depth.files import atomic_write_bytes, atomic_write_text, file_sha256, held_lock, read_bytes, read_json
from recurrent_depth.quant.rows import TurboTables
from recurrent_depth.quant.turboquant import HASH_BITS, RESIDUAL_LEVELS

NO_CPP_ENV = "RDEPTH_NO_CPP"
log = logging.getLogger(__name__)
# -fopenmp: ATen's `at::parallel_for` in an extension splits work over torch's threads only when the
# extension is built with OpenMP (without it, it runs on one thread).
BUILD_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp")
LINK_FLAGS = ("-fopenmp",)
BUILD_LOCK_TIMEOUT_S = 900.0  # waiting for another process's build (30-60 s; far more on a loaded machine)
MAX_LIBRARY_BYTES = 256 << 20  # the built library is ~0.5 MB
RECORD_MAX_BYTES = 1 << 16

# The dot products both extensions use (here and accel/decode_cpp.py), of float32 rows with float32,
# int8 or bf16 weights (widened to float). `dot`: eight running sums, so the compiler vectorises it, added in a
# fixed order (the result does not depend on the build's vector width). `dot_rows`: up to four weight
# rows at once; on AVX2 with FMA four rows stream from memory together (two 8-wide accumulators a row):
# one float row at a time reads ~0.6 of the memory bandwidth on a 2-core AVX2 VM, four ~0.8-0.85 (ATen's
# gemv ~0.7); for int8 rows ~8x the scalar loop's rate.
DOT_SOURCE = r"""
template <typename W>
inline float dot(const float* a, const W* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t e = 0;
  for (; e + 8 <= n; e += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[e + j] * static_cast<float>(b[e + j]);
  }
  float total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
  for (; e < n; ++e) total += a[e] * static_cast<float>(b[e]);
  return total;
}

#if defined(__AVX2__)
// The eight lanes' sum, in one fixed order.
inline float hsum8(__m256 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  half = _mm_hadd_ps(half, half);
  return _mm_cvtss_f32(_mm_hadd_ps(half, half));
}
// a * b + c, fused where the build has FMA.
inline __m256 mul_add(__m256 a, __m256 b, __m256 c) {
#if defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return _mm256_add_ps(_mm256_mul_ps(a, b), c);
#endif
}
#endif
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// bf16 is the high half of a float32: widen to 32 bits and shift (exact).
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
#endif
#if defined(__AVX2__)
// Four rows of 1- and 2-byte weights stream faster with a software prefetch 512 bytes ahead of each
// (a 2-core AVX2 EPYC, Huginn's shapes: int8 rows 29-31 -> 33-39 GB/s; bf16 ones a few %); float32 rows
// (64 bytes a row a step) do not need it. (A prefetch past a row's end is harmless: it never faults.)
inline void prefetch_ahead(const void* p) { _mm_prefetch(static_cast<const char*>(p) + 512, _MM_HINT_T0); }
// The first 512 bytes of `rows` rows `stride` bytes apart: the next block's, which `prefetch_ahead` in
// the current block does not reach (on 5280-byte int8 rows, 10 % of each row).
inline void prefetch_starts(const void* first, int64_t stride, int64_t rows) {
  for (int64_t j = 0; j < rows; ++j) {
    for (int64_t b = 0; b < 512; b += 64) _mm_prefetch(static_cast<const char*>(first) + j * stride + b, _MM_HINT_T0);
  }
}
#endif

// y[j] = x . w[j] for `rows` (<= 4) weight rows j at w + j * stride, each of k entries.
template <typename W>
inline void dot_rows(const float* x, const W* w, int64_t k, int64_t stride, int64_t rows, float* y) {
#if defined(__AVX2__) && defined(__FMA__)
  if (rows == 4) {
    __m256 a[4], c[4];
    for (int j = 0; j < 4; ++j) a[j] = c[j] = _mm256_setzero_ps();
    int64_t e = 0;
    for (; e + 16 <= k; e += 16) {
      const __m256 xa = _mm256_loadu_ps(x + e), xb = _mm256_loadu_ps(x + e + 8);
      for (int j = 0; j < 4; ++j) {
        if (sizeof(W) < 4) prefetch_ahead(w + j * stride + e);
        a[j] = _mm256_fmadd_ps(xa, load8(w + j * stride + e), a[j]);
        c[j] = _mm256_fmadd_ps(xb, load8(w + j * stride + e + 8), c[j]);
      }
    }
    for (int j = 0; j < 4; ++j) {
      float total = hsum8(_mm256_add_ps(a[j], c[j]));
      for (int64_t f = e; f < k; ++f) total += x[f] * static_cast<float>(w[j * stride + f]);
      y[j] = total;
    }
    return;
  }
#endif
  for (int64_t j = 0; j < rows; ++j) y[j] = dot(x, w + j * stride, k);
}
"""

# The kernels (everything but the Python bindings, which CPP_SOURCE adds): also embedded by accel.decode_cpp.
KERNEL_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)  // built with -march=native, and the build is keyed by the CPU's features
#include <immintrin.h>
#endif

namespace {

// fp16 bits as a float (exact either way: F16C's conversion where the build has it).
inline float half_bits_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// One field of a side's rows as the read visits it: its first byte, entry count and bits, its first
// entry among the row's E, its table (the layout's values from its offset), which factor scales it,
// and (bits <= 4) the table padded to 16 values for the eight-lane lookup.
// wide: how many of its eight-entry groups can load their bits as one 4-byte word without reading past
// the row's `row_bytes` (the rest load byte by byte).
struct Field {
  int64_t first, count, entry, wide; int bits, factor; const float* table; float padded[16];
};

std::vector<Field> fields_of(const int32_t* layout, int64_t F, const float* values, int64_t row_bytes) {
  std::vector<Field> fields(F);
  int64_t entry = 0;
  for (int64_t i = 0; i < F; ++i) {
    const int32_t* l = layout + 5 * i;
    Field& f = fields[i];
    f.first = l[0], f.count = l[1], f.entry = entry, f.bits = l[2], f.factor = l[4], f.table = values + l[3];
    std::fill(f.padded, f.padded + 16, 0.0f);
    const int used = f.bits == 0 ? 1 : (f.bits <= 4 ? 1 << f.bits : 0);  // (a table may end after 2^bits values)
    std::copy(f.table, f.table + used, f.padded);
    const int64_t room = row_bytes - 4 - f.first;  // group i loads bytes [first + i bits, first + i bits + 4)
    f.wide = f.bits == 0 || room < 0 ? 0 : std::min<int64_t>(f.count / 8, room / f.bits + 1);
    entry += f.count;
  }
  return fields;
}

#if defined(__AVX2__)
// A field's eight-lane lookup, built once a call: its table padded to two vectors (for BITS <= 4;
// unused above). lookup(w): the eight entries whose BITS bytes w holds (big-endian, in its low bits),
// each shifted and masked out in its lane and looked up by a lane permute.
template <int BITS>
struct Lanes {
  __m256 low, high;
  explicit Lanes(const Field& f) : low(_mm256_loadu_ps(f.padded)), high(_mm256_loadu_ps(f.padded + 8)) {}
  __m256 lookup(uint32_t w) const {
    const __m256i shifts = _mm256_setr_epi32(7 * BITS, 6 * BITS, 5 * BITS, 4 * BITS, 3 * BITS, 2 * BITS, BITS, 0);
    const __m256i index = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), shifts),
                                           _mm256_set1_epi32((1 << BITS) - 1));
    __m256 value = _mm256_permutevar8x32_ps(low, index);
    if constexpr (BITS == 4) {  // indices 8-15 from the second half: bit 3 moved to the sign bit
      value = _mm256_blendv_ps(value, _mm256_permutevar8x32_ps(high, index),
                               _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));
    }
    return value;
  }
};
#else
template <int BITS>
struct Lanes { explicit Lanes(const Field&) {} };
#endif

// The BITS bytes of an eight-entry group at p, big-endian: one 4-byte load where the row has room
// past them (`wide`), else byte by byte.
template <int BITS>
inline uint32_t group_bits(const uint8_t* p, bool wide) {
  uint32_t w = 0;
  if (BITS > 1 && wide) {
    std::memcpy(&w, p, 4);
    return __builtin_bswap32(w) >> (32 - 8 * BITS);
  }
  for (int i = 0; i < BITS; ++i) w = (w << 8) | p[i];
  return w;
}

// Visits the entries of field f of `row` from entry `from` on (a multiple of 8) with their (unscaled)
// table values: eight(e, lanes) for entries e..e+7 at once (AVX2, BITS <= 4), one(e, value) for the
// others; the bits are big-endian in words of lcm(b, 8) bits (as `turbo_entries` cuts them) and no
// byte past the field's is read but by a `wide` load.
template <int BITS, typename Eight, typename One>
inline void visit_field(const uint8_t* row, const Field& f, const Lanes<BITS>& lanes, int64_t from, Eight&& eight,
                        One&& one) {
  const int64_t count = f.count;
  if constexpr (BITS == 0) {  // prod:1 stores no indices: the centroid table holds one 0
    for (int64_t e = from; e < count; ++e) one(e, f.table[0]);
  } else {
    constexpr int WORD_BITS = BITS * 8 / (BITS % 8 == 0 ? 8 : (BITS % 4 == 0 ? 4 : (BITS % 2 == 0 ? 2 : 1)));
    constexpr int WORD_BYTES = WORD_BITS / 8, PER = WORD_BITS / BITS;
    constexpr uint64_t MASK = (uint64_t(1) << BITS) - 1;
    const uint8_t* p = row + f.first + from / 8 * BITS;  // (eight entries fill BITS whole bytes)
    int64_t e = from;
#if defined(__AVX2__)
    if constexpr (BITS <= 4) {
      for (; e + 8 <= count; e += 8, p += BITS) eight(e, lanes.lookup(group_bits<BITS>(p, e / 8 < f.wide)));
    }
#endif
    for (; e + PER <= count; e += PER, p += WORD_BYTES) {
      uint64_t w = 0;
      for (int i = 0; i < WORD_BYTES; ++i) w = (w << 8) | p[i];
      for (int j = 0; j < PER; ++j) one(e + j, f.table[(w >> (WORD_BITS - BITS * (j + 1))) & MASK]);
    }
    if (e < count) {  // a last, partial word: only its bytes in the row
      const int64_t left = count - e, bytes = (left * BITS + 7) / 8;
      uint64_t w = 0;
      for (int i = 0; i < WORD_BYTES; ++i) w = (w << 8) | (i < bytes ? p[i] : 0);
      for (int64_t j = 0; j < left; ++j) one(e + j, f.table[(w >> (WORD_BITS - BITS * (j + 1))) & MASK]);
    }
  }
}

// body(std::integral_constant<int, bits>): a field's work with its bits known at compile time.
template <typename Body>
inline void with_bits(int bits, Body&& body) {
  switch (bits) {
    case 0: body(std::integral_constant<int, 0>()); break;
    case 1: body(std::integral_constant<int, 1>()); break;
    case 2: body(std::integral_constant<int, 2>()); break;
    case 3: body(std::integral_constant<int, 3>()); break;
    case 4: body(std::integral_constant<int, 4>()); break;
    case 5: body(std::integral_constant<int, 5>()); break;
    case 6: body(std::integral_constant<int, 6>()); break;
    case 7: body(std::integral_constant<int, 7>()); break;
    default: body(std::integral_constant<int, 8>()); break;
  }
}

// A row's factors: the G fp16 group norms at `norm_byte` (little-endian), then (prod) each group's
// norm times its residual byte times the group's step.
inline void row_factors(const uint8_t* row, int64_t norm_byte, int64_t G, const float* residual_step, float* factor) {
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* n = row + norm_byte + 2 * g;
    factor[g] = half_bits_to_float(static_cast<uint16_t>(n[0]) | (static_cast<uint16_t>(n[1]) << 8));
  }
  if (residual_step != nullptr) {
    for (int64_t g = 0; g < G; ++g) {
      factor[G + g] = factor[g] * (static_cast<float>(row[norm_byte + 2 * G + g]) * residual_step[g]);
    }
  }
}

""" + DOT_SOURCE + r"""
struct Side {
  const uint8_t* rows; int64_t s0, s1, s2, bytes;
  const int32_t* fields; int64_t F, E;
  const float* values; int64_t norm_byte, G; const float* residual_step;
};

Side side(const torch::Tensor& rows, const torch::Tensor& layout, const torch::Tensor& values,
          int64_t norm_byte, int64_t G, const torch::Tensor& residual_step) {
  TORCH_CHECK(rows.dtype() == torch::kUInt8 && rows.dim() == 4 && rows.stride(3) == 1,
              "rows: uint8 [B, Hkv, S, bytes], rows contiguous");
  TORCH_CHECK(layout.dtype() == torch::kInt32 && layout.is_contiguous() && layout.dim() == 2
              && layout.size(1) == 5, "layout: int32 [fields, 5]");
  int64_t E = 0;
  for (int64_t i = 0; i < layout.size(0); ++i) {
    E += layout.data_ptr<int32_t>()[5 * i + 1];
    TORCH_CHECK(layout.data_ptr<int32_t>()[5 * i + 2] <= 8, "layout: at most 8 bits an entry");
  }
  TORCH_CHECK(values.dtype() == torch::kFloat32 && values.is_contiguous(), "values: float32");
  TORCH_CHECK(residual_step.dtype() == torch::kFloat32 && residual_step.is_contiguous(), "residual_step: float32");
  return {rows.data_ptr<uint8_t>(), rows.stride(0), rows.stride(1), rows.stride(2), rows.size(3),
          layout.data_ptr<int32_t>(), layout.size(0), E, values.data_ptr<float>(), norm_byte, G,
          residual_step.numel() ? residual_step.data_ptr<float>() : nullptr};
}

// A matrix [rows, cols] per (batch row, kv head): `m` is [rows, cols], [Hkv, rows, cols] or
// [B, Hkv, rows, cols] (a pool's per-row permutations), float32 contiguous, broadcast as matmul does.
struct PerHead {
  const float* p; int64_t sb, sh;
  const float* at(int64_t b, int64_t h) const { return p + b * sb + h * sh; }
};

PerHead per_head(const torch::Tensor& m, int64_t B, int64_t Hkv, int64_t rows, int64_t cols, const char* what) {
  TORCH_CHECK(m.dtype() == torch::kFloat32 && m.is_contiguous() && m.dim() >= 2 && m.dim() <= 4
              && m.size(-2) == rows && m.size(-1) == cols, what, ": float32 [..., ", rows, ", ", cols, "] contiguous");
  const int64_t n = rows * cols;
  int64_t sb = 0, sh = 0;
  if (m.dim() >= 3) {
    TORCH_CHECK(m.size(-3) == Hkv || m.size(-3) == 1, what, ": one matrix or one per kv head");
    sh = m.size(-3) == 1 ? 0 : n;
  }
  if (m.dim() == 4) {
    TORCH_CHECK(m.size(0) == B || m.size(0) == 1, what, ": one matrix or one per batch row");
    sb = m.size(0) == 1 ? 0 : m.size(1) * n;
  }
  return {m.data_ptr<float>(), sb, sh};
}

// acc[c] += sum_r x[r * x_stride] * m[r, c]: a row times a [rows, cols] matrix; on AVX2 32 and then 8
// columns at a time, their sums in registers over every r (the matrices here are 16-128 wide).
inline void add_row_times(const float* x, int64_t x_stride, const float* m, int64_t rows, int64_t cols, float* acc) {
  int64_t c = 0;
#if defined(__AVX2__)
  for (; c + 32 <= cols; c += 32) {
    __m256 a[4];
    for (int j = 0; j < 4; ++j) a[j] = _mm256_loadu_ps(acc + c + 8 * j);
    for (int64_t r = 0; r < rows; ++r) {
      const __m256 w = _mm256_set1_ps(x[r * x_stride]);
      const float* mr = m + r * cols + c;
      for (int j = 0; j < 4; ++j) a[j] = mul_add(w, _mm256_loadu_ps(mr + 8 * j), a[j]);
    }
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(acc + c + 8 * j, a[j]);
  }
  for (; c + 8 <= cols; c += 8) {
    __m256 a = _mm256_loadu_ps(acc + c);
    for (int64_t r = 0; r < rows; ++r) {
      a = mul_add(_mm256_set1_ps(x[r * x_stride]), _mm256_loadu_ps(m + r * cols + c), a);
    }
    _mm256_storeu_ps(acc + c, a);
  }
#endif
  for (int64_t r = 0; r < rows && c < cols; ++r) {
    const float w = x[r * x_stride];
    const float* mr = m + r * cols;
    for (int64_t e = c; e < cols; ++e) acc[e] += w * mr[e];
  }
}

// QB query rows' dots with field f of one key row, straight from its codes, times `scale` (the row's
// factor for the field), added to out[j * out_stride]; query row j's weights at q + j * E (q: at the
// field's first entry).
template <int BITS, int QB>
inline void score_field(const uint8_t* row, const Field& f, const Lanes<BITS>& lanes, const float* q, int64_t E,
                        float scale, float* out, int64_t out_stride) {
  float tail[QB] = {};
#if defined(__AVX2__)
  __m256 acc[QB];
  for (int j = 0; j < QB; ++j) acc[j] = _mm256_setzero_ps();
  auto eight = [&](int64_t e, __m256 value) {
    for (int j = 0; j < QB; ++j) acc[j] = mul_add(value, _mm256_loadu_ps(q + j * E + e), acc[j]);
  };
#else
  auto eight = [](int64_t, float) {};
#endif
  visit_field<BITS>(row, f, lanes, 0, eight, [&](int64_t e, float value) {
    for (int j = 0; j < QB; ++j) tail[j] += value * q[j * E + e];
  });
  for (int j = 0; j < QB; ++j) {
#if defined(__AVX2__)
    tail[j] += hsum8(acc[j]);
#endif
    out[j * out_stride] += scale * tail[j];
  }
}

#if defined(__AVX2__)
// N eight-entry groups (from group g) of field f of every value row (row s at base + s * stride), each
// row weighted by weight[s] times its factor (factor[s * NF + the field's]), summed in registers over
// the rows (a row of weight 0 skipped), then added to sum (at the field's first entry).
template <int BITS, int N>
inline void value_groups(const uint8_t* base, int64_t stride, const Field& f, const Lanes<BITS>& lanes, int64_t g,
                         const float* weight, const float* factor, int64_t NF, int64_t S, float* sum) {
  __m256 acc[N];
  for (int c = 0; c < N; ++c) acc[c] = _mm256_setzero_ps();
  for (int64_t s = 0; s < S; ++s) {
    if (weight[s] == 0.0f) continue;
    const __m256 w = _mm256_set1_ps(weight[s] * factor[s * NF + f.factor]);
    const uint8_t* p = base + s * stride + f.first + g * BITS;
    for (int c = 0; c < N; ++c) {
      acc[c] = mul_add(w, lanes.lookup(group_bits<BITS>(p + c * BITS, g + c < f.wide)), acc[c]);
    }
  }
  for (int c = 0; c < N; ++c) {
    float* at = sum + (g + c) * 8;
    _mm256_storeu_ps(at, _mm256_add_ps(_mm256_loadu_ps(at), acc[c]));
  }
}
#endif

// The M query rows' weighted sums (row m's at sum + m * E) gain field f of every value row (row s at
// base + s * stride, weighted by p[m * S + s] times its factor), straight from the codes: one query
// row's sums in registers over all the rows, 32 entries at a time (AVX2), the others row by row.
template <int BITS>
inline void add_value_field(const uint8_t* base, int64_t stride, const Field& f, const Lanes<BITS>& lanes,
                            const float* p, int64_t S, int64_t M, const float* factor, int64_t NF, int64_t E,
                            float* scaled, float* sum) {
  float* first = sum + f.entry;
  int64_t from = 0;
#if defined(__AVX2__)
  if constexpr (BITS >= 1 && BITS <= 4) {
    if (M == 1) {
      const int64_t groups = f.count / 8;
      int64_t g = 0;
      for (; g + 4 <= groups; g += 4) value_groups<BITS, 4>(base, stride, f, lanes, g, p, factor, NF, S, first);
      for (; g < groups; ++g) value_groups<BITS, 1>(base, stride, f, lanes, g, p, factor, NF, S, first);
      from = groups * 8;
    }
  }
#endif
  if (from == f.count) return;
  for (int64_t s = 0; s < S; ++s) {
    bool any = false;  // a column every query row gives weight 0 (masked) adds nothing
    for (int64_t m = 0; m < M; ++m) {
      scaled[m] = p[m * S + s] * factor[s * NF + f.factor];
      any = any || p[m * S + s] != 0.0f;
    }
    if (!any) continue;
#if defined(__AVX2__)
    auto eight = [&](int64_t e, __m256 value) {
      for (int64_t m = 0; m < M; ++m) {
        float* at = first + m * E + e;
        _mm256_storeu_ps(at, mul_add(_mm256_set1_ps(scaled[m]), value, _mm256_loadu_ps(at)));
      }
    };
#else
    auto eight = [](int64_t, float) {};
#endif
    visit_field<BITS>(base + s * stride, f, lanes, from, eight, [&](int64_t e, float value) {
      for (int64_t m = 0; m < M; ++m) first[m * E + e] += scaled[m] * value;
    });
  }
}

// Softmax attention of each query row over every column's codes, in one pass per (b, kv head):
// qq = q @ query (each query row's weight on each key entry), the scores (qq · the key row's
// entries, times `scale`, masked), the softmax, the weighted sum of the value rows' entries, times
// `back`, written to out [B, H, 1, Dv] (contiguous float32). q [B, H, 1, D] float32 (any strides);
// mask: none (numel 0), or bool / float32 broadcast to [B, H, 1, S] (any strides).
// A per-head channel permutation [D] per (batch row, kv head) (`[Hkv, D]` or `[B, Hkv, D]` int64), or none.
struct PerHeadIndex {
  const int64_t* p = nullptr; int64_t sb = 0, sh = 0;
  const int64_t* at(int64_t b, int64_t h) const { return p + b * sb + h * sh; }
};

PerHeadIndex per_head_index(const torch::Tensor& perm, int64_t B, int64_t Hkv, int64_t D, const char* what) {
  PerHeadIndex index;
  if (perm.numel() == 0) return index;
  TORCH_CHECK(perm.dtype() == torch::kLong && perm.is_contiguous() && (perm.dim() == 2 || perm.dim() == 3)
              && perm.size(-1) == D && perm.size(-2) == Hkv
              && (perm.dim() == 2 || perm.size(0) == B || perm.size(0) == 1),
              what, ": int64 [(B,) Hkv, D] contiguous");
  index.p = perm.data_ptr<int64_t>();
  index.sh = D;
  index.sb = perm.dim() == 3 && perm.size(0) == B ? Hkv * D : 0;
  return index;
}

// The query rows [B, H, 1, D] by pointer and strides; a mask read as broadcast to [B, H, 1, S] by
// strides (0 on a broadcast axis): bool (false hides a column) or float32 (added to the scores), or none.
struct QueryIn { const float* p; int64_t B, H, D, s0, s1, s3; };
struct MaskIn { const bool* b = nullptr; const float* f = nullptr; int64_t s0 = 0, s1 = 0, s3 = 0; };

QueryIn query_in(const torch::Tensor& q) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 4 && q.size(2) == 1, "attend: float32 q [B, H, 1, D]");
  return {q.data_ptr<float>(), q.size(0), q.size(1), q.size(3), q.stride(0), q.stride(1), q.stride(3)};
}

// mask (bool or float32, at most 4-d, broadcastable to [B, H, 1, S] as torch broadcasts), or numel 0: none.
MaskIn mask_in(const torch::Tensor& mask, int64_t B, int64_t H, int64_t S) {
  MaskIn in;
  if (mask.numel() == 0) return in;
  TORCH_CHECK((mask.dtype() == torch::kBool || mask.dtype() == torch::kFloat32) && mask.dim() <= 4,
              "attend: a bool or float32 mask of at most 4 dims");
  const int64_t want[4] = {B, H, 1, S};
  int64_t stride[4] = {0, 0, 0, 0};
  for (int64_t d = 0; d < mask.dim(); ++d) {
    const int64_t axis = 4 - mask.dim() + d;
    TORCH_CHECK(mask.size(d) == want[axis] || mask.size(d) == 1, "attend: the mask does not broadcast to [",
                B, ", ", H, ", 1, ", S, "]");
    stride[axis] = mask.size(d) == 1 ? 0 : mask.stride(d);
  }
  in.s0 = stride[0], in.s1 = stride[1], in.s3 = stride[3];
  if (mask.dtype() == torch::kBool) in.b = mask.data_ptr<bool>(); else in.f = mask.data_ptr<float>();
  return in;
}

// With a key permutation, `query` is the shared codec's and each query row is permuted first
// (q @ query_h = q[perm_h] @ query); with a value un-permutation, `back` is the shared codec's and
// the output's columns are permuted last ((s @ back_h)[i] = (s @ back)[unperm_h[i]]): the same
// products as the per-head matrices, summed in another order, and one shared matrix in the cache.
void read_codes(const QueryIn& q, const Side& k, const Side& v, const PerHead& query, const PerHead& back,
                const PerHeadIndex& q_perm, const PerHeadIndex& out_perm,
                int64_t Hkv, int64_t S, int64_t Dv, const MaskIn& mask, float scale, float* o) {
  const int64_t B = q.B, H = q.H, D = q.D, M = H / Hkv;
  const int64_t q0 = q.s0, q1 = q.s1, q3 = q.s3;
  const float* qp = q.p;
  const bool has_mask = mask.b != nullptr || mask.f != nullptr, bool_mask = mask.b != nullptr;
  const int64_t m0 = mask.s0, m1 = mask.s1, m3 = mask.s3;
  const bool* mb = mask.b;
  const float* mf = mask.f;
  const std::vector<Field> key_fields = fields_of(k.fields, k.F, k.values, k.bytes);
  const std::vector<Field> value_fields = fields_of(v.fields, v.F, v.values, v.bytes);
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    const int64_t NF = 2 * std::max(k.G, v.G) + 2;  // a row's factors: G norms, (prod) G residual factors
    std::vector<float> key_factor(S * NF), value_factor(S * NF), p(M * S), scaled(M);
    std::vector<float> qq(M * k.E), sum(M * v.E), permuted(std::max(D, Dv));
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hkv, h = bh % Hkv;
      std::fill(qq.begin(), qq.end(), 0.0f);
      for (int64_t m = 0; m < M; ++m) {
        const float* row = qp + b * q0 + (h * M + m) * q1;
        if (q_perm.p != nullptr) {
          const int64_t* perm = q_perm.at(b, h);
          for (int64_t j = 0; j < D; ++j) permuted[j] = row[perm[j] * q3];
          add_row_times(permuted.data(), 1, query.at(b, h), D, k.E, qq.data() + m * k.E);
        } else {
          add_row_times(row, q3, query.at(b, h), D, k.E, qq.data() + m * k.E);
        }
      }
      const uint8_t* keys = k.rows + b * k.s0 + h * k.s1;
      const uint8_t* values = v.rows + b * v.s0 + h * v.s1;
      for (int64_t s = 0; s < S; ++s) {  // every column's factors, once
        row_factors(keys + s * k.s2, k.norm_byte, k.G, k.residual_step, key_factor.data() + s * NF);
        row_factors(values + s * v.s2, v.norm_byte, v.G, v.residual_step, value_factor.data() + s * NF);
      }
      std::fill(p.begin(), p.end(), 0.0f);
      for (const Field& f : key_fields) {  // field by field: its lookup built once, its bits known
        with_bits(f.bits, [&](auto bits) {
          constexpr int BITS = decltype(bits)::value;
          const Lanes<BITS> lanes(f);
          for (int64_t s = 0; s < S; ++s) {
            const uint8_t* row = keys + s * k.s2;
            const float factor = key_factor[s * NF + f.factor];
            for (int64_t m = 0; m < M;) {  // query rows four, two or one at a time (their sums in registers)
              const float* qm = qq.data() + m * k.E + f.entry;
              float* out = p.data() + m * S + s;
              if (M - m >= 4) {
                score_field<BITS, 4>(row, f, lanes, qm, k.E, factor, out, S);
                m += 4;
              } else if (M - m >= 2) {
                score_field<BITS, 2>(row, f, lanes, qm, k.E, factor, out, S);
                m += 2;
              } else {
                score_field<BITS, 1>(row, f, lanes, qm, k.E, factor, out, S);
                m += 1;
              }
            }
          }
        });
      }
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t s = 0; s < S; ++s) {
          float score = p[m * S + s] * scale;
          if (has_mask) {
            const int64_t at = b * m0 + (h * M + m) * m1 + s * m3;
            if (bool_mask) {
              if (!mb[at]) score = -std::numeric_limits<float>::infinity();
            } else {
              score += mf[at];
            }
          }
          p[m * S + s] = score;
        }
      }
      for (int64_t m = 0; m < M; ++m) {  // softmax as torch's: all -inf gives NaN, as SDPA's reference
        float* pm = p.data() + m * S;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < S; ++s) top = std::max(top, pm[s]);
        float total = 0;
        for (int64_t s = 0; s < S; ++s) { pm[s] = std::exp(pm[s] - top); total += pm[s]; }
        for (int64_t s = 0; s < S; ++s) pm[s] /= total;
      }
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (const Field& f : value_fields) {
        with_bits(f.bits, [&](auto bits) {
          constexpr int BITS = decltype(bits)::value;
          add_value_field<BITS>(values, v.s2, f, Lanes<BITS>(f), p.data(), S, M, value_factor.data(), NF, v.E,
                                scaled.data(), sum.data());
        });
      }
      for (int64_t m = 0; m < M; ++m) {
        float* om = o + (b * H + h * M + m) * Dv;
        float* acc = out_perm.p != nullptr ? permuted.data() : om;
        std::fill(acc, acc + Dv, 0.0f);
        add_row_times(sum.data() + m * v.E, 1, back.at(b, h), v.E, Dv, acc);
        if (out_perm.p != nullptr) {
          const int64_t* unperm = out_perm.at(b, h);
          for (int64_t i = 0; i < Dv; ++i) om[i] = acc[unperm[i]];
        }
      }
    }
  });
}

}  // namespace

namespace {

// Each group's norm of [..., D] rows, by the ATen calls `rows._group_norms` makes: norm(g, n) is
// row n's. Groups of one size are one call on the [..., G, size] view (the same last-dim reduction
// of each group's contiguous entries, so the same bits as one call per group), others one per group.
struct Norms {
  std::vector<torch::Tensor> keep; std::vector<const float*> p; int64_t stride = 1;
  float operator()(int64_t g, int64_t n) const { return p[g][n * stride]; }
};

Norms group_norms(const torch::Tensor& y, const std::vector<int64_t>& sizes) {
  Norms norms;
  const int64_t G = static_cast<int64_t>(sizes.size());
  const bool equal = std::all_of(sizes.begin(), sizes.end(), [&](int64_t size) { return size == sizes[0]; });
  if (G == 1 || (equal && y.is_contiguous())) {
    auto shape = y.sizes().vec();
    shape.back() = G;
    shape.push_back(sizes[0]);
    norms.keep.push_back(at::linalg_vector_norm(y.view(shape), 2, {-1}, false));
    norms.stride = G;
    for (int64_t g = 0; g < G; ++g) norms.p.push_back(norms.keep[0].data_ptr<float>() + g);
  } else {
    int64_t start = 0;
    for (int64_t size : sizes) {
      norms.keep.push_back(at::linalg_vector_norm(y.narrow(-1, start, size), 2, {-1}, false).contiguous());
      norms.p.push_back(norms.keep.back().data_ptr<float>());
      start += size;
    }
  }
  return norms;
}

// Float32 rows [B, H, T, D] by pointer (any strides but the last, which is 1; a contiguous [..., D]
// tensor is [1, 1, N, D]): row n counted over (b, h, t) in order.
struct RowsIn {
  const float* p; int64_t H, T, D, s0, s1, s2;
  int64_t head(int64_t n) const { return (n / T) % H; }
  int64_t batch(int64_t n) const { return n / (H * T); }
  const float* row(int64_t n) const { return p + batch(n) * s0 + head(n) * s1 + (n % T) * s2; }
  // Rows of this leading shape stored contiguously at `data` (a scratch copy of these or derived ones).
  RowsIn contiguous(const float* data) const { return {data, H, T, D, H * T * D, T * D, D}; }
};

RowsIn rows_in(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.stride(-1) == 1 && (x.dim() == 4 || x.is_contiguous()),
              "encode: float32 rows [B, Hkv, T, D] (the last dim contiguous)");
  const int64_t D = x.size(-1);
  if (x.dim() == 4) return {x.data_ptr<float>(), x.size(1), x.size(2), D, x.stride(0), x.stride(1), x.stride(2)};
  return {x.data_ptr<float>(), 1, x.numel() / std::max<int64_t>(D, 1), D, 0, 0, D};
}

// The plain-loop twins of `encode`'s matmul and norms, for the C++ decode (`plain`): each of N rows of x
// times its head's matrix m ([D, cols] for every head, or one per (batch row and) head, `count` of
// them, broadcast as matmul does) into out [N, cols]; and each group's norm sqrt(sum of squares) into
// [N, G]: equal to ATen's to float32 rounding (another summation order), not bit for bit, without the
// ~10 ATen calls an encode makes (at batch 1 they cost more than the decode's attention).
void rows_times(const RowsIn& x, int64_t N, const torch::Tensor& m, float* out) {
  const int64_t D = x.D, cols = m.size(-1), count = m.numel() / (D * cols);
  TORCH_CHECK(m.scalar_type() == at::kFloat && m.is_contiguous() && m.dim() >= 2 && m.size(-2) == D
              && (count == 1 || count == x.H || count == (N / (x.H * x.T)) * x.H),
              "encode: a [D, cols] matrix, or one per (batch row and) head");
  const float* mp = m.data_ptr<float>();
  std::fill(out, out + N * cols, 0.0f);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t h = x.head(n);
    const float* mat = mp + (count == 1 ? 0 : (count == x.H ? h : x.batch(n) * x.H + h)) * D * cols;
    add_row_times(x.row(n), 1, mat, D, cols, out + n * cols);
  }
}

Norms plain_norms(const float* y, int64_t N, int64_t D, const std::vector<int64_t>& sizes, float* out) {
  Norms norms;
  const int64_t G = static_cast<int64_t>(sizes.size());
  for (int64_t n = 0; n < N; ++n) {
    int64_t start = 0;
    for (int64_t g = 0; g < G; ++g) {
      const float* part = y + n * D + start;
      out[n * G + g] = std::sqrt(dot(part, part, sizes[g]));
      start += sizes[g];
    }
  }
  norms.stride = G;
  for (int64_t g = 0; g < G; ++g) norms.p.push_back(out + g);
  return norms;
}

// Appends values of `bits` bits, most significant first, to bytes from `p` on (a field's: each starts
// on a byte); `flush` writes a last partial byte, its low bits 0.
struct BitWriter {
  uint8_t* p; uint32_t acc = 0; int n = 0;
  void put(uint32_t value, int bits) {
    acc = (acc << bits) | (value & ((1u << bits) - 1));
    for (n += bits; n >= 8; n -= 8) *p++ = static_cast<uint8_t>(acc >> (n - 8));
    acc &= (1u << n) - 1;
  }
  void flush() { if (n > 0) *p++ = static_cast<uint8_t>(acc << (8 - n)); n = 0; acc = 0; }
};

}  // namespace

// One codec's constants, built once (`EntryLayout`), so that a call passes one object per side.
// With a folded per-head permutation, `query` and `back` are the shared codec's, `perm` [(B,) Hkv, D]
// (the query rows' and the encoded rows' gather), `unperm` its inverse (the output's) and `rotate` the
// shared codec's rotation (for the plain encode); else all three empty.
struct Codec {
  std::vector<torch::Tensor> tables; std::vector<int64_t> ints; std::vector<double> steps;
  torch::Tensor layout, values, residual_step, query, back; int64_t norm_byte, groups;
  torch::Tensor perm, unperm, rotate;
};

// The byte offset of each of x's rows (flat over its leading axes) in `rows` [..., nbytes] (any strides
// on the leading axes, the last one 1; the same leading shape as x).
std::vector<int64_t> row_offsets(const torch::Tensor& rows, int64_t N) {
  TORCH_CHECK(rows.dtype() == torch::kUInt8 && rows.stride(-1) == 1, "encode: uint8 rows, bytes contiguous");
  std::vector<int64_t> at(N, 0);
  const int64_t lead = rows.dim() - 1;
  for (int64_t n = 0; n < N; ++n) {
    int64_t rest = n, offset = 0;
    for (int64_t d = lead - 1; d >= 0; --d) {
      offset += (rest % rows.size(d)) * rows.stride(d);
      rest /= rows.size(d);
    }
    at[n] = offset;
  }
  return at;
}

// The codes of N rows y = x @ rotate [N, D] (norms np: each group's) into rows at out + row_at[n]
// (`encode`'s layout; every byte written): whether every stored norm is finite. prod: `sketch(residual)`
// gives (residual @ sketch_t [N, D], the residual's group norms) for the residual [N, D] it is handed.
// Float steps are the reference's, one rounding each (built with -ffp-contract=off), so the bytes are
// `turbo_encode`'s for the same y and norms.
template <typename Sketch>
bool encode_codes(const float* yp, const Norms& np, int64_t N, int64_t D, const std::vector<torch::Tensor>& t,
                  const std::vector<int64_t>& ints, const std::vector<double>& steps, float* residual,
                  Sketch&& sketch, uint8_t* out, const int64_t* row_at) {
  const int64_t G = ints[0];
  const std::vector<int64_t> sizes(ints.begin() + 1, ints.begin() + 1 + G);
  const int64_t norm_byte = ints[G + 1], nbytes = ints[G + 2], levels = ints[G + 3], hash = int64_t(1) << ints[G + 4];
  const bool prod = t[6].numel() > 0;
  const int64_t* col_group = t[1].data_ptr<int64_t>();
  const float* col_shift = t[2].data_ptr<float>();
  const float* bounds = t[3].data_ptr<float>();
  const int64_t nb = t[3].numel();
  const int64_t* offsets = t[4].data_ptr<int64_t>();
  const float* centroids = t[5].data_ptr<float>();
  const float tiny = std::numeric_limits<float>::min();
  std::vector<int32_t> entry(N * 2 * D, 0);  // [N, E]: indices, then (prod) sign bits
  std::vector<uint16_t> stored(N * G);
  bool finite = true;
  for (int64_t n = 0; n < N; ++n) {
    float ratio[8];
    for (int64_t g = 0; g < G; ++g) {
      const c10::Half h(np(g, n));
      stored[n * G + g] = h.x;
      const float s = static_cast<float>(h);
      finite = finite && std::isfinite(s);
      ratio[g] = s > 0 ? np(g, n) / std::max(s, tiny) : 1.0f;
    }
    for (int64_t c = 0; c < D; ++c) {
      const int64_t g = col_group[c];
      const float unit = yp[n * D + c] / std::max(np(g, n), tiny);
      const float shifted = unit + col_shift[c];
      const int64_t where = std::lower_bound(bounds, bounds + nb, shifted) - bounds;  // bucketize, right=False
      entry[n * 2 * D + c] = static_cast<int32_t>(where - offsets[c]);
      if (prod) {
        const float scaled = unit * ratio[g];
        residual[n * D + c] = scaled - centroids[where];
      }
    }
  }
  for (int64_t n = 0; n < N; ++n) std::fill(out + row_at[n], out + row_at[n] + nbytes, uint8_t(0));
  Norms rn;
  if (prod) {
    auto [sp, residual_norms] = sketch(residual);
    rn = std::move(residual_norms);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t c = 0; c < D; ++c) entry[n * 2 * D + D + c] = sp[n * D + c] >= 0 ? 1 : 0;
    }
  }
  const int32_t* fields = t[7].data_ptr<int32_t>();
  const int64_t F = t[7].size(0);
  for (int64_t n = 0; n < N; ++n) {
    uint8_t* row = out + row_at[n];
    const int32_t* e = entry.data() + n * 2 * D;
    for (int64_t i = 0; i < F; ++i) {
      const int32_t* l = fields + 5 * i;
      if (l[2] > 0) {
        BitWriter bits{row + l[0]};
        for (int64_t j = 0; j < l[1]; ++j) bits.put(static_cast<uint32_t>(e[j]), l[2]);
        bits.flush();
      }
      e += l[1];
    }
    for (int64_t g = 0; g < G; ++g) {
      row[norm_byte + 2 * g] = stored[n * G + g] & 0xff;
      row[norm_byte + 2 * g + 1] = stored[n * G + g] >> 8;
    }
    if (prod) {  // `turboquant.residual_code`: stochastic rounding of ||r|| / step, u hashed from the signs
      int64_t start = 0;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t* w = t[8 + g].data_ptr<int64_t>();
        int64_t h = 0;
        for (int64_t c = 0; c < sizes[g]; ++c) h += entry[n * 2 * D + D + start + c] * w[c];
        h = (h + w[sizes[g]]) % hash;
        const double u = (static_cast<double>(h) + 0.5) / static_cast<double>(hash);
        double q = std::floor(static_cast<double>(rn(g, n)) / steps[g] + u);
        q = std::min(std::max(q, 0.0), static_cast<double>(levels));
        row[norm_byte + 2 * G + g] = static_cast<uint8_t>(q);
        start += sizes[g];
      }
    }
  }
  return finite;
}

// The encode of N rows of x by plain loops (`plain`) into rows at out + row_at[n]; no ATen call. With a
// folded permutation each row is gathered by its head's and rotated by the shared codec's matrix
// (x @ rotate_h = x[perm_h] @ rotate: one [D, D] matrix for every layer and head stays in cache, where
// the per-head ones of every layer did not).
bool encode_plain(const RowsIn& x, int64_t N, const Codec& c, uint8_t* out, const int64_t* row_at) {
  const std::vector<torch::Tensor>& t = c.tables;
  const int64_t G = c.ints[0], D = x.D;
  TORCH_CHECK(G >= 1 && G <= 8 && static_cast<int64_t>(t.size()) == 8 + (t[6].numel() > 0 ? G : 0), "encode: tables");
  TORCH_CHECK(t[0].size(-1) == D, "encode: the rotation's width is the head dim");
  const std::vector<int64_t> sizes(c.ints.begin() + 1, c.ints.begin() + 1 + G);
  std::vector<float> y(N * D), norms(N * G), residual(t[6].numel() > 0 ? N * D : 0), signs(residual.size()),
      residual_norms(N * G), gathered;
  const bool gather = c.perm.numel() > 0 && c.rotate.numel() > 0;
  if (gather) {
    const PerHeadIndex perm = per_head_index(c.perm, N / (x.H * x.T), x.H, D, "encode perm");
    gathered.resize(N * D);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t* order = perm.at(x.batch(n), x.head(n));
      const float* row = x.row(n);
      for (int64_t j = 0; j < D; ++j) gathered[n * D + j] = row[order[j]];
    }
    rows_times(x.contiguous(gathered.data()), N, c.rotate, y.data());
  } else {
    rows_times(x, N, t[0], y.data());
  }
  const Norms np = plain_norms(y.data(), N, D, sizes, norms.data());
  auto sketch = [&](float* r) {
    rows_times(x.contiguous(r), N, t[6], signs.data());
    return std::make_pair(static_cast<const float*>(signs.data()), plain_norms(r, N, D, sizes, residual_norms.data()));
  };
  return encode_codes(y.data(), np, N, D, t, c.ints, c.steps, residual.data(), sketch, out, row_at);
}

// `encode_into` of x [..., D] into `rows` [..., nbytes] (see `encode`): whether every stored norm is finite.
// Its products and norms are ATen's (the bytes of `turbo_encode`; `encode_plain` is the C++ decode's).
bool encode_into(const torch::Tensor& x, const std::vector<torch::Tensor>& t, const std::vector<int64_t>& ints,
                 const std::vector<double>& steps, torch::Tensor& rows);
// The same into rows at out + row_at[n] for x's N rows.
bool encode_at(const torch::Tensor& x, const std::vector<torch::Tensor>& t, const std::vector<int64_t>& ints,
               const std::vector<double>& steps, uint8_t* out, const int64_t* row_at);

// `rows.turbo_encode` of x [..., D]: tables = (rotate, col_group, col_shift, boundaries, offsets,
// centroids, sketch_t or empty, fields [F, 5] int32, each group's dither weights (prod)); ints =
// (G, the group sizes, norm byte, row bytes, residual levels, hash bits); steps: the residual steps.
// Returns (rows uint8 [..., bytes], whether every stored norm is finite).
std::tuple<torch::Tensor, bool> encode(const torch::Tensor& x, const std::vector<torch::Tensor>& t,
                                       const std::vector<int64_t>& ints, const std::vector<double>& steps) {
  auto shape = x.sizes().vec();
  shape.back() = ints[ints[0] + 2];
  torch::Tensor rows = torch::empty(shape, x.options().dtype(torch::kUInt8));
  const bool finite = encode_into(x, t, ints, steps, rows);
  return {rows, finite};
}

bool encode_into(const torch::Tensor& x, const std::vector<torch::Tensor>& t, const std::vector<int64_t>& ints,
                 const std::vector<double>& steps, torch::Tensor& rows) {
  const int64_t G = ints[0], D = x.size(-1), N = x.numel() / std::max<int64_t>(D, 1);
  TORCH_CHECK(G >= 1 && G <= 8 && static_cast<int64_t>(t.size()) == 8 + (t[6].numel() > 0 ? G : 0), "encode: tables");
  TORCH_CHECK(rows.dim() == x.dim() && rows.size(-1) == ints[G + 2] && rows.numel() == N * ints[G + 2],
              "encode: rows [..., ", ints[G + 2], "] of x's leading shape");
  return encode_at(x, t, ints, steps, rows.data_ptr<uint8_t>(), row_offsets(rows, N).data());
}

bool encode_at(const torch::Tensor& x, const std::vector<torch::Tensor>& t, const std::vector<int64_t>& ints,
               const std::vector<double>& steps, uint8_t* out, const int64_t* row_at) {
  const int64_t G = ints[0], D = x.size(-1), N = x.numel() / std::max<int64_t>(D, 1);
  const std::vector<int64_t> sizes(ints.begin() + 1, ints.begin() + 1 + G);
  const torch::Tensor y = at::matmul(x.to(at::kFloat), t[0]).contiguous();
  const Norms np = group_norms(y, sizes);
  std::vector<float> residual(t[6].numel() > 0 ? N * D : 0);
  torch::Tensor signs;
  auto sketch = [&](float* r) {
    // (matmul folds a contiguous [..., D] into mm: the same call, less dispatch)
    const torch::Tensor rt = torch::from_blob(r, y.sizes(), y.options());
    signs = t[6].dim() == 2 ? at::mm(rt.view({N, D}), t[6]) : at::matmul(rt, t[6]).contiguous();
    return std::make_pair(static_cast<const float*>(signs.data_ptr<float>()), group_norms(rt, sizes));
  };
  return encode_codes(y.data_ptr<float>(), np, N, D, t, ints, steps, residual.data(), sketch, out, row_at);
}

// The loop every weight stream shares: a weight's [out, in] rows streamed once for all N rows of x, split
// across the threads in blocks of four (`row_bytes` apart from `first_row`; 1- and 2-byte weights get the
// next block's row starts prefetched, `prefetch_starts`). `dots(n, o, rows, d)` writes d[j] = x[n] . w[o + j]
// (times any scale) for j < rows; then y[n, o + j] = ((residual) + d[j]) + bias in float32, each term
// optional (null pointers), y float32 [N, out].
template <typename Dots>
void stream_blocks(int64_t N, int64_t O, const void* first_row, int64_t row_bytes, bool narrow, const float* rp,
                   const float* bp, float* yp, const Dots& dots) {
  at::parallel_for(0, (O + 3) / 4, 16, [&](int64_t begin, int64_t end) {
    float d[4];
    for (int64_t quad = begin; quad < end; ++quad) {
      const int64_t o = 4 * quad, rows = std::min<int64_t>(4, O - o);
#if defined(__AVX2__)
      if (narrow && quad + 1 < end) {
        prefetch_starts(static_cast<const char*>(first_row) + (o + 4) * row_bytes, row_bytes,
                        std::min<int64_t>(4, O - o - 4));
      }
#endif
      for (int64_t n = 0; n < N; ++n) {
        dots(n, o, rows, d);
        for (int64_t j = 0; j < rows; ++j) {
          const float v = rp != nullptr ? rp[n * O + o + j] + d[j] : d[j];
          yp[n * O + o + j] = bp != nullptr ? v + bp[o + j] : v;
        }
      }
    }
  });
}

// `stream_blocks` of float32 rows x [N, K] and W rows (row o at wp + o * stride) by `dot_rows`, times
// scale[o] when `sp` is given.
template <typename W>
void stream_rows(const float* xp, const W* wp, int64_t N, int64_t K, int64_t O, int64_t stride, const float* sp,
                 const float* rp, const float* bp, float* yp) {
  stream_blocks(N, O, wp, stride * static_cast<int64_t>(sizeof(W)), sizeof(W) < 4, rp, bp, yp,
                [&](int64_t n, int64_t o, int64_t rows, float* d) {
                  dot_rows(xp + n * K, wp + o * stride, K, stride, rows, d);
                  if (sp != nullptr) {
                    for (int64_t j = 0; j < rows; ++j) d[j] *= sp[o + j];
                  }
                });
}

// An optional float32 or bf16 tensor of `numel` entries as contiguous float32 (undefined when absent).
torch::Tensor float_operand(const c10::optional<torch::Tensor>& t, int64_t numel, const char* what) {
  if (!t.has_value() || !t->defined()) return torch::Tensor();
  TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16) && t->numel() == numel,
              what, ": float32 or bf16 of ", numel, " entries");
  return t->to(at::kFloat).contiguous();
}

const float* data_or_null(const torch::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

// A bf16 row as int16 multiples of one power of two, for `int_dot_rows`: with the row's largest |x| below
// 2^ex, step = 2^(ex - 15), so |x / step| <= 32640, and every bf16 entry of at least 2^-8 of 2^ex (its
// last significand bit worth at least the step) is an exact multiple; smaller ones round to the nearest
// (within step / 2 = 2^-16 of 2^ex). False (and nothing written) for a row with an inf or NaN.
bool int16_row(const float* x, int64_t k, int16_t* out, double* step) {
  float largest = 0;
  for (int64_t e = 0; e < k; ++e) {
    const float a = std::fabs(x[e]);
    if (!(a <= std::numeric_limits<float>::max())) return false;
    largest = std::max(largest, a);
  }
  int ex = 0;
  std::frexp(largest, &ex);  // largest = m 2^ex, m in [0.5, 1) (0: ex = 0)
  *step = std::ldexp(1.0, ex - 15);
  const double inverse = std::ldexp(1.0, 15 - ex);  // (a power of two: exact scaling, in double's range)
  for (int64_t e = 0; e < k; ++e) out[e] = static_cast<int16_t>(std::nearbyint(x[e] * inverse));
  return true;
}

// int8 . int16 dot products, exact (int64 totals), for `rows` (<= 4) weight rows j at w + j * stride. On AVX2
// 32 weights of four rows a step: sign-extended to int16 and multiplied in pairs (`vpmaddwd`: 16 weights
// an instruction, where converting to float takes 8), in int32 lanes flushed to int64 every INT_BLOCK
// entries (a lane gains at most 2 x 2 x 128 x 32640 a step: 32 steps stay below 2^31).
constexpr int64_t INT_BLOCK = 1024;

inline void int_dot_rows(const int16_t* x, const int8_t* w, int64_t k, int64_t stride, int64_t rows,
                         int64_t* y) {
  int64_t e = 0;
  for (int64_t j = 0; j < rows; ++j) y[j] = 0;
#if defined(__AVX512BW__)
  // With AVX-512, 64 weights of four rows a step (twice AVX2's; with VNNI the multiply and the add are one
  // `vpdpwssd`): the same integer sums, so the same results. A lane gains at most 4 x 128 x 32640 a step,
  // and INT_BLOCK / 64 = 16 steps stay below 2^31.
  if (rows == 4) {
    __m512i total[4];
    for (int j = 0; j < 4; ++j) total[j] = _mm512_setzero_si512();
    while (e + 64 <= k) {
      const int64_t end = std::min<int64_t>(k, e + INT_BLOCK);
      __m512i acc[4];
      for (int j = 0; j < 4; ++j) acc[j] = _mm512_setzero_si512();
      for (; e + 64 <= end; e += 64) {
        const __m512i xa = _mm512_loadu_si512(x + e);
        const __m512i xb = _mm512_loadu_si512(x + e + 32);
        for (int j = 0; j < 4; ++j) {
          const int8_t* row = w + j * stride + e;
          prefetch_ahead(row);
          const __m512i wa = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
          const __m512i wb = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32)));
#if defined(__AVX512VNNI__)
          acc[j] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(acc[j], xa, wa), xb, wb);
#else
          acc[j] = _mm512_add_epi32(acc[j], _mm512_add_epi32(_mm512_madd_epi16(xa, wa), _mm512_madd_epi16(xb, wb)));
#endif
        }
      }
      for (int j = 0; j < 4; ++j) {
        total[j] = _mm512_add_epi64(total[j], _mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc[j])));
        total[j] = _mm512_add_epi64(total[j], _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc[j], 1)));
      }
    }
    for (int j = 0; j < 4; ++j) y[j] = _mm512_reduce_add_epi64(total[j]);
  }
#endif
#if defined(__AVX2__)
  if (rows == 4) {
    __m256i total[4];
    for (int j = 0; j < 4; ++j) total[j] = _mm256_setzero_si256();
    while (e + 32 <= k) {
      const int64_t end = std::min<int64_t>(k, e + INT_BLOCK);
      __m256i acc[4];
      for (int j = 0; j < 4; ++j) acc[j] = _mm256_setzero_si256();
      for (; e + 32 <= end; e += 32) {
        const __m256i xa = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + e));
        const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + e + 16));
        for (int j = 0; j < 4; ++j) {
          const int8_t* row = w + j * stride + e;
          prefetch_ahead(row);
          const __m256i wa = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row)));
          const __m256i wb = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16)));
          acc[j] = _mm256_add_epi32(acc[j], _mm256_add_epi32(_mm256_madd_epi16(xa, wa), _mm256_madd_epi16(xb, wb)));
        }
      }
      for (int j = 0; j < 4; ++j) {
        total[j] = _mm256_add_epi64(total[j], _mm256_cvtepi32_epi64(_mm256_castsi256_si128(acc[j])));
        total[j] = _mm256_add_epi64(total[j], _mm256_cvtepi32_epi64(_mm256_extracti128_si256(acc[j], 1)));
      }
    }
    for (int j = 0; j < 4; ++j) {
      alignas(32) int64_t lanes[4];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), total[j]);
      y[j] += (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);  // after the AVX-512 loop's share, if any
    }
  }
#endif
  for (int64_t j = 0; j < rows; ++j) {
    for (int64_t f = e; f < k; ++f) y[j] += static_cast<int32_t>(x[f]) * static_cast<int32_t>(w[j * stride + f]);
  }
}

// int8 weights at decode row counts (`weight_quant.Int8WeightLinear`): y [N, out] = x [N, in] (q [out, in] *
// scales[:, None])^T (+ bias), each weight row streamed once for all N rows (split across the threads,
// four rows together), reading 1 byte a weight where the reference materialises 4.
// - float32 rows: converted to float and dotted (`dot_rows`), times the scale: the reference's x @
//   dequantized^T to float32 rounding (the scale applied once, after the sum);
// - bf16 rows: as int16 multiples of a power of two (`int16_row`: exact for every entry within 8 binades of
//   the row's largest), dotted exactly in integers (`int_dot_rows`: twice the float path's rate, which is
//   bound by its conversions on AVX2), times step and scale in double, rounded once to float32, then to
//   bf16; a row with an inf or NaN takes the float path.
torch::Tensor int8_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                          const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int8_linear: x float32 or bf16 [N, in]");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() && q.size(1) == x.size(1),
              "int8_linear: q int8 [out, in]");
  const int64_t N = x.size(0), K = x.size(1), O = q.size(0);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == O,
              "int8_linear: scales float32 [out]");
  const torch::Tensor x32 = x.to(at::kFloat).contiguous(), b32 = float_operand(bias, O, "int8_linear: bias");
  torch::Tensor y = torch::empty({N, O}, x32.options());
  const float* xp = x32.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  if (x.scalar_type() != at::kBFloat16) {
    stream_rows(xp, qp, N, K, O, K, sp, nullptr, data_or_null(b32), y.data_ptr<float>());
    return y;
  }
  std::vector<int16_t> x16(N * K);
  std::vector<double> steps(N);
  std::vector<char> whole(N);
  for (int64_t n = 0; n < N; ++n) whole[n] = int16_row(xp + n * K, K, x16.data() + n * K, &steps[n]);
  stream_blocks(N, O, qp, K, true, nullptr, data_or_null(b32), y.data_ptr<float>(),
                [&](int64_t n, int64_t o, int64_t rows, float* d) {
                  if (!whole[n]) {
                    dot_rows(xp + n * K, qp + o * K, K, K, rows, d);
                    for (int64_t j = 0; j < rows; ++j) d[j] *= sp[o + j];
                    return;
                  }
                  int64_t sums[4];
                  int_dot_rows(x16.data() + n * K, qp + o * K, K, K, rows, sums);
                  for (int64_t j = 0; j < rows; ++j) {
                    d[j] = static_cast<float>(static_cast<double>(sums[j]) * steps[n] * sp[o + j]);
                  }
                });
  return y.to(at::kBFloat16);
}

// int4 weights (`weight_quant.Int4WeightLinear` in plain layout): w[o, e] = (q[o, e] - 8) s[o, g] + z[o, g],
// q in 0..15 two a byte in plain order (`pack_nibbles`: column 2i in byte i's low nibble, 2i + 1 in its
// high one), one bf16 (scale, zero) pair per group of `group` columns, row-major ([out, groups, 2]). Per
// group x . w = s (x . q) + (z - 8 s) (sum of x), so a product needs each group's x . q and, once per row
// of x, each group's sum of x (`Int4Row`); the second terms of a weight row are one vector pass over its
// pairs (`zero_terms`).
// The unpack reads a 16-byte chunk (32 columns) as eight 16-bit words: nibble k of word i is column
// 4i + k, so four shift-and-masks give four vectors of 16-bit lanes, the columns 4i + k for k = 0..3,
// with no widening. x is reordered once per call to match: chunks in pairs (64 columns, a 32-byte load),
// position 64p + 16k + 8h + i holding column 64p + 32h + 4i + k (h: which chunk of the pair).
constexpr int64_t INT4_CHUNK = 32;  // the columns 16 bytes hold (every group size is a multiple)
constexpr int64_t INT4_PAIR = 64;

// The position of column e of a row in the reordered x.
inline int64_t int4_position(int64_t e) {
  const int64_t p = e / INT4_PAIR, h = (e / INT4_CHUNK) % 2, i = (e % INT4_CHUNK) / 4, k = e % 4;
  return INT4_PAIR * p + 16 * k + 8 * h + i;
}

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &word, sizeof(f));
  return f;
}

// One row of x as `int4_dot_rows` reads it: reordered (a whole number of chunk pairs, zeros past K), as
// int16 multiples of `step` where `exact` (a bf16 row, `int16_row`) else as float, and each group's sum
// (in steps, or in float).
struct Int4Row {
  std::vector<float> x;
  std::vector<int16_t> x16;
  std::vector<float> sums;
  double step = 1.0;
  bool exact = false;
};

Int4Row int4_row(const float* x, int64_t K, int64_t P, int64_t group, bool bf16) {
  Int4Row r;
  const int64_t padded = (P + INT4_PAIR - 1) / INT4_PAIR * INT4_PAIR, G = P / group;
  std::vector<float> plain(P, 0.0f);
  std::copy(x, x + K, plain.begin());
  std::vector<int16_t> plain16;
  if (bf16) {
    plain16.resize(P);
    r.exact = int16_row(plain.data(), P, plain16.data(), &r.step);
  }
  r.sums.assign(G, 0.0f);
  for (int64_t g = 0; g < G; ++g) {
    if (r.exact) {
      int32_t total = 0;  // (at most 256 x 32640: exact, and exact as a float)
      for (int64_t e = g * group; e < (g + 1) * group; ++e) total += plain16[e];
      r.sums[g] = static_cast<float>(total);
    } else {
      float total = 0;
      for (int64_t e = g * group; e < (g + 1) * group; ++e) total += plain[e];
      r.sums[g] = total;
    }
  }
  if (r.exact) {
    r.x16.assign(padded, 0);
    for (int64_t e = 0; e < P; ++e) r.x16[int4_position(e)] = plain16[e];
  } else {
    r.x.assign(padded, 0.0f);
    for (int64_t e = 0; e < P; ++e) r.x[int4_position(e)] = plain[e];
  }
  return r;
}

#if defined(__AVX2__)
inline __m256i load256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
#endif

// sum over groups of (z - 8 s) times the group's sum of x, for one weight row's G pairs.
inline float zero_terms(const uint16_t* pairs, const float* sums, int64_t G) {
  float total = 0;
  int64_t g = 0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (; g + 8 <= G; g += 8) {  // eight pairs as 32-bit words: the scale in the low half, the zero in the high one
    const __m256i words = load256(pairs + 2 * g);
    const __m256 s = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
    const __m256 z = _mm256_castsi256_ps(_mm256_and_si256(words, high));
    acc = _mm256_fmadd_ps(_mm256_fnmadd_ps(_mm256_set1_ps(8.0f), s, z), _mm256_loadu_ps(sums + g), acc);
  }
  total = hsum8(acc);
#endif
  for (; g < G; ++g) {
    const float s = bf16_bits_to_float(pairs[2 * g]), z = bf16_bits_to_float(pairs[2 * g + 1]);
    total += (z - 8.0f * s) * sums[g];
  }
  return total;
}

#if defined(__AVX2__) && defined(__FMA__)
// The four vectors of 16-bit lanes (nibble k of each word) of 16 or 32 packed bytes.
inline void nibbles(__m256i v, __m256i* n) {
  const __m256i low4 = _mm256_set1_epi16(0x0F);
  n[0] = _mm256_and_si256(v, low4);
  n[1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  n[2] = _mm256_and_si256(_mm256_srli_epi16(v, 8), low4);
  n[3] = _mm256_srli_epi16(v, 12);
}
inline void nibbles(__m128i v, __m128i* n) {
  const __m128i low4 = _mm_set1_epi16(0x0F);
  n[0] = _mm_and_si128(v, low4);
  n[1] = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
  n[2] = _mm_and_si128(_mm_srli_epi16(v, 8), low4);
  n[3] = _mm_srli_epi16(v, 12);
}
// x . q over one chunk pair in int32 lanes (lanes 0-3 the first chunk's, 4-7 the second's): each lane at
// most 8 products of 15 x 32640, so a group of 256 columns stays below 2^24 (exact as a float).
inline __m256i pair_dots(const __m256i* x, __m256i bytes) {
  __m256i n[4];
  nibbles(bytes, n);
  return _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(n[0], x[0]), _mm256_madd_epi16(n[1], x[1])),
                          _mm256_add_epi32(_mm256_madd_epi16(n[2], x[2]), _mm256_madd_epi16(n[3], x[3])));
}
// The four x vectors (k = 0..3) of chunk pair p.
inline void pair_x(const int16_t* x16, int64_t p, __m256i* x) {
  for (int k = 0; k < 4; ++k) x[k] = load256(x16 + 64 * p + 16 * k);
}
// The same over one chunk (the first of a pair) in four lanes, summed.
inline int32_t chunk_dot(const int16_t* x, const uint8_t* w) {
  __m128i n[4];
  nibbles(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)), n);
  __m128i d = _mm_setzero_si128();
  for (int k = 0; k < 4; ++k) {
    d = _mm_add_epi32(d, _mm_madd_epi16(n[k], _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 16 * k))));
  }
  d = _mm_hadd_epi32(d, d);
  return _mm_cvtsi128_si32(_mm_hadd_epi32(d, d));
}
// x . q over one chunk of float x (h: which chunk of its pair), in eight float lanes.
inline __m256 chunk_dot(const float* x, const uint8_t* w) {
  __m128i n[4];
  nibbles(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)), n);
  __m256 d = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    d = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(n[k])), _mm256_loadu_ps(x + 16 * k), d);
  }
  return d;
}
#endif

// d[j] = x . w[j] for `rows` (<= 4) int4 weight rows (row j's bytes at w + j * row_bytes, its pairs at
// sz + j * 2 * G): per group s * (x . q) in float32 (x . q exact in integers for an exact row), plus the
// zero terms, times the row's step.
inline void int4_dot_rows(const Int4Row& r, const uint8_t* w, int64_t row_bytes, const uint16_t* sz, int64_t G,
                          int64_t group, int64_t rows, float* d) {
  const int64_t P = G * group, chunks = P / INT4_CHUNK, per_group = group / INT4_CHUNK;
#if defined(__AVX2__) && defined(__FMA__)
  if (rows == 4) {
    __m256 acc[4];
    for (int j = 0; j < 4; ++j) acc[j] = _mm256_setzero_ps();
    float lone[4] = {0, 0, 0, 0};  // the AVX-512 pairs' sums and a last unpaired chunk's (group 32, odd groups)
    if (r.exact && group == INT4_CHUNK) {  // a group a chunk: a pair's lanes take two scales
      // Four pairs (eight groups) at a time: each row's eight scales widened once (the pairs as 32-bit
      // words, the scale in the low half), then spread over each pair's lanes by a permute.
      const int64_t pairs = chunks / 2;
      int64_t p = 0;
#if defined(__AVX512BW__)
      // With AVX-512, two pairs (128 columns, 64 bytes) of four rows a step, sixteen scales (eight pairs) a
      // load: each int32 lane holds the same 8 products as on AVX2 (with VNNI the multiply and the add are
      // one `vpdpwssd`); the AVX2 loop below takes the last pairs.
      __m512 wide[4];
      for (int j = 0; j < 4; ++j) wide[j] = _mm512_setzero_ps();
      for (; p + 8 <= pairs; p += 8) {
        __m512 scales16[4];
        for (int j = 0; j < 4; ++j) {
          scales16[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_loadu_si512(sz + j * 2 * G + 4 * p), 16));
        }
        for (int64_t q = 0; q < 8; q += 2) {
          const int a = static_cast<int>(2 * q);  // lanes 4i..4i+3 hold chunk 2(p + q) + i's products
          const __m512i spread = _mm512_setr_epi32(a, a, a, a, a + 1, a + 1, a + 1, a + 1, a + 2, a + 2, a + 2,
                                                   a + 2, a + 3, a + 3, a + 3, a + 3);
          __m512i x[4];
          for (int k = 0; k < 4; ++k) {
            const int16_t* first = r.x16.data() + 64 * (p + q) + 16 * k;
            x[k] = _mm512_inserti64x4(_mm512_castsi256_si512(load256(first)), load256(first + 64), 1);
          }
          for (int j = 0; j < 4; ++j) {
            const uint8_t* bytes = w + j * row_bytes + 32 * (p + q);
            prefetch_ahead(bytes);
            const __m512i v = _mm512_loadu_si512(bytes), low4 = _mm512_set1_epi16(0x0F);
            const __m512i n0 = _mm512_and_si512(v, low4), n1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            const __m512i n2 = _mm512_and_si512(_mm512_srli_epi16(v, 8), low4), n3 = _mm512_srli_epi16(v, 12);
#if defined(__AVX512VNNI__)
            __m512i dots = _mm512_dpwssd_epi32(_mm512_madd_epi16(n0, x[0]), n1, x[1]);
            dots = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(dots, n2, x[2]), n3, x[3]);
#else
            const __m512i low = _mm512_add_epi32(_mm512_madd_epi16(n0, x[0]), _mm512_madd_epi16(n1, x[1]));
            const __m512i dots = _mm512_add_epi32(low, _mm512_add_epi32(_mm512_madd_epi16(n2, x[2]),
                                                                        _mm512_madd_epi16(n3, x[3])));
#endif
            wide[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_permutexvar_ps(spread, scales16[j]), wide[j]);
          }
        }
      }
      for (int j = 0; j < 4; ++j) lone[j] = _mm512_reduce_add_ps(wide[j]);
#endif
      for (; p < pairs; p += 4) {
        const int64_t count = std::min<int64_t>(4, pairs - p);
        __m256 scales8[4];
        for (int j = 0; j < 4; ++j) {
          const uint16_t* first = sz + j * 2 * G + 4 * p;
          if (count == 4) {
            scales8[j] = _mm256_castsi256_ps(_mm256_slli_epi32(load256(first), 16));
          } else {  // (the last pairs: no read past the row's pairs)
            alignas(32) float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t g = 0; g < 2 * count; ++g) s[g] = bf16_bits_to_float(first[2 * g]);
            scales8[j] = _mm256_load_ps(s);
          }
        }
        for (int64_t q = 0; q < count; ++q) {
          const int a = static_cast<int>(2 * q), b = a + 1;
          const __m256i spread = _mm256_setr_epi32(a, a, a, a, b, b, b, b);
          __m256i x[4];
          pair_x(r.x16.data(), p + q, x);
          for (int j = 0; j < 4; ++j) {
            const uint8_t* bytes = w + j * row_bytes + 32 * (p + q);
            prefetch_ahead(bytes);
            const __m256i dots = pair_dots(x, load256(bytes));
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_permutevar8x32_ps(scales8[j], spread), acc[j]);
          }
        }
      }
      if (chunks % 2 == 1) {
        for (int j = 0; j < 4; ++j) {
          const int64_t c = chunks - 1;
          lone[j] += bf16_bits_to_float(sz[j * 2 * G + 2 * c]) *
                     static_cast<float>(chunk_dot(r.x16.data() + 64 * (c / 2), w + j * row_bytes + 16 * c));
        }
      }
    } else if (r.exact) {  // whole pairs a group
      for (int64_t g = 0; g < G; ++g) {
        __m256i dots[4];
        for (int j = 0; j < 4; ++j) dots[j] = _mm256_setzero_si256();
        for (int64_t p = g * per_group / 2; p < (g + 1) * per_group / 2; ++p) {
          __m256i x[4];
          pair_x(r.x16.data(), p, x);
          for (int j = 0; j < 4; ++j) {
            const uint8_t* bytes = w + j * row_bytes + 32 * p;
            prefetch_ahead(bytes);
            dots[j] = _mm256_add_epi32(dots[j], pair_dots(x, load256(bytes)));
          }
        }
        for (int j = 0; j < 4; ++j) {
          const __m256 scale = _mm256_set1_ps(bf16_bits_to_float(sz[j * 2 * G + 2 * g]));
          acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[j]), scale, acc[j]);
        }
      }
    } else {  // float rows, a chunk at a time
      for (int64_t g = 0; g < G; ++g) {
        __m256 part[4];
        for (int j = 0; j < 4; ++j) part[j] = _mm256_setzero_ps();
        for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
          const float* x = r.x.data() + 64 * (c / 2) + 8 * (c % 2);
          for (int j = 0; j < 4; ++j) {
            const uint8_t* bytes = w + j * row_bytes + 16 * c;
            prefetch_ahead(bytes);
            part[j] = _mm256_add_ps(part[j], chunk_dot(x, bytes));
          }
        }
        for (int j = 0; j < 4; ++j) {
          acc[j] = _mm256_fmadd_ps(part[j], _mm256_set1_ps(bf16_bits_to_float(sz[j * 2 * G + 2 * g])), acc[j]);
        }
      }
    }
    for (int j = 0; j < 4; ++j) {
      const float total = (hsum8(acc[j]) + lone[j]) + zero_terms(sz + j * 2 * G, r.sums.data(), G);
      d[j] = static_cast<float>(total * r.step);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < rows; ++j) {
    const uint8_t* row = w + j * row_bytes;
    float total = 0;
    for (int64_t g = 0; g < G; ++g) {
      float dg = 0;
      for (int64_t e = g * group; e < (g + 1) * group; ++e) {
        const float q = static_cast<float>((row[e / 2] >> (4 * (e % 2))) & 15);
        const int64_t at = int4_position(e);
        dg += (r.exact ? static_cast<float>(r.x16[at]) : r.x[at]) * q;
      }
      total += bf16_bits_to_float(sz[j * 2 * G + 2 * g]) * dg;
    }
    total += zero_terms(sz + j * 2 * G, r.sums.data(), G);
    d[j] = static_cast<float>(total * r.step);
  }
}

// y [N, out] = x [N, in] W^T (+ bias) for int4 weights in plain layout, x float32 or bf16 (y in its dtype),
// summed in float32: each weight row streamed once for every INT4_ROWS rows of x (split across the threads,
// four rows together). bf16 rows are dotted in integers (`int16_row`: exact within 8 binades of the row's
// largest entry), float32 rows (and bf16 ones with an inf or NaN) in float.
constexpr int64_t INT4_ROWS = 8;

torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales_and_zeros,
                          int64_t group, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int4_linear: x float32 or bf16 [N, in]");
  TORCH_CHECK(group > 0 && group % INT4_CHUNK == 0, "int4_linear: group a multiple of 32");
  const int64_t N = x.size(0), K = x.size(1), O = packed.size(0), P = 2 * packed.size(1), G = P / group;
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() && P % group == 0
              && P >= K && P - K < group, "int4_linear: packed uint8 [out, in padded to whole groups / 2]");
  TORCH_CHECK(scales_and_zeros.scalar_type() == at::kBFloat16 && scales_and_zeros.is_contiguous()
              && scales_and_zeros.dim() == 3 && scales_and_zeros.size(0) == O && scales_and_zeros.size(1) == G
              && scales_and_zeros.size(2) == 2, "int4_linear: scales_and_zeros bf16 [out, groups, 2]");
  const torch::Tensor x32 = x.to(at::kFloat).contiguous(), b32 = float_operand(bias, O, "int4_linear: bias");
  torch::Tensor y = torch::empty({N, O}, x32.options());
  const float* xp = x32.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const uint16_t* szp = reinterpret_cast<const uint16_t*>(scales_and_zeros.data_ptr<c10::BFloat16>());
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  for (int64_t first = 0; first < N; first += INT4_ROWS) {
    const int64_t n_rows = std::min(INT4_ROWS, N - first);
    std::vector<Int4Row> rows;
    for (int64_t n = 0; n < n_rows; ++n) rows.push_back(int4_row(xp + (first + n) * K, K, P, group, bf16));
    stream_blocks(n_rows, O, wp, P / 2, true, nullptr, data_or_null(b32), y.data_ptr<float>() + first * O,
                  [&](int64_t n, int64_t o, int64_t count, float* d) {
                    int4_dot_rows(rows[n], wp + o * (P / 2), P / 2, szp + o * 2 * G, G, group, count, d);
                  });
  }
  return y.to(x.scalar_type());
}

// bf16 weights at decode row counts (`accel.runner.FastRunner` decoding a bf16 model): y [N, out] =
// (residual + x w^T) + bias, w bf16 [out, in] rows (each contiguous, e.g. a column slice of a parameter's
// rows), x, residual and bias bf16 or float32, summed in float32 and rounded once to x's dtype. ATen's bf16
// product on CPUs without native bf16 reads ~0.6 of the memory bandwidth at one row; this reads every
// weight row once, widened in registers.
torch::Tensor bf16_linear(const torch::Tensor& x, const torch::Tensor& w, const c10::optional<torch::Tensor>& bias,
                          const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "bf16_linear: x float32 or bf16 [N, in]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) == x.size(1) && w.stride(1) == 1
              && (w.size(0) == 1 || w.stride(0) >= w.size(1)), "bf16_linear: w bf16 [out, in] with contiguous rows");
  const int64_t N = x.size(0), K = x.size(1), O = w.size(0);
  const torch::Tensor x32 = x.to(at::kFloat).contiguous(), b32 = float_operand(bias, O, "bf16_linear: bias"),
                      r32 = float_operand(residual, N * O, "bf16_linear: residual");
  torch::Tensor y = torch::empty({N, O}, x32.options());
  stream_rows(x32.data_ptr<float>(), w.data_ptr<c10::BFloat16>(), N, K, O, w.stride(0), nullptr, data_or_null(r32),
              data_or_null(b32), y.data_ptr<float>());
  return y.to(x.scalar_type());
}

// Both encodes of a decode call: (rows_k, rows_v, whether every stored norm is finite).
std::tuple<torch::Tensor, torch::Tensor, bool> encode_pair(const torch::Tensor& k, const Codec& ck,
                                                          const torch::Tensor& v, const Codec& cv) {
  auto [rows_k, finite_k] = encode(k, ck.tables, ck.ints, ck.steps);
  auto [rows_v, finite_v] = encode(v, cv.tables, cv.ints, cv.steps);
  return {rows_k, rows_v, finite_k && finite_v};
}

// `attend`'s read over the first S columns of rows_k, rows_v [B, Hkv, >= S, bytes] (bytes contiguous)
// into out [B, H, 1, Dv] (contiguous float32), with no ATen call.
void attend_columns(const QueryIn& q, const Codec& ck, const Codec& cv, const torch::Tensor& rows_k,
                    const torch::Tensor& rows_v, int64_t S, const MaskIn& mask, float* out) {
  TORCH_CHECK(rows_k.dim() == 4 && rows_v.dim() == 4 && q.H % rows_k.size(1) == 0, "attend: q [B, H, 1, D], "
              "rows [B, Hkv, S, bytes], H a multiple of Hkv");
  const int64_t B = q.B, Hkv = rows_k.size(1), D = q.D;
  TORCH_CHECK(rows_k.size(0) == B && rows_v.size(0) == B && rows_v.size(1) == Hkv && rows_k.size(2) >= S
              && rows_v.size(2) >= S, "attend: shapes disagree");
  const Side k = side(rows_k, ck.layout, ck.values, ck.norm_byte, ck.groups, ck.residual_step);
  const Side v = side(rows_v, cv.layout, cv.values, cv.norm_byte, cv.groups, cv.residual_step);
  const int64_t Dv = cv.back.size(-1);
  const PerHead query = per_head(ck.query, B, Hkv, D, k.E, "query");
  const PerHead back = per_head(cv.back, B, Hkv, v.E, Dv, "back");
  const PerHeadIndex q_perm = per_head_index(ck.perm, B, Hkv, D, "key perm");
  const PerHeadIndex out_perm = per_head_index(cv.unperm, B, Hkv, Dv, "value unperm");
  read_codes(q, k, v, query, back, q_perm, out_perm, Hkv, S, Dv, mask,
             static_cast<float>(1.0 / std::sqrt(static_cast<double>(D))), out);
}

// `codes_attention` of q [B, H, 1, D] as `turbo_score` / `turbo_combine` compute it (q @ query, the
// entries, the softmax, the value entries' sum @ back), one C++ pass: [B, H, 1, Dv] in q's dtype.
// (Over the first S columns of the rows: all of them unless given.)
torch::Tensor attend(const torch::Tensor& q, const Codec& ck, const Codec& cv, torch::Tensor rows_k,
                     torch::Tensor rows_v, c10::optional<torch::Tensor> attn_mask, int64_t S = -1) {
  TORCH_CHECK(q.dim() == 4 && q.size(2) == 1 && rows_k.dim() == 4 && rows_v.dim() == 4,
              "attend: q [B, H, 1, D], rows [B, Hkv, S, bytes]");
  if (S < 0) {
    S = rows_k.size(2);
    TORCH_CHECK(rows_v.size(2) == S, "attend: shapes disagree");
  }
  if (rows_k.stride(3) != 1) rows_k = rows_k.contiguous();
  if (rows_v.stride(3) != 1) rows_v = rows_v.contiguous();
  torch::Tensor mask = torch::empty({0});
  if (attn_mask.has_value()) {
    mask = *attn_mask;
    if (mask.dtype() != torch::kBool && mask.dtype() != torch::kFloat32) mask = mask.to(at::kFloat);
  }
  const torch::Tensor qf = q.scalar_type() == at::kFloat ? q : q.to(at::kFloat);
  const int64_t B = q.size(0), H = q.size(1), Dv = cv.back.size(-1);
  torch::Tensor out = torch::empty({B, H, 1, Dv}, qf.options().memory_format(at::MemoryFormat::Contiguous));
  attend_columns(query_in(qf), ck, cv, rows_k, rows_v, S, mask_in(mask, B, H, S), out.data_ptr<float>());
  return out.scalar_type() == q.scalar_type() ? out : out.to(q.scalar_type());
}

// The byte offset of row (b, h, t) of x [B, Hkv, T, ...] at column start + t of a store [B, Hkv, capacity, bytes].
std::vector<int64_t> column_offsets(const torch::Tensor& store, int64_t B, int64_t Hkv, int64_t T, int64_t start) {
  std::vector<int64_t> at(B * Hkv * T);
  for (int64_t n = 0; n < B * Hkv * T; ++n) {
    at[n] = (n / (Hkv * T)) * store.stride(0) + ((n / T) % Hkv) * store.stride(1) + (start + n % T) * store.stride(2);
  }
  return at;
}

void check_columns(const torch::Tensor& store_k, const torch::Tensor& store_v, int64_t B, int64_t Hkv, int64_t end,
                   const Codec& ck, const Codec& cv) {
  TORCH_CHECK(store_k.dim() == 4 && store_v.dim() == 4 && store_k.dtype() == torch::kUInt8
              && store_v.dtype() == torch::kUInt8 && store_k.stride(3) == 1 && store_v.stride(3) == 1,
              "decode_attend: uint8 stores [B, Hkv, capacity, bytes], bytes contiguous");
  TORCH_CHECK(store_k.size(0) == B && store_k.size(1) == Hkv && store_v.size(0) == B && store_v.size(1) == Hkv,
              "decode_attend: stores [B, Hkv, capacity, bytes] of k's and v's rows");
  TORCH_CHECK(end <= store_k.size(2) && end <= store_v.size(2), "decode_attend: columns up to ", end,
              " beyond the storage");
  TORCH_CHECK(store_k.size(3) == ck.ints[ck.ints[0] + 2] && store_v.size(3) == cv.ints[cv.ints[0] + 2],
              "decode_attend: the stores' row bytes are the codecs'");
}

// The plain encodes of k, v [B, Hkv, T, D] (rows) into a storage's columns [start, start + T): whether
// every stored norm is finite.
bool encode_columns(const RowsIn& k, const RowsIn& v, int64_t B, const Codec& ck, const Codec& cv,
                    const torch::Tensor& store_k, const torch::Tensor& store_v, int64_t start) {
  const int64_t Hkv = k.H, T = k.T;
  const bool finite_k = encode_plain(k, B * Hkv * T, ck, store_k.data_ptr<uint8_t>(),
                                     column_offsets(store_k, B, Hkv, T, start).data());
  const bool finite_v = encode_plain(v, B * Hkv * T, cv, store_v.data_ptr<uint8_t>(),
                                     column_offsets(store_v, B, Hkv, T, start).data());
  return finite_k && finite_v;
}

// A decode call in one pass: k, v [B, Hkv, T, D] encoded straight into a storage's rows [B, Hkv,
// capacity, bytes] at columns [start, start + T) (the bytes `encode` returns), then `attend` over
// columns [0, start + T): (out [B, H, 1, Dv], whether every stored norm is finite).
// plain: the encodes' products and norms by plain loops (see `rows_times`; the C++ decode's).
std::tuple<torch::Tensor, bool> decode_attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                              const Codec& ck, const Codec& cv, const torch::Tensor& store_k,
                                              const torch::Tensor& store_v, int64_t start,
                                              c10::optional<torch::Tensor> attn_mask, bool plain = false) {
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && v.sizes() == k.sizes(), "decode_attend: k, v [B, Hkv, T, D]");
  const int64_t B = k.size(0), Hkv = k.size(1), T = k.size(2), end = start + T;
  TORCH_CHECK(start >= 0, "decode_attend: a negative start column");
  check_columns(store_k, store_v, B, Hkv, end, ck, cv);
  bool finite = true;
  if (plain) {
    finite = encode_columns(rows_in(k), rows_in(v), B, ck, cv, store_k, store_v, start);
  } else {
    finite = encode_at(k, ck.tables, ck.ints, ck.steps, store_k.data_ptr<uint8_t>(),
                       column_offsets(store_k, B, Hkv, T, start).data());
    finite = encode_at(v, cv.tables, cv.ints, cv.steps, store_v.data_ptr<uint8_t>(),
                       column_offsets(store_v, B, Hkv, T, start).data()) && finite;
  }
  torch::Tensor out = attend(q, ck, cv, store_k, store_v, attn_mask, end);
  return {out, finite};
}

// The same for the C++ decode, from raw rows (q [B, H, 1, D], one new column of k, v [B, Hkv, 1, D]) into
// out [B, H, 1, Dv] (contiguous float32), with plain encodes and no ATen call: whether the norms are finite.
bool decode_attend_rows(const QueryIn& q, const RowsIn& k, const RowsIn& v, const Codec& ck, const Codec& cv,
                        const torch::Tensor& store_k, const torch::Tensor& store_v, int64_t start, const MaskIn& mask,
                        float* out) {
  const int64_t B = q.B, Hkv = k.H;
  TORCH_CHECK(start >= 0 && k.T == 1 && v.T == 1 && v.H == Hkv, "decode_attend: one new column of k and v");
  check_columns(store_k, store_v, B, Hkv, start + 1, ck, cv);
  const bool finite = encode_columns(k, v, B, ck, cv, store_k, store_v, start);
  attend_columns(q, ck, cv, store_k, store_v, start + 1, mask, out);
  return finite;
}

"""


def codec_binding(module_local: bool = False) -> str:
    """The C++ statement binding `Codec` in a PYBIND11_MODULE (`m`): module-local in an extension that
    embeds KERNEL_SOURCE beside this one (`accel.decode_cpp`), as pybind11 binds a C++ type once per
    process otherwise."""
    scope = ", pybind11::module_local()" if module_local else ""
    return ('\n  pybind11::class_<Codec>(m, "Codec"' + scope + r""")
      .def(pybind11::init([](std::vector<torch::Tensor> tables, std::vector<int64_t> ints, std::vector<double> steps,
                             torch::Tensor layout, torch::Tensor values, torch::Tensor residual_step,
                             torch::Tensor query, torch::Tensor back, int64_t norm_byte, int64_t groups,
                             torch::Tensor perm, torch::Tensor unperm, torch::Tensor rotate) {
        return Codec{tables, ints, steps, layout, values, residual_step, query, back, norm_byte, groups, perm, unperm,
                     rotate};
      }));
""")


# RMSNorm for training (`accel.norm`): the forward after its statistic, and the backward, one pass a row
# where the composite takes five to twelve. Not in KERNEL_SOURCE: the decode extension does not need them.
NORM_SOURCE = r"""
// float -> bf16 -> float, rounding to nearest even as c10::BFloat16 does (NaN stays NaN); branch-free so
// that the loops below vectorize.
inline float through_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  bits = (bits & 0x7FFFFFFFu) > 0x7F800000u ? bits : rounded;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The value a product rounded to x's dtype T holds: itself for float32, through bf16 for bf16.
template <typename T>
inline float in_dtype(float v) { return std::is_same<T, float>::value ? v : through_bf16(v); }

void check_norm_operands(const torch::Tensor& x, const torch::Tensor& rstd, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "rms_norm: x contiguous float32 or bf16 [N, h]");
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.is_contiguous() && rstd.numel() == x.size(0),
              "rms_norm: rstd float32 [N]");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 1 && w.numel() == x.size(1),
              "rms_norm: weight float32 [h]");
}

template <typename T>
void scale_rows(const T* x, const float* r, const float* w, int64_t N, int64_t h, float* y) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const T* xr = x + n * h;
      float* yr = y + n * h;
      const float rn = r[n];
      for (int64_t j = 0; j < h; ++j) yr[j] = in_dtype<T>(static_cast<float>(xr[j]) * rn) * w[j];
    }
  });
}

// y [N, h] float32 = R(x * rstd) * w, R rounding to bf16 for bf16 x (the plain module's cast) and nothing for
// float32: the composite's two products, each rounded once, so its values bit for bit.
torch::Tensor rms_norm_scale(const torch::Tensor& x, const torch::Tensor& rstd, const torch::Tensor& w) {
  check_norm_operands(x, rstd, w);
  const int64_t N = x.size(0), h = x.size(1);
  torch::Tensor y = torch::empty({N, h}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kBFloat16) {
    scale_rows(x.data_ptr<at::BFloat16>(), rstd.data_ptr<float>(), w.data_ptr<float>(), N, h, y.data_ptr<float>());
  } else {
    scale_rows(x.data_ptr<float>(), rstd.data_ptr<float>(), w.data_ptr<float>(), N, h, y.data_ptr<float>());
  }
  return y;
}

// Rows of a norm's backward per weight-gradient partial sum: fixed, so results do not depend on the threads.
constexpr int64_t NORM_CHUNK = 64;

template <typename T>
void norm_backward_rows(const float* g, const T* x, const float* r, const float* w, int64_t N, int64_t h,
                        float* partial, T* gx) {
  const int64_t chunks = (N + NORM_CHUNK - 1) / NORM_CHUNK;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> normed(h), gn(h);
    for (int64_t c = begin; c < end; ++c) {
      float* pc = partial ? partial + c * h : nullptr;
      for (int64_t n = c * NORM_CHUNK; n < std::min(N, (c + 1) * NORM_CHUNK); ++n) {
        const float* gr = g + n * h;
        const T* xr = x + n * h;
        const float rn = r[n];
        for (int64_t j = 0; j < h; ++j) {
          normed[j] = static_cast<float>(xr[j]) * rn;
          gn[j] = in_dtype<T>(gr[j] * w[j]);
        }
        if (pc) {
          for (int64_t j = 0; j < h; ++j) pc[j] += gr[j] * in_dtype<T>(normed[j]);
        }
        float dot = 0.0f;
        for (int64_t j = 0; j < h; ++j) dot += gn[j] * normed[j];
        const float mean_dot = dot / static_cast<float>(h);
        T* out = gx + n * h;
        for (int64_t j = 0; j < h; ++j) out[j] = static_cast<T>((gn[j] - normed[j] * mean_dot) * rn);
      }
    }
  });
}

// The backward of `rms_norm_scale` (x̂ = x rstd): dw = sum over rows of g R(x̂); with gn = R(g w) (the bf16
// rounding of the product's gradient where x is bf16, as autograd's cast), dx = rstd (gn - x̂ mean(gn x̂)),
// in x's dtype. dw's partial sums run over fixed chunks of rows, then add up in order.
std::vector<torch::Tensor> rms_norm_backward(const torch::Tensor& grad, const torch::Tensor& x,
                                             const torch::Tensor& rstd, const torch::Tensor& w, bool weight_grad) {
  check_norm_operands(x, rstd, w);
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.is_contiguous() && grad.sizes() == x.sizes(),
              "rms_norm_backward: grad float32 like x");
  const int64_t N = x.size(0), h = x.size(1), chunks = (N + NORM_CHUNK - 1) / NORM_CHUNK;
  torch::Tensor gx = torch::empty_like(x);
  torch::Tensor partial = torch::zeros({weight_grad ? chunks : 0, h}, x.options().dtype(at::kFloat));
  float* pp = weight_grad ? partial.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kBFloat16) {
    norm_backward_rows(grad.data_ptr<float>(), x.data_ptr<at::BFloat16>(), rstd.data_ptr<float>(), w.data_ptr<float>(),
                       N, h, pp, gx.data_ptr<at::BFloat16>());
  } else {
    norm_backward_rows(grad.data_ptr<float>(), x.data_ptr<float>(), rstd.data_ptr<float>(), w.data_ptr<float>(), N, h,
                       pp, gx.data_ptr<float>());
  }
  return {gx, weight_grad ? partial.sum(0) : torch::Tensor()};
}
"""


# nf4 weights at decode row counts (`weight_quant.Nf4WeightLinear`). Not in KERNEL_SOURCE: the decode extension
# does not need it.
NF4_SOURCE = r"""
// nf4 weights (`weight_quant.Nf4WeightLinear`): w[o, e] = L[q[o, e]] a[o, e / block], q in 0..15 two a byte in
// plain order (as int4: column 2i in byte i's low nibble), L the 16 NormalFloat levels (float32, passed in), a
// the block's absmax: bf16 [out, blocks], or double-quantized, uint8 codes [out, blocks] times a float32 step
// per `dq_block` codes of the flattened codes (a = code * step). Each block's 16 levels times its absmax (each
// product the float32 weight the reference dequantizes, bit for bit) are its lookup table: one `vpermps` looks
// up 16 weights on AVX-512, two and a blend 8 on AVX2. x is reordered once per call to match the unpack: each
// chunk of 32 columns (16 bytes) as its 16 even columns (the low nibbles) then its 16 odd ones.
constexpr int64_t NF4_CHUNK = 32;  // (every block size is a multiple)

inline int64_t nf4_position(int64_t e) {
  return e / NF4_CHUNK * NF4_CHUNK + (e % 2) * 16 + (e % NF4_CHUNK) / 2;
}

// The absmax of block b of weight row o, whichever way it is stored.
struct Nf4Scales {
  const uint16_t* bf16;  // bf16 bits [out, blocks], or null and then
  const uint8_t* codes;  // codes [out, blocks] times
  const float* steps;    // steps [ceil(out * blocks / dq_block)]
  int64_t blocks, dq_block;
  float at(int64_t o, int64_t b) const {
    const int64_t i = o * blocks + b;
    return bf16 != nullptr ? bf16_bits_to_float(bf16[i]) : static_cast<float>(codes[i]) * steps[i / dq_block];
  }
};

// d[j] = x . w[o + j] for `rows` (<= 4) nf4 weight rows (row j's bytes at w + j * row_bytes), x reordered
// (`nf4_position`, P columns), summed in float32.
inline void nf4_dot_rows(const float* x, const uint8_t* w, int64_t row_bytes, const Nf4Scales& s, int64_t o,
                         const float* levels, int64_t P, int64_t block, int64_t rows, float* d) {
  const int64_t G = P / block, per_block = block / NF4_CHUNK;
#if defined(__AVX512F__)
  if (rows == 4) {
    const __m512 lv = _mm512_loadu_ps(levels);
    __m512 even[4], odd[4];  // (two sums a row: eight independent chains)
    for (int j = 0; j < 4; ++j) even[j] = odd[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      __m512 table[4];
      for (int j = 0; j < 4; ++j) table[j] = _mm512_mul_ps(lv, _mm512_set1_ps(s.at(o + j, g)));
      for (int64_t c = g * per_block; c < (g + 1) * per_block; ++c) {
        const __m512 xe = _mm512_loadu_ps(x + NF4_CHUNK * c), xo = _mm512_loadu_ps(x + NF4_CHUNK * c + 16);
        for (int j = 0; j < 4; ++j) {
          const uint8_t* bytes = w + j * row_bytes + 16 * c;
          prefetch_ahead(bytes);
          // each byte in its own 32-bit lane: `vpermps` reads the low 4 bits (the even column's code); shifted
          // by 4, the odd one's
          const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
          even[j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(v, table[j]), xe, even[j]);
          odd[j] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table[j]), xo, odd[j]);
        }
      }
    }
    for (int j = 0; j < 4; ++j) d[j] = _mm512_reduce_add_ps(_mm512_add_ps(even[j], odd[j]));
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (rows == 4) {
    const __m256 low8 = _mm256_loadu_ps(levels), high8 = _mm256_loadu_ps(levels + 8);
    __m256 even[4], odd[4];
    for (int j = 0; j < 4; ++j) even[j] = odd[j] = _mm256_setzero_ps();
    // levels 0-7 from `low`, 8-15 from `high`: bit 3 of the lane moved to the sign bit picks
    const auto lookup = [](__m256i index, __m256 low, __m256 high) {
      return _mm256_blendv_ps(_mm256_permutevar8x32_ps(low, index), _mm256_permutevar8x32_ps(high, index),
                              _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));
    };
    for (int64_t g = 0; g < G; ++g) {
      __m256 low[4], high[4];
      for (int j = 0; j < 4; ++j) {
        const __m256 a = _mm256_set1_ps(s.at(o + j, g));
        low[j] = _mm256_mul_ps(low8, a), high[j] = _mm256_mul_ps(high8, a);
      }
      for (int64_t c = g * per_block; c < (g + 1) * per_block; ++c) {
        for (int64_t h = 0; h < 2; ++h) {  // eight bytes (16 columns) at a time
          const __m256 xe = _mm256_loadu_ps(x + NF4_CHUNK * c + 8 * h);
          const __m256 xo = _mm256_loadu_ps(x + NF4_CHUNK * c + 16 + 8 * h);
          for (int j = 0; j < 4; ++j) {
            const uint8_t* bytes = w + j * row_bytes + 16 * c + 8 * h;
            if (h == 0) prefetch_ahead(bytes);
            const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
            even[j] = _mm256_fmadd_ps(lookup(v, low[j], high[j]), xe, even[j]);
            odd[j] = _mm256_fmadd_ps(lookup(_mm256_srli_epi32(v, 4), low[j], high[j]), xo, odd[j]);
          }
        }
      }
    }
    for (int j = 0; j < 4; ++j) d[j] = hsum8(_mm256_add_ps(even[j], odd[j]));
    return;
  }
#endif
  for (int64_t j = 0; j < rows; ++j) {
    const uint8_t* row = w + j * row_bytes;
    float total = 0;
    for (int64_t g = 0; g < G; ++g) {
      const float a = s.at(o + j, g);
      for (int64_t e = g * block; e < (g + 1) * block; ++e) {
        total += x[nf4_position(e)] * (levels[(row[e / 2] >> (4 * (e % 2))) & 15] * a);
      }
    }
    d[j] = total;
  }
}

// y [N, out] = x [N, in] W^T (+ bias) for nf4 weights, x float32 or bf16 (y in its dtype), summed in float32
// against the reference's float32 weights: each weight row streamed once for every row of x (split across the
// threads, four rows together, `stream_blocks`). absmax bf16 [out, blocks], or uint8 codes with `steps`.
torch::Tensor nf4_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& absmax,
                         const c10::optional<torch::Tensor>& steps, int64_t dq_block, const torch::Tensor& levels,
                         int64_t block, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "nf4_linear: x float32 or bf16 [N, in]");
  TORCH_CHECK(block > 0 && block % NF4_CHUNK == 0, "nf4_linear: block a multiple of 32");
  const int64_t N = x.size(0), K = x.size(1), O = packed.size(0), P = 2 * packed.size(1), G = P / block;
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous() && P % block == 0
              && P >= K && P - K < block, "nf4_linear: packed uint8 [out, in padded to whole blocks / 2]");
  TORCH_CHECK(absmax.dim() == 2 && absmax.size(0) == O && absmax.size(1) == G && absmax.is_contiguous(),
              "nf4_linear: absmax [out, blocks]");
  TORCH_CHECK(levels.scalar_type() == at::kFloat && levels.is_contiguous() && levels.numel() == 16,
              "nf4_linear: levels float32 [16]");
  const bool dq = steps.has_value() && steps->defined();
  Nf4Scales s{nullptr, nullptr, nullptr, G, dq_block};
  if (dq) {
    TORCH_CHECK(absmax.scalar_type() == at::kByte && dq_block > 0 && steps->scalar_type() == at::kFloat
                && steps->is_contiguous() && steps->numel() == (O * G + dq_block - 1) / dq_block,
                "nf4_linear: double-quantized absmax: uint8 codes and float32 steps, one per dq_block codes");
    s.codes = absmax.data_ptr<uint8_t>(), s.steps = steps->data_ptr<float>();
  } else {
    TORCH_CHECK(absmax.scalar_type() == at::kBFloat16, "nf4_linear: absmax bf16 (or uint8 codes with steps)");
    s.bf16 = reinterpret_cast<const uint16_t*>(absmax.data_ptr<c10::BFloat16>());
  }
  const torch::Tensor x32 = x.to(at::kFloat).contiguous(), b32 = float_operand(bias, O, "nf4_linear: bias");
  const float* xp = x32.data_ptr<float>();
  std::vector<float> reordered(N * P, 0.0f);  // (zeros past K: the padding's codes are the 0 level)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t e = 0; e < K; ++e) reordered[n * P + nf4_position(e)] = xp[n * K + e];
  }
  torch::Tensor y = torch::empty({N, O}, x32.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* lp = levels.data_ptr<float>();
  stream_blocks(N, O, wp, P / 2, true, nullptr, data_or_null(b32), y.data_ptr<float>(),
                [&](int64_t n, int64_t o, int64_t rows, float* d) {
                  nf4_dot_rows(reordered.data() + n * P, wp + o * (P / 2), P / 2, s, o, lp, P, block, rows, d);
                });
  return y.to(x.scalar_type());
}
"""


CPP_SOURCE = KERNEL_SOURCE + NORM_SOURCE + NF4_SOURCE + r"""
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {""" + codec_binding() + r"""
  m.def("rms_norm_scale", &rms_norm_scale);
  m.def("rms_norm_backward", &rms_norm_backward);
  m.def("encode", &encode);
  m.def("int8_linear", &int8_linear);
  m.def("int4_linear", &int4_linear);
  m.def("nf4_linear", &nf4_linear);
  m.def("bf16_linear", &bf16_linear);
  m.def("encode_pair", &encode_pair);
  m.def("attend", [](const torch::Tensor& q, const Codec& ck, const Codec& cv, torch::Tensor rows_k,
                      torch::Tensor rows_v, c10::optional<torch::Tensor> attn_mask) {
    return attend(q, ck, cv, rows_k, rows_v, attn_mask);
  });
  m.def("decode_attend", [](const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const Codec& ck,
                            const Codec& cv, const torch::Tensor& store_k, const torch::Tensor& store_v, int64_t start,
                            c10::optional<torch::Tensor> attn_mask, bool plain) {
    return decode_attend(q, k, v, ck, cv, store_k, store_v, start, attn_mask, plain);
  }, pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("v"), pybind11::arg("ck"), pybind11::arg("cv"),
     pybind11::arg("store_k"), pybind11::arg("store_v"), pybind11::arg("start"), pybind11::arg("attn_mask"),
     pybind11::arg("plain") = false);
}
"""

_lock = threading.Lock()
_module: Any = None
_failure: str | None = None
_cache: KernelCache | None = None


def cpp_enabled() -> bool:
    """False when the environment says `RDEPTH_NO_CPP` (any value but "", "0")."""
    return os.environ.get(NO_CPP_ENV, "") in ("", "0")


def cpu_fingerprint() -> str:
    """The machine's architecture and CPU feature flags: the build uses -march=native, so a binary
    cached on a shared home directory must not be loaded by a CPU with other features (SIGILL)."""
    flags = ""
    try:
        with open("/proc/cpuinfo", "rb") as handle:  # bounded: the first flags line is near the top
            for line in handle.read(1 << 16).decode("ascii", "replace").splitlines():
                if line.startswith(("flags", "Features")):
                    flags = line
                    break
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()} {flags}"


def build_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "recurrent_depth" / "torch_extensions"


def build_key(source: str = CPP_SOURCE) -> str:
    """What a build depends on, hashed: the source and flags, torch (version, build, C++ ABI), the
    Python ABI and the CPU's features; no path of the Python environment, so every virtualenv with
    the same torch and Python shares one build."""
    parts = (source, " ".join(BUILD_FLAGS + LINK_FLAGS), torch.__version__, str(torch.version.git_version),
             str(torch.compiled_with_cxx11_abi()), str(sysconfig.get_config_var("SOABI")), cpu_fingerprint())
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def kernel_cache(prefix: str = "rdepth_quant", source: str = CPP_SOURCE,
                 what: str = "C++ quantized-KV kernels") -> KernelCache:
    """The build cache of one extension: `source` built as `<prefix>_<build_key(source)>`."""
    name = f"{prefix}_{build_key(source)}"
    return KernelCache(build_dir() / name, name, functools.partial(compile_extension, source=source), what=what)


def compile_extension(name: str, scratch: Path, source: str = CPP_SOURCE) -> tuple[Any, Path]:
    """Build the extension in `scratch` (torch's ninja files name this environment's paths, so they
    stay out of the shared cache); (the imported module, its library)."""
    from torch.utils.cpp_extension import load_inline

    with torch_build_notes_at_debug():
        module = load_inline(name, cpp_sources=[source], extra_cflags=list(BUILD_FLAGS),
                             extra_ldflags=list(LINK_FLAGS), build_directory=str(scratch), verbose=False)
    return module, scratch / f"{name}.so"


TORCH_BUILD_LOGGER = "torch.utils.cpp_extension"


@contextlib.contextmanager
def torch_build_notes_at_debug() -> Iterator[None]:
    """torch's own notes while it builds an extension (its compiler check's "!! WARNING !! Your compiler (...) is
    not compatible with the compiler Pytorch was built with ...", a record of its logger in torch 2.x, a
    `warnings` warning before) on this module's log at DEBUG: a build that fails is one line (`failure_line`, in
    the caller's note), not that paragraph first; one that works needs no notes. Other warnings pass on."""

    def to_debug(record: logging.LogRecord) -> bool:
        log.debug("torch's extension build: %s", record.getMessage())
        return False  # (not emitted by torch's handlers)

    torch_log = logging.getLogger(TORCH_BUILD_LOGGER)
    torch_log.addFilter(to_debug)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        torch_log.removeFilter(to_debug)
        for warning in caught:
            if "cpp_extension" in warning.filename:
                log.debug("torch's extension build: %s", warning.message)
            else:  # (another thread's, or the compiler's import of something: not ours to hide)
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


def import_extension(name: str, library: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"{library} is not a Python extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NOT_BUILT = "not built yet"


class KernelCache:
    """A directory of one built extension: `<name>.so`, its build record (`build.json`: the library's
    sha256 and size, the directory's owner and mode) and `lock` (an flock, held while building).

    A library is loaded only where this user owns the directory, the record and the library, and the
    library's size and hash are the recorded ones: checked before it is opened, so a foreign file's
    constructor never runs and a truncated one never faults (SIGBUS). Anything else is rebuilt, with
    a message. `compile(name, scratch)` builds into a scratch directory: (the module, its library).
    """

    def __init__(self, directory: Path, name: str, compile: Callable[[str, Path], tuple[Any, Path]],
                 lock_timeout: float = BUILD_LOCK_TIMEOUT_S, what: str = "C++ quantized-KV kernels") -> None:
        self.directory, self.name, self.compile, self.lock_timeout = directory, name, compile, lock_timeout
        self.what = what  # the extension, as the build messages name it
        self.library = directory / f"{name}.so"
        self.record = directory / "build.json"
        self.built_seconds: float | None = None  # set when this process built it

    def load(self) -> Any:
        """The extension: the cached build where it checks out, else built now (once per machine, torch
        and Python version: other processes wait on the lock, then load what it built)."""
        loose = self._own_directory()
        module, problem = (None, loose) if loose else self._load_verified()
        if module is not None:
            return module
        with held_lock(self.directory / "lock", self.lock_timeout, "the C++ kernel build lock"):
            if not loose:
                module, problem = self._load_verified()  # built by another process while this one waited
            return module if module is not None else self._build(problem)

    def problem(self) -> str | None:
        """Why the cached library must not be loaded; None where it is the build recorded."""
        try:
            record = read_json(self.record, RECORD_MAX_BYTES, "kernel build record")
            library, folder, record_info = os.lstat(self.library), os.stat(self.directory), os.lstat(self.record)
        except FileNotFoundError:
            return f"{self.library} is missing" if self.record.exists() else NOT_BUILT
        except (OSError, ValueError) as exc:
            return str(exc)
        uid = os.getuid()
        if not stat.S_ISREG(library.st_mode):
            return f"{self.library} is not a regular file"
        if library.st_uid != uid or record_info.st_uid != uid:
            return f"{self.library} or its build record belongs to another user"
        if not isinstance(record, dict):
            return f"{self.record} is not a JSON object"
        owner = (folder.st_uid, stat.S_IMODE(folder.st_mode))
        if (record.get("uid"), record.get("mode")) != owner:
            return (f"{self.directory} has owner and mode {owner[0]}, {owner[1]:o}, not the {record.get('uid')}, "
                    f"{record.get('mode')!r} of its build")
        if record.get("bytes") != library.st_size:
            return f"{self.library} has {library.st_size:,} bytes, not the {record.get('bytes')!r} built"
        if record.get("sha256") != file_sha256(self.library, MAX_LIBRARY_BYTES, "kernel library"):
            return f"the sha256 of {self.library} is not the one recorded at its build"
        return None

    def _own_directory(self) -> str | None:
        """Make the directory (private); refuse one of another user's. A problem where others could
        write to it (then it is made private, and what it holds rebuilt)."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(self.directory)
        if not stat.S_ISDIR(info.st_mode):
            raise ValueError(f"the kernel cache {self.directory} is not a directory")
        if info.st_uid != os.getuid():
            raise PermissionError(f"the kernel cache {self.directory} belongs to uid {info.st_uid}, not this user "
                                  f"(uid {os.getuid()}); set XDG_CACHE_HOME to a directory of your own")
        if stat.S_IMODE(info.st_mode) & 0o022:
            os.chmod(self.directory, 0o700)
            return f"others could write to {self.directory} (mode {stat.S_IMODE(info.st_mode):o}; now 700)"
        return None

    def _load_verified(self) -> tuple[Any, str | None]:
        problem = self.problem()
        if problem is None:
            try:
                return import_extension(self.name, self.library), None
            except ImportError as exc:  # this user's build, but not loadable here (e.g. another libtorch)
                problem = f"it does not load: {failure_line(exc)}"
        return None, problem

    def _build(self, problem: str | None) -> Any:
        if problem != NOT_BUILT:
            log.warning("the cached %s are not loaded (%s); rebuilding them", self.what, problem)
        log.warning("building the %s in %s (once per machine, torch and Python version; "
                    "30-60 s on an idle CPU)", self.what, self.directory)
        start = time.monotonic()
        for stale in self.directory.glob("build-*"):  # a killed builder's (this process holds the lock)
            shutil.rmtree(stale, ignore_errors=True)
        with tempfile.TemporaryDirectory(prefix="build-", dir=self.directory) as scratch:
            module, built = self.compile(self.name, Path(scratch))
            data = read_bytes(built, MAX_LIBRARY_BYTES, "built kernel library")
        self.record.unlink(missing_ok=True)  # no moment where the record describes another library
        atomic_write_bytes(self.library, data)
        folder = os.stat(self.directory)
        self.built_seconds = time.monotonic() - start
        record = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "uid": folder.st_uid,
                  "mode": stat.S_IMODE(folder.st_mode), "torch": torch.__version__,
                  "python": platform.python_version(), "build_seconds": round(self.built_seconds, 1)}
        atomic_write_text(self.record, json.dumps(record, indent=2) + "\n")
        log.warning("built the %s in %.1f s", self.what, self.built_seconds)
        return module


def load() -> Any:
    """The built extension (building it at the first call of a machine), or None where it cannot build
    or load (then `failure()` says why; warned once)."""
    global _module, _failure, _cache
    with _lock:
        if _module is None and _failure is None:
            try:
                _cache = kernel_cache()  # (inside: no cache directory, e.g. no home, falls back too)
                _module = _cache.load()
            except Exception as exc:  # no compiler, no ninja, a failing build, a foreign cache: the other paths run
                _failure = failure_line(exc)
                log.warning("the C++ kernels (quantized KV, int8 / int4 / nf4 weights, bf16 rows, norms) are "
                            "unavailable (%s); their compiled or plain PyTorch paths run", _failure)
    return _module


def build_ahead() -> str:
    """Load the kernels, building them where this machine has not (`rdepth info --build-kernels`): one
    line saying which; a RuntimeError line where they cannot build."""
    if load() is None:
        raise RuntimeError(f"the C++ quantized-KV kernels cannot build here: {_failure}")
    assert _cache is not None
    how = "already built" if _cache.built_seconds is None else f"built in {_cache.built_seconds:.1f} s"
    return f"C++ quantized-KV kernels: {how}, in {_cache.directory}"


def failure() -> str | None:
    return _failure


def failure_line(exc: BaseException) -> str:
    """Why a build or compile failed, in one line (its exception's type and first message line).

    torch's "Error building extension 'x': <the whole compile command>" keeps its head and takes the
    compiler's own reason from the lines below (`build_cause`: "c++: not found", the first error), which
    its first line never holds."""
    lines = str(exc).splitlines()
    head = lines[0] if lines else ""
    if head.startswith(BUILD_ERROR_HEAD):
        head = head.split(": ", 1)[0]
        cause = build_cause(lines[1:])
        head = head if cause is None else f"{head}: {cause}"
    return f"{type(exc).__name__}: {head}"


BUILD_ERROR_HEAD = "Error building extension"  # torch.utils.cpp_extension's message
CAUSE_MAX_CHARS = 300


def build_cause(lines: list[str]) -> str | None:
    """The compiler's reason among a failed build's output lines: the first that says "error", "not found" or
    "cannot" (ninja's own FAILED / "build stopped" lines and the echoed commands aside), else the last other line."""
    kept = [line.strip() for line in lines
            if line.strip() and not line.lstrip().startswith(("ninja:", "FAILED:", "[")) and " -c " not in line]
    for line in kept:
        if any(word in line.lower() for word in ("error", "not found", "cannot")):
            return line[:CAUSE_MAX_CHARS]
    return kept[-1][:CAUSE_MAX_CHARS] if kept else None


class EntryLayout:
    """A TurboTables' row layout as the kernel reads it: per field (first byte, entries, bits, offset
    into the values table, which factor: `TurboTables.fields`), the values table (every group's
    centroids, then -1, +1 for sign bits), where the norms start, the group count and (prod) the
    residual steps."""

    def __init__(self, t: TurboTables) -> None:
        G = len(t.group_sizes)
        sign_at = int(t.centroids.numel())
        layout = [(first, count, bits, sign_at if offset is None else offset, norm)
                  for first, count, bits, offset, norm in t.fields]
        self.layout = torch.tensor(layout, dtype=torch.int32)
        self.values = torch.cat([t.centroids.float().cpu(), torch.tensor([-1.0, 1.0])]).contiguous()
        self.norm_byte = t.norm_bytes
        self.groups = G
        self.residual_step = t.residual_step.float().cpu().contiguous()
        self.entries = sum(count for _, count, _, _, _ in layout)
        # `encode`'s tables, ints and steps (see the C++ source)
        self.encode_tables = [
            t.rotate.float().contiguous(), t.col_group.long().contiguous(), t.col_shift.float().contiguous(),
            t.boundaries.float().contiguous(), t.offsets.long().contiguous(), t.centroids.float().contiguous(),
            _EMPTY if t.sketch_t is None else t.sketch_t.float().contiguous(), self.layout,
            *(d.long().contiguous() for d in t.dither)]
        self.encode_ints = [G, *t.group_sizes, t.norm_bytes, self.norm_byte + 2 * G + len(t.residual_steps),
                            RESIDUAL_LEVELS, HASH_BITS]
        self.encode_steps = [float(step) for step in t.residual_steps]


MAX_CODECS = 256  # C++ codecs kept per process: bounded, as a long-running server keeps making new ones


class CppCodes:
    """The C++ attention read for TurboRows codecs on CPU (see the module docstring)."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self._codecs: dict[int, tuple[TurboTables, Any]] = {}

    def codec(self, t: TurboTables) -> Any:
        """The C++ `Codec` of a TurboTables (its layout and matrices), built once."""
        cached = self._codecs.get(id(t))
        if cached is None or cached[0] is not t:  # (keeps `t` alive, so its id stays its own)
            if len(self._codecs) >= MAX_CODECS:  # the serving pool makes a permuted codec per set of rows
                self._codecs.clear()
            layout = EntryLayout(t)
            # the read's matrices: with a folded permutation the shared codec's (the read permutes q and
            # its output: one matrix for every layer and head, kept in cache), else the codec's own
            folded = t.perm is not None and t.base_query is not None and t.base_back is not None
            query, back = (t.base_query, t.base_back) if folded else (t.query, t.back)
            perm = t.perm.long().cpu().contiguous() if folded else _EMPTY_LONG
            unperm = perm.argsort(dim=-1).contiguous() if folded else _EMPTY_LONG
            # (the plain encode's shared rotation: rows gathered by perm, as the read's queries)
            rotate = t.base_rotate.float().contiguous() if folded and t.base_rotate is not None else _EMPTY
            codec = self.module.Codec(layout.encode_tables, layout.encode_ints, layout.encode_steps, layout.layout,
                                      layout.values, layout.residual_step, query.float().contiguous(),
                                      back.float().contiguous(), layout.norm_byte, layout.groups, perm, unperm,
                                      rotate)
            cached = self._codecs[id(t)] = (t, codec)
        return cached[1]

    def encode(self, tk: TurboTables, tv: TurboTables, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, bool]:
        """`turbo_encode` of k and v `[..., D]` (CPU), the same bytes: (rows_k, rows_v, all norms finite)."""
        return self.module.encode_pair(k, self.codec(tk), v, self.codec(tv))

    @staticmethod
    def fits(q: Tensor, is_causal: bool) -> bool:
        return q.device.type == "cpu" and q.shape[2] == 1 and not is_causal

    def attend(self, tk: TurboTables, tv: TurboTables, q: Tensor, rows_k: Tensor, rows_v: Tensor,
               attn_mask: Tensor | None) -> Tensor:
        """`codes_attention(q [B, H, 1, D], ...)` with turbo_score / turbo_combine's results."""
        return self.module.attend(q, self.codec(tk), self.codec(tv), rows_k, rows_v, attn_mask)

    def decode_attend(self, tk: TurboTables, tv: TurboTables, q: Tensor, k: Tensor, v: Tensor, store_k: Tensor,
                      store_v: Tensor, start: int, attn_mask: Tensor | None) -> tuple[Tensor, bool]:
        """One C++ call for a decode call: k, v `[B, Hkv, T, D]` encoded into the storage's rows `[B, Hkv,
        capacity, bytes]` at columns [start, start + T) (`encode`'s bytes), then `attend` over columns
        [0, start + T): (the attention `[B, H, 1, Dv]`, whether every stored norm is finite)."""
        return self.module.decode_attend(q, k, v, self.codec(tk), self.codec(tv), store_k, store_v, start, attn_mask)


_EMPTY = torch.empty(0)
_EMPTY_LONG = torch.empty(0, dtype=torch.long)
