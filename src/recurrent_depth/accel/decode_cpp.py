"""One C++ call per decode piece: the prelude, all r core steps, or the coda and head of one new token per
row, for `FastRunner` (`accel.runner`) at batch sizes where decoding is bound by per-operation overhead.

At batch 1 on the `small` preset a core block costs ~45 tensor operations from Python, each a few
microseconds of dispatch, against ~100 µs of arithmetic: the runner's fused path still spends most of a
token entering Python. Here the whole recurrence of a token, `s <- core(W_s s + W_e e)` r times, runs in
one call (`Decoder.core_steps`): the four products of each block are ATen's `addmm` on the runner's own
weight layouts (the same kernels as its Python path), and the rest (the norms, interleaved RoPE, the KV
write, softmax attention of the one query row over the cache's columns, SiLU-gating) are plain C++ loops
over float32 rows, built with `-O3 -march=native -ffp-contract=off` through `accel.quant_cpp`'s build
cache (one build per machine, torch, Python and CPU; a message and its time at the first use).

One row (batch 1, float stores, a model whose weights the runner copies: its small ones) runs on a team of
torch's threads (`Decoder::with_team`): one fork a call, each thread streaming its own share of every
product (its kv groups' q, k, v rows and attention, its MLP hidden units, its vocabulary rows) with
AVX-512 / AVX2 loops, and one spin barrier after each product that sums over shares (the adapter's state
half, proj, out). A step of the quickstart model (6.6 MB of float32 weights, streamed from L3 by one
core) reads ~25 GB/s there against ~19 for ATen's gemv, and two threads split it without ~10 forks a step.
`TEAM_DECODE = False` keeps the per-product path below (for comparisons).

Covered (everything else takes the Python path, which stays the reference): float32 on CPU without
autograd, one new column per row (T = 1; any batch size, left-padding masks), the Huginn layout
`FastRunner` supports without LoRA and without sliding windows (one mask serves every layer here),
grouped-query heads, any head_dim (even, as RoPE needs), and a
storage that hands out its KV tensors (`ModelCache.decode_views`: the static generation cache without a
write mask or a lookup that hides or re-picks columns; every slot rule). The engine calls `core_steps`
for fixed-depth runs without per-step hooks (`Recurrence.run`), and the runner's `core_step` calls it for
one step (an exit criterion's loop, until a row stops and the cache takes a write mask).

Quantized KV (`kv_quant` with TurboQuant-family codecs, read from codes, no bf16 window): each attention
layer encodes its new key and value straight into the cache's code rows and reads attention from every
column's codes inside the same call, with the quantized-KV kernels' own C++ (`accel.quant_cpp`'s
`decode_attend`, whose source this extension embeds), its encode's rotations and norms by plain loops
(`plain`: ~10 ATen calls an encode cost more than the read at batch 1), so the new entries' codes equal
the Python path's up to float32 rounding of the rotated key (a bucket boundary), as the keys themselves
do. Other codecs, a window or `attn=dequantize` take the Python path.

Results equal the Python path's to float32 rounding, not bit for bit: the norms, the softmax and the
attention sums are accumulated in another order than ATen's vectorised kernels (tests compare logits,
states and tokens). Off with `RDEPTH_NO_CPP_DECODE=1` (this decode only: the quantized-KV C++ read
stays), `RDEPTH_NO_CPP=1` (every C++ kernel) or `RDEPTH_NO_ACCEL=1` (which turns off `FastRunner`).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import torch
from torch import Tensor

from recurrent_depth.accel import quant_cpp
from recurrent_depth.model.cache import DecodeViews
from recurrent_depth.quant.rows import TurboRows

log = logging.getLogger(__name__)
WHAT = "C++ decode kernels"
NO_DECODE_ENV = "RDEPTH_NO_CPP_DECODE"  # this decode off, the quantized-KV C++ read left on

CPP_SOURCE = quant_cpp.KERNEL_SOURCE + r"""
#include <atomic>
#include <omp.h>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>

namespace {

// A block's weights: the four norm gains [h]; the products' [in, out] layouts (views allowed);
// the biases (numel 0: none; the qkv bias has the q/k biases folded in).
struct Block {
  at::Tensor n1, n2, n3, n4, qkv, proj, fc, out, qkv_bias, proj_bias, fc_bias, out_bias;
};

inline bool has(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

// Products of at most STREAM_ROWS rows with an untransposed-layout weight stream its rows (`stream_linear`),
// at least 16 blocks of four weight rows to a thread's share (`stream_rows`).
constexpr int64_t STREAM_ROWS = 8;

// The codecs of a call's layers: empty (float stores), or one key and one value codec per store.
using Codecs = std::vector<Codec*>;

// RMSNorm of B rows of width h, as the model's: x * rsqrt(mean(x^2) + eps) * w (y may be x).
void norm_rows(const float* x, const float* w, float* y, int64_t B, int64_t h, float eps) {
  for (int64_t b = 0; b < B; ++b) {
    const float* xr = x + b * h;
    float* yr = y + b * h;
    const float r = 1.0f / std::sqrt(dot(xr, xr, h) / static_cast<float>(h) + eps);
    for (int64_t i = 0; i < h; ++i) yr[i] = (xr[i] * r) * w[i];
  }
}


// The team path's two products of one row (`Decoder::with_team`), each streaming a thread's share of a
// weight once, in order: `row_dots` y[o] = x . W[o] for `rows` rows of W [rows, K] (a product's output
// rows: the parameter's own [out, in] layout), `row_axpys` y = sum_k x[k] W[k] over `rows` rows of W [rows, N]
// (a product's input rows: its [in, out] layout, a share of the sum over k). Four rows, or AXPY_VECTORS vectors
// of a row, at a time: ~25 GB/s from L3 on one core of an AMX Xeon, where ATen's gemv reads ~19. (`row_dots`
// is `dot_rows` at the build's full vector width: `dot_rows`, 8 lanes for every weight type it reads, made
// the team's core step ~5 % slower on AVX-512, 1 and 2 threads, four interleaved rounds.)
#if defined(__AVX512F__)
#define TEAM_SIMD 1
using Vec = __m512;
constexpr int64_t LANES = 16, AXPY_VECTORS = 16;
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vbroadcast(float a) { return _mm512_set1_ps(a); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define TEAM_SIMD 1
using Vec = __m256;
constexpr int64_t LANES = 8, AXPY_VECTORS = 8;
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vbroadcast(float a) { return _mm256_set1_ps(a); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return hsum8(v); }
#else
#define TEAM_SIMD 0
#endif

void row_dots(const float* x, const float* W, int64_t K, int64_t rows, float* y) {
  int64_t o = 0;
#if TEAM_SIMD
  const int64_t kv = K - K % LANES;
  for (; o + 4 <= rows; o += 4) {
    const float* w = W + o * K;
    Vec a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    // The next four rows are fetched while these four are read: with short rows each block is a new page,
    // where the hardware prefetcher starts over (1.03-1.05x a decode, paired medians of 8 rounds).
    const bool ahead = o + 8 <= rows;
    const char* next = reinterpret_cast<const char*>(w + 4 * K);
    for (int64_t k = 0; k < kv; k += LANES) {
      if (ahead) {
        for (int64_t j = 0; j < 4; ++j) _mm_prefetch(next + 4 * (j * K + k), _MM_HINT_T0);
      }
      const Vec xv = vload(x + k);
      a0 = vfma(xv, vload(w + k), a0);
      a1 = vfma(xv, vload(w + K + k), a1);
      a2 = vfma(xv, vload(w + 2 * K + k), a2);
      a3 = vfma(xv, vload(w + 3 * K + k), a3);
    }
    float d[4] = {vsum(a0), vsum(a1), vsum(a2), vsum(a3)};
    for (int64_t k = kv; k < K; ++k) {
      for (int64_t j = 0; j < 4; ++j) d[j] += x[k] * w[j * K + k];
    }
    std::copy(d, d + 4, y + o);
  }
#endif
  for (; o < rows; ++o) y[o] = dot(x, W + o * K, K);
}

void row_axpys(const float* x, const float* W, int64_t rows, int64_t N, float* y) {
  int64_t c = 0;
#if TEAM_SIMD
  for (; c + AXPY_VECTORS * LANES <= N; c += AXPY_VECTORS * LANES) {
    Vec acc[AXPY_VECTORS];
    for (int64_t j = 0; j < AXPY_VECTORS; ++j) acc[j] = vzero();
    for (int64_t k = 0; k < rows; ++k) {
      const Vec xv = vbroadcast(x[k]);
      const float* w = W + k * N + c;
      for (int64_t j = 0; j < AXPY_VECTORS; ++j) acc[j] = vfma(xv, vload(w + j * LANES), acc[j]);
    }
    for (int64_t j = 0; j < AXPY_VECTORS; ++j) vstore(y + c + j * LANES, acc[j]);
  }
  for (; c + LANES <= N; c += LANES) {
    Vec acc = vzero();
    for (int64_t k = 0; k < rows; ++k) acc = vfma(vbroadcast(x[k]), vload(W + k * N + c), acc);
    vstore(y + c, acc);
  }
#endif
  for (; c < N; ++c) {
    float acc = 0.0f;
    for (int64_t k = 0; k < rows; ++k) acc += x[k] * W[k * N + c];
    y[c] = acc;
  }
}

// The team's barrier: each thread spins until all `n` have arrived (then yields, where threads outnumber cores).
class SpinBarrier {
 public:
  void reset(int n) { n_ = n; }
  void wait() {
    if (n_ <= 1) return;
    const int generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == n_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      return;
    }
    for (int spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      if (spins < 4096) {
#if defined(__SSE2__)
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  int n_ = 1;
  std::atomic<int> arrived_{0}, generation_{0};
};

// Calls that ran on a team (`Decoder::with_team`), for tests to see which path ran.
std::atomic<int64_t> team_calls{0};

// A share [begin, end) of n items for thread t of a team of `threads`.
inline std::pair<int64_t, int64_t> share(int64_t n, int64_t t, int64_t threads) {
  return {n * t / threads, n * (t + 1) / threads};
}

// A softmax's numerators in place, sc[c] = exp(sc[c] - top) over [0, end), and their sum.
inline float exponentiate(float* sc, int64_t end, float top) {
  float total = 0.0f;
  for (int64_t c = 0; c < end; ++c) {
    sc[c] = std::exp(sc[c] - top);
    total += sc[c];
  }
  return total;
}

#if TEAM_SIMD
// Softmax attention of one query head q [D] over columns [0, end) of keys kh and values vh (column c at
// c * k2, c * v2; mrow: bool [end] or null) into o [D]; sc: scratch of `end` floats. The head's query and
// output live in NV vector registers (D = NV * LANES).
template <int NV>
void attend_head(const float* q, const float* kh, int64_t k2, const float* vh, int64_t v2, int64_t end,
                 const bool* mrow, float scale, float* o, float* sc) {
  constexpr float lowest = -std::numeric_limits<float>::infinity();
  float top = lowest;
  Vec qv[NV];
  for (int j = 0; j < NV; ++j) qv[j] = vload(q + j * LANES);
  for (int64_t c = 0; c < end; ++c) {
    if (mrow != nullptr && !mrow[c]) {
      sc[c] = lowest;
      continue;
    }
    Vec acc = vzero();
    for (int j = 0; j < NV; ++j) acc = vfma(qv[j], vload(kh + c * k2 + j * LANES), acc);
    sc[c] = vsum(acc) * scale;
    top = std::max(top, sc[c]);
  }
  const float total = exponentiate(sc, end, top);
  Vec acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = vzero();
  for (int64_t c = 0; c < end; ++c) {
    const Vec weight = vbroadcast(sc[c] / total);
    for (int j = 0; j < NV; ++j) acc[j] = vfma(weight, vload(vh + c * v2 + j * LANES), acc[j]);
  }
  for (int j = 0; j < NV; ++j) vstore(o + j * LANES, acc[j]);
}
#endif

// `attend_head` for any head dim D: register-resident for D = 1..8 vectors, else over D in plain loops.
void attend_any(const float* q, const float* kh, int64_t k2, const float* vh, int64_t v2, int64_t end,
                const bool* mrow, float scale, float* o, float* sc, int64_t D) {
#if TEAM_SIMD
  if (D % LANES == 0) {
    switch (D / LANES) {
      case 1: return attend_head<1>(q, kh, k2, vh, v2, end, mrow, scale, o, sc);
      case 2: return attend_head<2>(q, kh, k2, vh, v2, end, mrow, scale, o, sc);
      case 3: return attend_head<3>(q, kh, k2, vh, v2, end, mrow, scale, o, sc);
      case 4: return attend_head<4>(q, kh, k2, vh, v2, end, mrow, scale, o, sc);
      case 5: return attend_head<5>(q, kh, k2, vh, v2, end, mrow, scale, o, sc);
      case 6: return attend_head<6>(q, kh, k2, vh, v2, end, mrow, scale, o, sc);
      case 7: return attend_head<7>(q, kh, k2, vh, v2, end, mrow, scale, o, sc);
      case 8: return attend_head<8>(q, kh, k2, vh, v2, end, mrow, scale, o, sc);
      default: break;
    }
  }
#endif
  constexpr float lowest = -std::numeric_limits<float>::infinity();
  float top = lowest;
  for (int64_t c = 0; c < end; ++c) {
    sc[c] = (mrow != nullptr && !mrow[c]) ? lowest : dot(q, kh + c * k2, D) * scale;
    top = std::max(top, sc[c]);
  }
  const float total = exponentiate(sc, end, top);
  std::fill(o, o + D, 0.0f);
  for (int64_t c = 0; c < end; ++c) {
    const float weight = sc[c] / total;
    const float* vr = vh + c * v2;
    for (int64_t d = 0; d < D; ++d) o[d] += weight * vr[d];
  }
}

// The attention of one row's query heads of kv groups [g0, g1): this column's keys and values (in `row`,
// qkv-laid) into the row's stores at kb, vb (strides k1/k2, v1/v2 for group and column), then each head's
// softmax over columns [0, end) (mrow: bool [end] or null) into att [H * D]; sc: scratch of `end` floats.
void attend_groups(const float* row, int64_t H, int64_t Hkv, int64_t D, int64_t g0, int64_t g1, float* kb,
                   int64_t k1, int64_t k2, float* vb, int64_t v1, int64_t v2, int64_t column, const bool* mrow,
                   float* att, float* sc) {
  const int64_t group = H / Hkv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int64_t g = g0; g < g1; ++g) {
    std::copy(row + (H + g) * D, row + (H + g + 1) * D, kb + g * k1 + column * k2);
    std::copy(row + (H + Hkv + g) * D, row + (H + Hkv + g + 1) * D, vb + g * v1 + column * v2);
  }
  for (int64_t head = g0 * group; head < g1 * group; ++head) {
    attend_any(row + head * D, kb + (head / group) * k1, k2, vb + (head / group) * v1, v2, column + 1, mrow, scale,
               att + head * D, sc, D);
  }
}

class Decoder {
 public:
  Decoder(std::vector<std::vector<at::Tensor>> prelude, std::vector<std::vector<at::Tensor>> core,
          std::vector<std::vector<at::Tensor>> coda, at::Tensor wte, at::Tensor adapter_s, at::Tensor ln_f,
          at::Tensor lm_head, double emb_scale, int64_t H, int64_t Hkv, int64_t D, double eps,
          std::vector<std::vector<std::vector<at::Tensor>>> team, at::Tensor team_adapter, at::Tensor team_head)
      : wte_(wte), adapter_s_(adapter_s), ln_f_(ln_f.contiguous()), lm_head_(lm_head),
        emb_scale_(static_cast<float>(emb_scale)), H_(H), Hkv_(Hkv), D_(D), eps_(static_cast<float>(eps)) {
    TORCH_CHECK(D % 2 == 0 && H % Hkv == 0, "decode kernel: even head_dim, heads a multiple of kv heads");
    h_ = ln_f_.size(0);
    for (auto* part : {&prelude, &core, &coda}) {
      std::vector<Block> blocks;
      for (auto& w : *part) {
        TORCH_CHECK(w.size() == 12, "decode kernel: 12 tensors a block");
        Block b{w[0].contiguous(), w[1].contiguous(), w[2].contiguous(), w[3].contiguous(), w[4], w[5], w[6],
                w[7], w[8], w[9], w[10], w[11]};
        for (const at::Tensor* t : {&b.n1, &b.n2, &b.n3, &b.n4, &b.qkv, &b.proj, &b.fc, &b.out}) {
          TORCH_CHECK(t->scalar_type() == at::kFloat, "decode kernel: float32 weights");
        }
        blocks.push_back(b);
      }
      parts_.push_back(blocks);
    }
    inner_ = parts_[1].empty() ? 0 : parts_[1][0].fc.size(1) / 2;
    if (!team.empty()) {  // the team path's weights (`TeamBlock`): none, or four a block of every part
      TORCH_CHECK(team.size() == 3, "decode kernel: team weights for prelude, core and coda");
      for (size_t part = 0; part < 3; ++part) {
        TORCH_CHECK(team[part].size() == parts_[part].size(), "decode kernel: team weights a block");
        std::vector<TeamBlock> weights;
        for (const auto& w : team[part]) {
          TORCH_CHECK(w.size() == 4, "decode kernel: 4 team weights a block");
          for (const at::Tensor& t : w) {
            TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(1) == h_,
                        "decode kernel: contiguous float32 team weights [rows, h]");
          }
          TORCH_CHECK(w[0].size(0) == (H_ + 2 * Hkv_) * D_ && w[1].size(0) == H_ * D_ && w[2].size(0) == 2 * inner_
                      && w[3].size(0) == inner_, "decode kernel: team weights of qkv, proj, fc and out rows");
          weights.push_back({w[0], w[1], w[2], w[3]});
        }
        team_.push_back(weights);
      }
      TORCH_CHECK(team_adapter.is_contiguous() && team_adapter.dim() == 2 && team_adapter.size(0) == h_
                  && team_adapter.size(1) == h_ && team_head.is_contiguous() && team_head.dim() == 2
                  && team_head.size(1) == h_, "decode kernel: contiguous team adapter [h, h] and head [V, h]");
      team_adapter_ = team_adapter;
      team_head_ = team_head;
    }
  }

  // e = prelude(wte(ids) * emb_scale): ids [B] long -> [B, h]
  at::Tensor embed(const at::Tensor& ids, const at::Tensor& freqs, const std::vector<at::Tensor>& ks,
                   const std::vector<at::Tensor>& vs, const Codecs& cks, const Codecs& cvs, int64_t column,
                   const at::Tensor& mask) {
    at::NoGradGuard no_grad;
    at::Tensor x = at::embedding(wte_, ids.reshape({-1})).mul_(emb_scale_).contiguous();
    if (teams(x.size(0))) {
      team_prelude(x, freqs, ks, vs, cks, cvs, column, mask);
    } else {
      run_blocks(parts_[0], 0, x, freqs, ks, vs, cks, cvs, column, mask);
    }
    return x;
  }

  // `steps` core steps from state [B, h]: s <- blocks(injected + s @ adapter_s); views: steps * L, in order.
  at::Tensor core_steps(const at::Tensor& state, const at::Tensor& injected, const at::Tensor& freqs,
                        const std::vector<at::Tensor>& ks, const std::vector<at::Tensor>& vs, const Codecs& cks,
                        const Codecs& cvs, int64_t column, const at::Tensor& mask, int64_t steps) {
    at::NoGradGuard no_grad;
    const auto& core = parts_[1];
    const int64_t L = static_cast<int64_t>(core.size());
    TORCH_CHECK(static_cast<int64_t>(ks.size()) == steps * L && ks.size() == vs.size(),
                "decode kernel: one key and value store per core layer and step");
    if (teams(state.numel() / h_)) {
      return team_core_steps(state, injected, freqs, ks, vs, cks, cvs, column, mask, steps);
    }
    at::Tensor s = state.reshape({-1, h_}).contiguous().clone();
    const at::Tensor inj = injected.reshape({-1, h_}).contiguous();
    at::Tensor x = at::empty_like(s);
    for (int64_t i = 0; i < steps; ++i) {
      linear(x, s, adapter_s_, at::Tensor(), &inj);  // injected + s @ adapter_s
      run_blocks(core, i * L, x, freqs, ks, vs, cks, cvs, column, mask);
      std::swap(s, x);
    }
    return s;
  }

  // logits [B, V] = lm_head(ln_f(coda(ln_f(state))))
  at::Tensor predict(const at::Tensor& state, const at::Tensor& freqs, const std::vector<at::Tensor>& ks,
                     const std::vector<at::Tensor>& vs, const Codecs& cks, const Codecs& cvs, int64_t column,
                     const at::Tensor& mask) {
    at::NoGradGuard no_grad;
    if (teams(state.numel() / h_)) return team_predict(state, freqs, ks, vs, cks, cvs, column, mask);
    at::Tensor x = at::empty({state.numel() / h_, h_}, state.options());
    const at::Tensor s = state.reshape({-1, h_}).contiguous();
    norm_rows(s.data_ptr<float>(), ln_f_.data_ptr<float>(), x.data_ptr<float>(), x.size(0), h_, eps_);
    run_blocks(parts_[2], 0, x, freqs, ks, vs, cks, cvs, column, mask);
    norm_rows(x.data_ptr<float>(), ln_f_.data_ptr<float>(), x.data_ptr<float>(), x.size(0), h_, eps_);
    at::Tensor logits = at::empty({x.size(0), lm_head_.size(1)}, x.options());
    linear(logits, x, lm_head_, at::Tensor(), nullptr);
    return logits;
  }

 private:
  // One row's decode from float stores by a team of torch's threads (`with_team`): each thread owns a share
  // of the kv groups (their q, k, v rows, RoPE, cache writes and attention), of the MLP's hidden units and of
  // the vocabulary; the products whose inputs are such shares (the adapter's state half, proj, out) are each
  // thread's partial sum, added up after a barrier. Every thread then repeats the cheap row-wide work (the
  // adds, the norms) on its own copy of the state, so one barrier a summed product is the team's only
  // synchronisation (one fork a call): at batch 1 a step is ~10 products of a few hundred kB, each too small to
  // pay for a fork and join of its own. The sums' order depends on the team's size (results equal to float32
  // rounding, as elsewhere here). One thread runs the same code without barriers. With a quantized cache the
  // threads write their q, k, v rows into one shared row and thread 0 encodes and attends for every head
  // (`decode_attend_rows`, whose codecs may hold per-head tables), between two more barriers.
  bool teams(int64_t rows) const { return !team_.empty() && rows == 1; }

  // The product weights of a block as the team reads them: the qkv and fc products' [out, in] rows and the proj
  // and out products' [in, out] rows, contiguous, so a thread's share of each is one stretch of memory.
  struct TeamBlock {
    at::Tensor qkv_rows, proj_cols, fc_rows, out_cols;
  };

  // A thread's place in a team of n, its shares and its row buffers; `gather` is the team's barrier.
  struct Mate {
    int64_t t, n, g0 = 0, g1 = 0, i0 = 0, i1 = 0, a0 = 0, a1 = 0;
    std::vector<float> x, normed, mixed, out, qkv, att, gate_up, hidden, scores;
    float* partials;  // [2 phases, n, h]: phase p's in buffer p % 2 (a thread writes p + 2 only after every
    SpinBarrier* barrier;  // thread has passed the barrier of p + 1, so has read p)
    int64_t phase = 0;

    Mate(const Decoder& d, int64_t t_, int64_t n_, int64_t columns, float* partials_, SpinBarrier* barrier_)
        : t(t_), n(n_), x(d.h_), normed(d.h_), mixed(d.h_), out(d.h_), qkv((d.H_ + 2 * d.Hkv_) * d.D_),
          att(d.H_ * d.D_), scores(columns), partials(partials_), barrier(barrier_) {
      std::tie(g0, g1) = share(d.Hkv_, t, n);
      std::tie(i0, i1) = share(d.inner_, t, n);
      std::tie(a0, a1) = share(d.h_, t, n);
      gate_up.resize(2 * (i1 - i0));
      hidden.resize(i1 - i0);
    }
    float* mine(int64_t h) { return partials + ((phase % 2) * n + t) * h; }
    // y = (base + the team's partials of this phase) + bias (bias: null or [h]); then the next phase
    void gather(const float* base, const float* bias, float* y, int64_t h) {
      barrier->wait();
      const float* first = partials + (phase % 2) * n * h;
      for (int64_t i = 0; i < h; ++i) {
        float sum = first[i];
        for (int64_t u = 1; u < n; ++u) sum += first[u * h + i];
        const float v = base[i] + sum;
        y[i] = bias != nullptr ? v + bias[i] : v;
      }
      ++phase;
    }
  };

  // Runs body(mate) on every thread of a team of torch's threads (one thread: in this one, no fork).
  template <typename Body>
  void with_team(int64_t columns, const Body& body) {
    at::internal::lazy_init_num_threads();
    const int threads = at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
    partials_.resize(2 * threads * h_);
    shared_qkv_.resize((H_ + 2 * Hkv_) * D_);
    shared_att_.resize(H_ * D_);
    overflow_norm_ = -1.0f;
    team_calls.fetch_add(1, std::memory_order_relaxed);
    if (threads == 1) {
      barrier_.reset(1);
      Mate mate(*this, 0, 1, columns, partials_.data(), &barrier_);
      body(mate);
    } else {
#pragma omp parallel
      {
#pragma omp single
        barrier_.reset(omp_get_num_threads());  // (the single's closing barrier publishes it)
        Mate mate(*this, omp_get_thread_num(), omp_get_num_threads(), columns, partials_.data(), &barrier_);
        body(mate);
      }
    }
    if (overflow_norm_ >= 0.0f) refuse_norm(overflow_norm_);  // (raised here: nothing may throw inside the team)
  }

  // The checks of a team call's stores and mask; the rotary angles of its row.
  at::Tensor team_inputs(const at::Tensor& freqs, const std::vector<at::Tensor>& ks, const std::vector<at::Tensor>& vs,
                         const Codecs& cks, const Codecs& cvs, int64_t column, const at::Tensor& mask) const {
    TORCH_CHECK(ks.size() == vs.size(), "decode kernel: a key and a value store each");
    TORCH_CHECK(cks.empty() || (cks.size() == ks.size() && cvs.size() == ks.size()),
                "decode kernel: a key and value codec per store, or none");
    for (size_t i = 0; i < ks.size(); ++i) {
      if (cks.empty()) {
        check_float_store(ks[i], vs[i], 1, column + 1);
      } else {
        check_columns(ks[i], vs[i], 1, Hkv_, column + 1, *cks[i], *cvs[i]);
        TORCH_CHECK(cvs[i]->back.size(-1) == D_, "decode kernel: the codes' value width is the head dim");
      }
    }
    if (has(mask)) {
      TORCH_CHECK(mask.scalar_type() == at::kBool && mask.numel() == column + 1 && mask.is_contiguous(),
                  "decode kernel: mask bool [1, columns] contiguous");
    }
    const at::Tensor angles = at::view_as_real(freqs).reshape({-1, D_}).contiguous();
    TORCH_CHECK(angles.size(0) == 1, "decode kernel: rotary angles of one row");
    return angles;
  }

  static const float* data_or_null(const at::Tensor& t) { return has(t) ? t.data_ptr<float>() : nullptr; }
  static const Codec* codec(const Codecs& codecs, size_t i) { return codecs.empty() ? nullptr : codecs[i]; }

  // Mate m's part of block p (weights w) on its state copy m.x, with stores K, V (see `block`).
  void team_block(Mate& m, const Block& p, const TeamBlock& w, const at::Tensor& K, const at::Tensor& V,
                  const Codec* ck, const Codec* cv, const float* angles, int64_t column, const bool* mask) {
    const int64_t h = h_, H = H_, Hkv = Hkv_, D = D_, group = H / Hkv, inner = inner_;
    const int64_t q0 = m.g0 * group * D, q1 = m.g1 * group * D, own = m.i1 - m.i0;
    // rows [first, first + count) of a product's output: x . W[o] + bias[o]
    auto own_rows = [&](const float* x, const at::Tensor& rows, const at::Tensor& bias, int64_t first,
                        int64_t count, float* y) {
      row_dots(x, rows.data_ptr<float>() + first * h, h, count, y);
      if (has(bias)) {
        const float* b = bias.data_ptr<float>() + first;
        for (int64_t j = 0; j < count; ++j) y[j] += b[j];
      }
    };
    float* qkv = ck != nullptr ? shared_qkv_.data() : m.qkv.data();
    norm_rows(m.x.data(), p.n1.data_ptr<float>(), m.normed.data(), 1, h, eps_);
    own_rows(m.normed.data(), w.qkv_rows, p.qkv_bias, q0, q1 - q0, qkv + q0);  // this thread's q heads
    for (const int64_t first : {(H + m.g0) * D, (H + Hkv + m.g0) * D}) {  // its groups' k and v
      own_rows(m.normed.data(), w.qkv_rows, p.qkv_bias, first, (m.g1 - m.g0) * D, qkv + first);
    }
    rotate_heads(qkv, angles, m.g0 * group, m.g1 * group);
    rotate_heads(qkv, angles, H + m.g0, H + m.g1);
    float* att = m.att.data();
    if (ck != nullptr) {
      m.barrier->wait();  // (every thread's rows are in the shared row)
      const int64_t row = (H + 2 * Hkv) * D;
      if (m.t == 0 && !attend_code_rows(qkv, 1, row, K, V, *ck, *cv, column, mask, shared_att_.data())) {
        overflow_norm_ = std::max(overflow_norm_, largest_kv_norm(qkv, 1, row));
      }
      m.barrier->wait();  // (the heads' outputs are in the shared att)
      att = shared_att_.data();
    } else {
      attend_groups(qkv, H, Hkv, D, m.g0, m.g1, K.data_ptr<float>(), K.stride(1), K.stride(2), V.data_ptr<float>(),
                    V.stride(1), V.stride(2), column, mask, att, m.scores.data());
    }
    row_axpys(att + q0, w.proj_cols.data_ptr<float>() + q0 * h, q1 - q0, h, m.mine(h));
    m.gather(m.x.data(), data_or_null(p.proj_bias), m.mixed.data(), h);
    norm_rows(m.mixed.data(), p.n2.data_ptr<float>(), m.mixed.data(), 1, h, eps_);
    norm_rows(m.mixed.data(), p.n3.data_ptr<float>(), m.normed.data(), 1, h, eps_);
    own_rows(m.normed.data(), w.fc_rows, p.fc_bias, m.i0, own, m.gate_up.data());  // silu(gate) * up
    own_rows(m.normed.data(), w.fc_rows, p.fc_bias, inner + m.i0, own, m.gate_up.data() + own);
    for (int64_t j = 0; j < own; ++j) {
      const float g = m.gate_up[j];
      m.hidden[j] = (g / (1.0f + std::exp(-g))) * m.gate_up[own + j];
    }
    row_axpys(m.hidden.data(), w.out_cols.data_ptr<float>() + m.i0 * h, own, h, m.mine(h));
    m.gather(m.mixed.data(), data_or_null(p.out_bias), m.out.data(), h);
    norm_rows(m.out.data(), p.n4.data_ptr<float>(), m.x.data(), 1, h, eps_);
  }

  // The prelude's blocks on one row x [1, h], in place.
  void team_prelude(at::Tensor& x, const at::Tensor& freqs, const std::vector<at::Tensor>& ks,
                    const std::vector<at::Tensor>& vs, const Codecs& cks, const Codecs& cvs, int64_t column,
                    const at::Tensor& mask) {
    TORCH_CHECK(ks.size() >= parts_[0].size(), "decode kernel: a key and value store per block");
    const at::Tensor angles = team_inputs(freqs, ks, vs, cks, cvs, column, mask);
    float* xp = x.data_ptr<float>();
    const bool* mp = has(mask) ? mask.data_ptr<bool>() : nullptr;
    with_team(column + 1, [&](Mate& m) {
      std::copy(xp, xp + h_, m.x.begin());
      for (size_t j = 0; j < parts_[0].size(); ++j) {
        team_block(m, parts_[0][j], team_[0][j], ks[j], vs[j], codec(cks, j), codec(cvs, j), angles.data_ptr<float>(),
                   column, mp);
      }
      m.barrier->wait();  // (every thread has read x before thread 0 writes it)
      if (m.t == 0) std::copy(m.x.begin(), m.x.end(), xp);
    });
  }

  at::Tensor team_core_steps(const at::Tensor& state, const at::Tensor& injected, const at::Tensor& freqs,
                             const std::vector<at::Tensor>& ks, const std::vector<at::Tensor>& vs, const Codecs& cks,
                             const Codecs& cvs, int64_t column, const at::Tensor& mask, int64_t steps) {
    const at::Tensor angles = team_inputs(freqs, ks, vs, cks, cvs, column, mask);
    const at::Tensor inj = injected.reshape({h_}).contiguous();
    at::Tensor s = state.reshape({1, h_}).contiguous().clone();
    const int64_t L = static_cast<int64_t>(team_[1].size()), h = h_;
    const bool* mp = has(mask) ? mask.data_ptr<bool>() : nullptr;
    with_team(column + 1, [&](Mate& m) {
      float* sp = s.data_ptr<float>();
      std::copy(sp, sp + h, m.x.begin());
      for (int64_t step = 0; step < steps; ++step) {
        row_axpys(m.x.data() + m.a0, team_adapter_.data_ptr<float>() + m.a0 * h, m.a1 - m.a0, h, m.mine(h));
        m.gather(inj.data_ptr<float>(), nullptr, m.x.data(), h);  // injected + s @ adapter_s
        for (int64_t l = 0; l < L; ++l) {
          const size_t view = step * L + l;
          team_block(m, parts_[1][l], team_[1][l], ks[view], vs[view], codec(cks, view), codec(cvs, view),
                     angles.data_ptr<float>(), column, mp);
        }
      }
      if (m.t == 0) std::copy(m.x.begin(), m.x.end(), sp);  // (s was read before the first gather)
    });
    return s;
  }

  // logits [1, V] = lm_head(ln_f(coda(ln_f(state)))), each thread its share of the vocabulary's rows.
  at::Tensor team_predict(const at::Tensor& state, const at::Tensor& freqs, const std::vector<at::Tensor>& ks,
                          const std::vector<at::Tensor>& vs, const Codecs& cks, const Codecs& cvs, int64_t column,
                          const at::Tensor& mask) {
    TORCH_CHECK(ks.size() >= parts_[2].size(), "decode kernel: a key and value store per block");
    const at::Tensor angles = team_inputs(freqs, ks, vs, cks, cvs, column, mask);
    const at::Tensor s = state.reshape({h_}).contiguous();
    const int64_t V = team_head_.size(0), h = h_;
    at::Tensor logits = at::empty({1, V}, state.options());
    const bool* mp = has(mask) ? mask.data_ptr<bool>() : nullptr;
    with_team(column + 1, [&](Mate& m) {
      norm_rows(s.data_ptr<float>(), ln_f_.data_ptr<float>(), m.x.data(), 1, h, eps_);
      for (size_t j = 0; j < parts_[2].size(); ++j) {
        team_block(m, parts_[2][j], team_[2][j], ks[j], vs[j], codec(cks, j), codec(cvs, j), angles.data_ptr<float>(),
                   column, mp);
      }
      norm_rows(m.x.data(), ln_f_.data_ptr<float>(), m.normed.data(), 1, h, eps_);
      const auto [v0, v1] = share(V, m.t, m.n);
      row_dots(m.normed.data(), team_head_.data_ptr<float>() + v0 * h, h, v1 - v0, logits.data_ptr<float>() + v0);
    });
    return logits;
  }

  // The buffers of one block at B rows, kept between calls (a decoder serves one loop at a time).
  struct Work {
    int64_t B = -1;
    at::Tensor normed, qkv, att, mixed, gate_up, hidden, out;
    std::vector<float> scores;
  };

  Work& work(int64_t B, const at::Tensor& like, int64_t inner) {
    if (work_.B != B || work_.gate_up.size(1) != 2 * inner) {
      auto o = like.options();
      work_.B = B;
      work_.normed = at::empty({B, h_}, o);
      work_.qkv = at::empty({B, (H_ + 2 * Hkv_) * D_}, o);
      work_.att = at::empty({B, H_ * D_}, o);
      work_.mixed = at::empty({B, h_}, o);
      work_.gate_up = at::empty({B, 2 * inner}, o);
      work_.hidden = at::empty({B, inner}, o);
      work_.out = at::empty({B, h_}, o);
    }
    return work_;
  }

  static void linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                     const at::Tensor* residual) {
    if (x.size(0) <= STREAM_ROWS && w.stride(0) == 1) {
      stream_linear(out, x, w, bias, residual);
    } else if (residual != nullptr) {
      at::addmm_out(out, *residual, x, w);
      if (has(bias)) out.add_(bias);
    } else if (has(bias)) {
      at::addmm_out(out, bias, x, w);
    } else {
      at::mm_out(out, x, w);
    }
  }

  // `linear` for a few rows (B <= STREAM_ROWS) times a weight held as the transpose of a parameter's [n, k]
  // rows (the runner's layout for the weights it does not copy: a large model's). Decoding such a
  // model streams every weight from memory once a product, and ATen's gemv reads ~0.7 of the memory
  // bandwidth there (a 2-core AVX2 VM): here each thread streams its share of the weight rows once, four
  // rows together (`stream_rows` of the quantized-KV kernels' source), (residual + x w) + bias as `linear`.
  static void stream_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias,
                            const at::Tensor* residual) {
    const int64_t B = x.size(0), k = w.size(0), n = w.size(1);
    TORCH_CHECK(x.is_contiguous() && out.is_contiguous() && x.size(1) == k && out.size(0) == B && out.size(1) == n,
                "decode kernel: rows [B, k] times [k, n] into [B, n]");
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();  // row o of the [n, k] parameter at wp + o * w.stride(1)
    const int64_t row_stride = w.stride(1);
    const float* bp = has(bias) ? bias.data_ptr<float>() : nullptr;
    const float* rp = nullptr;
    if (residual != nullptr) {
      TORCH_CHECK(residual->is_contiguous() && residual->sizes() == out.sizes(), "decode kernel: residual as out");
      rp = residual->data_ptr<float>();
    }
    stream_rows(xp, wp, B, k, n, row_stride, nullptr, rp, bp, out.data_ptr<float>());
  }

  void run_blocks(const std::vector<Block>& blocks, int64_t first_view, at::Tensor& x, const at::Tensor& freqs,
                  const std::vector<at::Tensor>& ks, const std::vector<at::Tensor>& vs, const Codecs& cks,
                  const Codecs& cvs, int64_t column, const at::Tensor& mask) {
    TORCH_CHECK(first_view + static_cast<int64_t>(blocks.size()) <= static_cast<int64_t>(ks.size()),
                "decode kernel: a key and value store per block");
    const bool coded = !cks.empty();
    TORCH_CHECK(!coded || (cks.size() == ks.size() && cvs.size() == ks.size()),
                "decode kernel: a key and value codec per store, or none");
    const at::Tensor angles = at::view_as_real(freqs).reshape({-1, D_}).contiguous();  // [B, D/2 x (cos, sin)]
    for (size_t j = 0; j < blocks.size(); ++j) {
      const size_t view = first_view + j;
      block(blocks[j], x, angles, ks[view], vs[view], coded ? cks[view] : nullptr, coded ? cvs[view] : nullptr,
            column, mask);
    }
  }

  // x [B, h] <- the sandwich block: norm_2(x + attn(norm_1(x))), then norm_4(. + mlp(norm_3(.))). The
  // attention writes this column's key and value into K, V (floats, or with codecs ck, cv their code rows).
  void block(const Block& p, at::Tensor& x, const at::Tensor& angles, const at::Tensor& K, const at::Tensor& V,
             const Codec* ck, const Codec* cv, int64_t column, const at::Tensor& mask) {
    const int64_t B = x.size(0), inner = p.fc.size(1) / 2, h = h_;
    Work& w = work(B, x, inner);
    float* xp = x.data_ptr<float>();
    norm_rows(xp, p.n1.data_ptr<float>(), w.normed.data_ptr<float>(), B, h, eps_);
    linear(w.qkv, w.normed, p.qkv, p.qkv_bias, nullptr);
    const int64_t end = column + 1;
    TORCH_CHECK(angles.size(0) == B || angles.size(0) == 1, "decode kernel: rotary angles per row");
    const bool masked = has(mask);
    if (masked) {
      TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == B && mask.size(1) == end
                  && mask.is_contiguous(), "decode kernel: mask bool [B, columns] contiguous");
    }
    rotate(w.qkv, angles, B);
    if (ck != nullptr) {
      attend_codes(w, B, K, V, *ck, *cv, column, mask);
    } else {
      attend_floats(w, B, K, V, column, masked ? mask.data_ptr<bool>() : nullptr);
    }
    linear(w.mixed, w.att, p.proj, p.proj_bias, &x);
    float* mixed = w.mixed.data_ptr<float>();
    norm_rows(mixed, p.n2.data_ptr<float>(), mixed, B, h, eps_);
    norm_rows(mixed, p.n3.data_ptr<float>(), w.normed.data_ptr<float>(), B, h, eps_);
    linear(w.gate_up, w.normed, p.fc, p.fc_bias, nullptr);
    const float* gu = w.gate_up.data_ptr<float>();
    float* hid = w.hidden.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {  // silu(gate) * up
      const float* gate = gu + b * 2 * inner;
      for (int64_t i = 0; i < inner; ++i) {
        const float g = gate[i];
        hid[b * inner + i] = (g / (1.0f + std::exp(-g))) * gate[inner + i];
      }
    }
    linear(w.out, w.hidden, p.out, p.out_bias, &w.mixed);
    norm_rows(w.out.data_ptr<float>(), p.n4.data_ptr<float>(), xp, B, h, eps_);
  }

  // Interleaved RoPE on heads [first, end) of one qkv row (cs: the row's D/2 (cos, sin) pairs).
  void rotate_heads(float* row, const float* cs, int64_t first, int64_t end) const {
    const int64_t D = D_;
    for (int64_t head = first; head < end; ++head) {
      float* x2 = row + head * D;
      for (int64_t i = 0; i < D / 2; ++i) {
        const float a = x2[2 * i], c = x2[2 * i + 1], cos = cs[2 * i], sin = cs[2 * i + 1];
        x2[2 * i] = a * cos - c * sin;
        x2[2 * i + 1] = a * sin + c * cos;
      }
    }
  }

  // Interleaved RoPE on the q and k heads of every row of qkv [B, (H + 2 Hkv) D].
  void rotate(at::Tensor& qkv_rows, const at::Tensor& angles, int64_t B) const {
    const int64_t D = D_, width = (H_ + 2 * Hkv_) * D, a_stride = angles.size(0) == 1 ? 0 : D;
    float* qkv = qkv_rows.data_ptr<float>();
    const float* ang = angles.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      float* row = qkv + b * width;
      const float* cs = ang + b * a_stride;
      rotate_heads(row, cs, 0, H_ + Hkv_);
    }
  }

  // Float key and value stores [B, Hkv, >= end, D] with contiguous head dims.
  void check_float_store(const at::Tensor& K, const at::Tensor& V, int64_t B, int64_t end) const {
    TORCH_CHECK(K.dim() == 4 && K.size(0) == B && K.size(1) == Hkv_ && K.size(2) >= end && K.size(3) == D_
                && K.stride(3) == 1 && K.scalar_type() == at::kFloat, "decode kernel: keys [B, Hkv, >= ", end, ", D]");
    TORCH_CHECK(V.dim() == 4 && V.sizes() == K.sizes() && V.stride(3) == 1 && V.scalar_type() == at::kFloat,
                "decode kernel: values as the keys");
  }

  // This column's keys and values into the float stores K, V [B, Hkv, >= end, D], then softmax
  // attention of each query row over columns [0, end) (mp: bool [B, end] or none) into w.att.
  void attend_floats(Work& w, int64_t B, const at::Tensor& K, const at::Tensor& V, int64_t column,
                     const bool* mp) {
    const int64_t D = D_, H = H_, Hkv = Hkv_, width = (H + 2 * Hkv) * D, end = column + 1;
    check_float_store(K, V, B, end);
    float* qkv = w.qkv.data_ptr<float>();
    float* kp = K.data_ptr<float>();
    float* vp = V.data_ptr<float>();
    float* att = w.att.data_ptr<float>();
    if (static_cast<int64_t>(w.scores.size()) < end) w.scores.resize(end);
    for (int64_t b = 0; b < B; ++b) {
      attend_groups(qkv + b * width, H, Hkv, D, 0, Hkv, kp + b * K.stride(0), K.stride(1), K.stride(2),
                    vp + b * V.stride(0), V.stride(1), V.stride(2), column, mp != nullptr ? mp + b * end : nullptr,
                    att + b * H * D, w.scores.data());
    }
  }

  // The same from a quantized cache (`attend_code_rows`) into w.att; a norm fp16 cannot hold is refused.
  void attend_codes(Work& w, int64_t B, const at::Tensor& K, const at::Tensor& V, const Codec& ck, const Codec& cv,
                    int64_t column, const at::Tensor& mask) {
    const int64_t row = w.qkv.stride(0);
    TORCH_CHECK(cv.back.size(-1) == D_ && w.att.is_contiguous() && w.qkv.stride(1) == 1,
                "decode kernel: the codes' value width is the head dim");
    const float* qkv = w.qkv.data_ptr<float>();  // (mask: bool [B, columns], contiguous: checked by the caller)
    if (!attend_code_rows(qkv, B, row, K, V, ck, cv, column, has(mask) ? mask.data_ptr<bool>() : nullptr,
                          w.att.data_ptr<float>())) {
      refuse_norm(largest_kv_norm(qkv, B, row));
    }
  }

  // This column's keys and values of B qkv rows (`row` floats apart) encoded into the code-row stores K, V
  // [B, Hkv, capacity, bytes], then attention read from every column's codes (`decode_attend_rows`, the
  // quantized-KV kernels' one-call decode) into out [B, H * D]; mask: bool [B, column + 1] or null. False
  // where a norm exceeds fp16 (the caller refuses the call: `refuse_norm`).
  bool attend_code_rows(const float* qkv, int64_t B, int64_t row, const at::Tensor& K, const at::Tensor& V,
                        const Codec& ck, const Codec& cv, int64_t column, const bool* mask, float* out) const {
    const int64_t D = D_, H = H_, Hkv = Hkv_;
    const QueryIn q{qkv, B, H, D, row, D, 1};
    const RowsIn k{qkv + H * D, Hkv, 1, D, row, D, D}, v{qkv + (H + Hkv) * D, Hkv, 1, D, row, D, D};
    MaskIn m;  // the same for every head
    if (mask != nullptr) m.b = mask, m.s0 = column + 1, m.s3 = 1;
    return decode_attend_rows(q, k, v, ck, cv, K, V, column, m, out);
  }

  // The largest norm of the k and v heads of B qkv rows (`row` floats apart): what a refusal reports.
  float largest_kv_norm(const float* qkv, int64_t B, int64_t row) const {
    float worst = 0.0f;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t r = 0; r < 2 * Hkv_; ++r) {
        const float* x = qkv + b * row + (H_ + r) * D_;
        worst = std::max(worst, std::sqrt(dot(x, x, D_)));
      }
    }
    return worst;
  }

  // The codec's one-line refusal of a norm fp16 cannot hold (a ValueError, as its encode refuses it).
  [[noreturn]] static void refuse_norm(float worst) {
    std::ostringstream text;
    text << "a vector norm exceeds the fp16 range (65504): got " << worst << "; scale the input down";
    throw pybind11::value_error(text.str());
  }

  std::vector<std::vector<Block>> parts_;
  at::Tensor wte_, adapter_s_, ln_f_, lm_head_;
  float emb_scale_;
  int64_t H_, Hkv_, D_, h_ = 0, inner_ = 0;
  float eps_;
  Work work_;
  std::vector<std::vector<TeamBlock>> team_;  // per part (empty: no team path)
  at::Tensor team_adapter_, team_head_;  // [h, h] as [in, out]; [V, h] rows
  std::vector<float> partials_;  // [2 phases, threads, h]
  std::vector<float> shared_qkv_, shared_att_;  // (a quantized cache's: one row for thread 0's attention)
  float overflow_norm_ = -1.0f;  // (>= 0: a norm beyond fp16 in a team's call, refused after it)
  SpinBarrier barrier_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {""" + quant_cpp.codec_binding(module_local=True) + r"""
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<std::vector<std::vector<at::Tensor>>, std::vector<std::vector<at::Tensor>>,
                          std::vector<std::vector<at::Tensor>>, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                          double, int64_t, int64_t, int64_t, double,
                          std::vector<std::vector<std::vector<at::Tensor>>>, at::Tensor, at::Tensor>())
      .def("embed", &Decoder::embed)
      .def("core_steps", &Decoder::core_steps)
      .def("predict", &Decoder::predict);
  m.def("team_calls", []() { return team_calls.load(); });
}
"""

_lock = threading.Lock()
_module: Any = None
_failure: str | None = None
_cache: quant_cpp.KernelCache | None = None


def decode_enabled() -> bool:
    """False when the environment says `RDEPTH_NO_CPP_DECODE` or `RDEPTH_NO_CPP` (any value but "", "0")."""
    return quant_cpp.cpp_enabled() and os.environ.get(NO_DECODE_ENV, "") in ("", "0")


def load_decoder() -> Any:
    """The built extension (built at the first call of a machine, through `quant_cpp.kernel_cache`), or
    None where the C++ decode is off or cannot build (warned once, with the reason; the Python path runs)."""
    global _module, _failure, _cache
    if not decode_enabled():
        return None
    with _lock:
        if _module is None and _failure is None:
            try:
                _cache = quant_cpp.kernel_cache("rdepth_decode", CPP_SOURCE, WHAT)
                _module = _cache.load()
            except Exception as exc:  # no compiler, no ninja, a failing build: the Python path runs
                _failure = quant_cpp.failure_line(exc)
                log.warning("the %s are unavailable (%s); decoding through the Python path", WHAT, _failure)
    return _module


def build_decoder_ahead() -> str:
    """Load the decode kernels, building them where this machine has not (`rdepth info --build-kernels`):
    one line saying which; a RuntimeError line where they cannot build."""
    if not decode_enabled():
        return f"{WHAT}: off ({NO_DECODE_ENV} or {quant_cpp.NO_CPP_ENV} is set)"
    if load_decoder() is None:
        raise RuntimeError(f"the {WHAT} cannot build here: {_failure}")
    assert _cache is not None
    how = "already built" if _cache.built_seconds is None else f"built in {_cache.built_seconds:.1f} s"
    return f"{WHAT}: {how}, in {_cache.directory}"


def build_failure() -> str | None:
    """Why the extension did not build or load (None: it did, or it was not tried)."""
    return _failure


EMPTY = torch.empty(0)  # (an absent bias)
FLOATS: tuple[list, list] = ([], [])  # the codec lists of float stores
TEAM_DECODE = True  # one-row decode by a team of threads (`Decoder::with_team`); False: the per-product path
MAX_CODEC_LISTS = 64  # C++ codec lists kept (a cache's decode views are a handful of key tuples)


class DecodeKernel:
    """The C++ `Decoder` over one `FastRunner`'s weights (its layouts and folded biases, shared, not
    copied; the one-row team adds [in, out] copies of the MLP's tall output weights), and the per-call
    checks of what it covers (see the module docstring)."""

    def __init__(self, module: Any, runner: Any) -> None:
        model = runner.model
        cfg, t = model.config, model.transformer
        parts = {"prelude": t.prelude, "core": t.core_block, "coda": t.coda}

        def weights(block: Any, p: dict[str, Any]) -> list[Tensor]:
            norms = [n.weight.detach() for n in (block.norm_1, block.norm_2, block.norm_3, block.norm_4)]
            biases = [p[name] for name in ("qkv_bias", "proj_bias", "fc_bias", "out_bias")]
            return [*norms, *(p[name].detach() for name in ("qkv", "proj", "fc", "out")),
                    *(EMPTY if b is None else b.detach().contiguous() for b in biases)]

        def team_weights(block: Any, p: dict[str, Any]) -> list[Tensor]:
            # the qkv and fc products' [out, in] rows (the parameters themselves), proj and out as [in, out]
            linears = runner._block_linears(block)
            return [linears["qkv"].weight.detach().contiguous(), p["proj"].detach().contiguous(),
                    linears["fc"].weight.detach().contiguous(), p["out"].detach().contiguous()]

        blocks = {part: [weights(b, p) for b, p in zip(parts[part], runner.blocks[part])] for part in parts}
        team: list = []  # (none: the per-product path)
        team_adapter = team_head = EMPTY
        if TEAM_DECODE and runner.copy_weights:  # its small models (the copies of `out` double those weights)
            team = [[team_weights(b, p) for b, p in zip(parts[part], runner.blocks[part])] for part in parts]
            team_adapter = runner.adapter_s.detach().contiguous()
            team_head = model.lm_head.weight.detach().contiguous()
        self.decoder = module.Decoder(
            blocks["prelude"], blocks["core"], blocks["coda"], runner.wte.detach(), runner.adapter_s.detach(),
            t.ln_f.weight.detach(), runner.lm_head.detach(), float(runner.emb_scale), cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.norm_eps, team, team_adapter, team_head,
        )
        self.cpp_codecs = quant_cpp.CppCodes(module)  # this extension's own `Codec`s of TurboRows tables
        self._codec_lists: dict[int, tuple[list, list, list]] = {}  # by id of a views' codec list
        self.keys = {part: tuple((part, i) for i in range(len(parts[part]))) for part in ("prelude", "coda")}
        self.core_layers = len(parts["core"])
        self._core_keys: dict[range, tuple] = {}

    @staticmethod
    def mask(step: Any) -> Tensor:
        """The call's attention mask as bool `[B, columns]` (EMPTY: none); one new column per row."""
        mask = step.ctx.attn_mask
        return EMPTY if mask is None else mask.reshape(mask.shape[0], mask.shape[-1]).contiguous()

    def core_keys(self, steps: range) -> tuple:
        keys = self._core_keys.get(steps)
        if keys is None:
            keys = self._core_keys[steps] = tuple(("core", j, i) for i in steps for j in range(self.core_layers))
        return keys

    def codecs(self, views: DecodeViews) -> tuple[list, list] | None:
        """The C++ key and value codecs of `views` (empty lists for float stores), or None where a codec is
        not a TurboRows one (then the Python path reads it)."""
        pairs = views.codecs
        if pairs is None:
            return FLOATS
        found = self._codec_lists.get(id(pairs))
        if found is None or found[0] is not pairs:  # (the entry keeps `pairs` alive, so its id stays its own)
            if not all(isinstance(c, TurboRows) for pair in pairs for c in pair):
                return None
            cpu = torch.device("cpu")
            made = [[self.cpp_codecs.codec(pair[i].tables(cpu)) for pair in pairs] for i in (0, 1)]
            if len(self._codec_lists) >= MAX_CODEC_LISTS:
                self._codec_lists.clear()
            found = self._codec_lists[id(pairs)] = (pairs, made[0], made[1])
        return found[1], found[2]

    def _views(self, step: Any, keys: tuple) -> tuple[DecodeViews, list, list] | None:
        views = step.ctx.cache.decode_views(keys)
        codecs = None if views is None else self.codecs(views)
        return None if codecs is None else (views, *codecs)

    def embed(self, ids: Tensor, step: Any) -> Tensor | None:
        """e `[B, h]` for one new token per row, or None where the cache cannot be written directly."""
        found = self._views(step, self.keys["prelude"])
        if found is None:
            return None
        (ks, vs, _), cks, cvs = found
        return self.decoder.embed(ids, step.freqs, ks, vs, cks, cvs, step.ctx.past_len, self.mask(step))

    def core_steps(self, state: Tensor, injected: Tensor, steps: range, step: Any) -> Tensor | None:
        """The state `[B, h]` after core steps `steps` (see `FastRunner.core_steps`), or None."""
        found = self._views(step, self.core_keys(steps))
        if found is None:
            return None
        (ks, vs, _), cks, cvs = found
        return self.decoder.core_steps(state, injected, step.freqs, ks, vs, cks, cvs, step.ctx.past_len,
                                       self.mask(step), len(steps))

    def predict(self, state: Tensor, step: Any) -> Tensor | None:
        """Logits `[B, V]` float32 from raw states (one column per row), or None."""
        found = self._views(step, self.keys["coda"])
        if found is None:
            return None
        (ks, vs, _), cks, cvs = found
        return self.decoder.predict(state, step.freqs, ks, vs, cks, cvs, step.ctx.past_len, self.mask(step))
