"""The C++ decode read of TurboQuant code rows (accel/quant_cpp.py) against `codes_attention` with the
eager `turbo_score` / `turbo_combine` (the reference), and through the quantized cache against decode
+ SDPA. The extension is built once per machine, torch and Python version (~30-60 s the first time,
then loaded from its cache); the module is skipped where it cannot build (no C++ compiler).

Tolerance: atol 1e-5 on attention outputs of O(1) (inputs N(0, 1)): the two float32 computations
differ only in summation order (observed <= 1e-6).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recurrent_depth.accel import quant_cpp
from recurrent_depth.accel.quant import CodeKernels
from recurrent_depth.inference.quant_cache import (
    KVQuant,
    QuantizedRecurrentCache,
    codes_attention,
    layer_codec,
    shared_codec,
)
from recurrent_depth.quant.rows import turbo_combine, turbo_encode, turbo_score
from tests.test_quant_cache import check_codes_attention_against_sdpa

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-5
SPECS = ["k=prod:3.5,v=mse:3.5,outliers=first", "k=prod:3.5,v=mse:3.5", "k=prod:2.5,v=mse:2.5", "k=mse:3,v=mse:4",
         "k=prod:3,v=prod:2",
         "k=prod:1.5,v=mse:1.5", "k=mse:1,v=mse:2", "k=prod:3.5,v=mse:3.5,outliers=calibrated",
         "k=mse:2.5,v=prod:2.5,outliers=keys"]


@pytest.fixture(scope="module")
def kernel() -> quant_cpp.CppCodes:
    module = quant_cpp.load()
    if module is None:
        pytest.skip(f"the C++ extension cannot build here: {quant_cpp.failure()}")
    return quant_cpp.CppCodes(module)


def reference(q, rows_k, rows_v, ck, cv, mask):
    tk, tv = ck.tables(q.device), cv.tables(q.device)
    return codes_attention(q, rows_k, rows_v, lambda x, rows: turbo_score(x, rows, tk),
                           lambda w, rows: turbo_combine(w, rows, tv), mask, False)


def codecs(spec, D, k, v):
    return layer_codec(spec, "k", D, k), layer_codec(spec, "v", D, v)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (3, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("S", [1, 7, 65])
def test_the_cpp_read_equals_the_eager_functions(kernel, spec, heads, S):
    H, Hkv = heads
    B, D = 2, 16
    g = torch.Generator().manual_seed(S)
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g) * 3, torch.randn(B, Hkv, S, D, generator=g)
    ck, cv = codecs(spec, D, k, v)
    split = "." in spec.split(",")[0]  # (the default rule calibrates split keys' outlier channels)
    assert (ck.perm is not None) == (split and "outliers=first" not in spec)
    rows_k, rows_v = ck.encode(k), cv.encode(v)
    pad = torch.ones(B, 1, 1, S, dtype=torch.bool)
    pad[1, ..., : S // 2] = False  # padding on the left of row 1 (none at S = 1)
    float_mask = torch.randn(B, H, 1, S, generator=g)
    for mask in (None, pad, float_mask, pad.expand(B, H, 1, S)):
        got = kernel.attend(ck.tables(q.device), cv.tables(q.device), q, rows_k, rows_v, mask)
        torch.testing.assert_close(got, reference(q, rows_k, rows_v, ck, cv, mask), atol=TOL, rtol=0)


def test_the_cpp_read_takes_slices_of_a_storage_and_head_dim_64(kernel):
    """Rows sliced out of a larger storage (strided), head dim 64 as the small model's."""
    B, H, Hkv, D, S = 1, 8, 2, 64, 33
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(B, Hkv, 40, D, generator=g), torch.randn(B, Hkv, 40, D, generator=g)
    ck, cv = codecs("k=prod:3.5,v=mse:3.5", D, k, v)
    rows_k, rows_v = ck.encode(k)[:, :, :S], cv.encode(v)[:, :, :S]
    assert not rows_k.is_contiguous()
    got = kernel.attend(ck.tables(q.device), cv.tables(q.device), q, rows_k, rows_v, None)
    torch.testing.assert_close(got, reference(q, rows_k, rows_v, ck, cv, None), atol=TOL, rtol=0)


def test_a_fully_masked_row_gives_nan_as_the_reference(kernel):
    B, H, D, S = 1, 2, 16, 5
    q, k = torch.randn(B, H, 1, D), torch.randn(B, H, S, D)
    ck, cv = codecs("k=prod:3.5,v=mse:3.5", D, k, k)
    rows = ck.encode(k), cv.encode(k)
    mask = torch.zeros(B, 1, 1, S, dtype=torch.bool)
    got = kernel.attend(ck.tables(q.device), cv.tables(q.device), q, *rows, mask)
    assert torch.isnan(got).all() and torch.isnan(reference(q, *rows, ck, cv, mask)).all()


@pytest.mark.parametrize("kv", ["k=prod:3.5,v=mse:3.5", "k=mse:2.5,v=prod:2.5,outliers=calibrated"])
def test_the_cpp_read_through_the_cache_equals_sdpa_over_the_decoded_entries(kernel, kv):
    """`CodeKernels(compile=False, cpp=True)`: the C++ read in decode calls (padding and skip masks,
    grouped-query heads, a growing sequence) vs decode + SDPA."""
    kernels = CodeKernels(compile=False, cpp=True)
    with torch.no_grad():
        check_codes_attention_against_sdpa(kv, (4, 2), kernels, decode_tokens=3)
    assert kernels.cpp_kernel() is not None


def test_the_real_build_is_recorded(kernel):
    """The build the fixture made (or found) checks out against its record, and another process loads
    it without building (`KernelCache`'s other cases: tests/test_kernel_cache.py, with fake libraries)."""
    assert quant_cpp.kernel_cache().problem() is None
    src = str(Path(quant_cpp.__file__).parents[2])
    code = ("from recurrent_depth.accel import quant_cpp\n"
            "cache = quant_cpp.kernel_cache()\nmodule = cache.load()\n"
            "print(cache.built_seconds, hasattr(module, 'attend'))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "True"]


def test_the_cpp_switch(monkeypatch):
    from recurrent_depth.accel.quant import code_kernels

    monkeypatch.setenv("RDEPTH_NO_CPP", "1")
    assert not quant_cpp.cpp_enabled()
    monkeypatch.setenv("RDEPTH_NO_COMPILE", "1")
    assert code_kernels() is None
    monkeypatch.setenv("RDEPTH_NO_CPP", "0")
    assert quant_cpp.cpp_enabled() and code_kernels() is not None


def test_the_entry_layout_matches_the_row_layout():
    """The fields of a prod split: two index fields (4 and 3 bits), two sign fields reading -1, +1."""
    codec = layer_codec(KVQuant.parse("k=prod:3.5"), "k", 16)
    t = codec.tables(torch.device("cpu"))
    layout = quant_cpp.EntryLayout(t)
    assert layout.entries == 2 * 16 and layout.layout.shape == (4, 5)
    assert layout.layout[:, 2].tolist() == [3, 2, 1, 1]  # prod:3.5 = mse 3 / 2 bits + the signs
    assert (layout.layout[2:, 3] == t.centroids.numel()).all() and layout.values[-2:].tolist() == [-1, 1]


@pytest.mark.parametrize("D", [20, 44, 76])
@pytest.mark.parametrize("spec", ["k=prod:3.5,v=mse:3.5", "k=prod:2.5,v=mse:2.5", "k=mse:4,v=prod:2"])
def test_the_cpp_read_at_fields_not_a_multiple_of_eight(kernel, spec, D):
    """Fields of 10 to 76 entries (not multiples of 8) at 1 to 4 bits: the eight-at-a-time decode (AVX2 builds) then
    the scalar one for the last entries, against the eager functions; GQA, a padding mask."""
    B, H, Hkv, S = 2, 4, 2, 11
    g = torch.Generator().manual_seed(D)
    q = torch.randn(B, H, 1, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g) * 3, torch.randn(B, Hkv, S, D, generator=g)
    ck, cv = codecs(spec, D, k, v)
    counts = {count for _, count, *_ in ck.tables(q.device).fields + cv.tables(q.device).fields}
    assert any(count % 8 and count > 8 for count in counts), counts
    rows_k, rows_v = ck.encode(k), cv.encode(v)
    pad = torch.ones(B, 1, 1, S, dtype=torch.bool)
    pad[0, ..., :3] = False
    for mask in (None, pad):
        got = kernel.attend(ck.tables(q.device), cv.tables(q.device), q, rows_k, rows_v, mask)
        torch.testing.assert_close(got, reference(q, rows_k, rows_v, ck, cv, mask), atol=TOL, rtol=0)


@pytest.mark.parametrize("spec", SPECS)
def test_the_cpp_encode_writes_the_bytes_of_turbo_encode(kernel, spec):
    """Every byte equal to the eager `turbo_encode` (indices, signs, fp16 norms, prod's residual
    byte), on 2 x 3 x 200 random vectors at head dims 16 and 64, scaled over four decades."""
    for D in (16, 64):
        g = torch.Generator().manual_seed(D)
        x = torch.randn(2, 3, 200, D, generator=g) * torch.logspace(-2, 2, 200)[:, None]
        ck, cv = codecs(spec, D, x, x)
        for codec in (ck, cv):
            t = codec.tables(x.device)
            want, finite = turbo_encode(x, t)
            got_k, got_v, got_finite = kernel.encode(t, t, x, x[:, :, :1])
            assert got_k.dtype == torch.uint8 and torch.equal(got_k, want) and bool(got_finite) == bool(finite)
            assert torch.equal(got_v, want[:, :, :1])


def test_the_cpp_encode_reports_a_norm_beyond_fp16(kernel):
    ck, cv = codecs("k=prod:3.5,v=mse:3.5", 16, None, None)
    x = torch.randn(1, 2, 1, 16)
    t = ck.tables(x.device)
    assert bool(kernel.encode(t, cv.tables(x.device), x, x)[2])
    assert not bool(kernel.encode(t, cv.tables(x.device), x * 1e6, x)[2])


def test_the_cpp_kernels_take_per_row_permutations(kernel):
    """A pool's codec stacking each batch row's calibration `[B, Hkv, D]` (`TurboRows.permuted`):
    the encode's bytes and the read equal the eager functions row by row."""
    B, Hkv, H, D, S = 2, 2, 4, 16, 9
    g = torch.Generator().manual_seed(5)
    x, q = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, H, 1, D, generator=g)
    perm = torch.stack([torch.randperm(D, generator=g) for _ in range(B * Hkv)]).view(B, Hkv, D)
    ck = shared_codec(KVQuant.parse("k=prod:2.5,v=mse:2.5"), "k", D).permuted(perm)
    cv = shared_codec(KVQuant.parse("k=prod:2.5,v=mse:2.5"), "v", D).permuted(perm)
    t, tv = ck.tables(x.device), cv.tables(x.device)
    rows_k, rows_v, _ = kernel.encode(t, tv, x, x)
    assert torch.equal(rows_k, turbo_encode(x, t)[0]) and torch.equal(rows_v, turbo_encode(x, tv)[0])
    got = kernel.attend(t, tv, q, rows_k, rows_v, None)
    torch.testing.assert_close(got, reference(q, rows_k, rows_v, ck, cv, None), atol=TOL, rtol=0)


def test_the_cpp_read_broadcasts_a_permutation_over_batch_rows(kernel):
    """A permutation `[1, Hkv, D]` (one calibration for every batch row) folded into the read (the
    shared codec's matrices, q and the output permuted per head) equals the eager read."""
    B, Hkv, H, D, S = 3, 2, 4, 16, 7
    g = torch.Generator().manual_seed(6)
    x, q = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, H, 1, D, generator=g)
    perm = torch.stack([torch.randperm(D, generator=g) for _ in range(Hkv)])[None]
    kv = KVQuant.parse("k=prod:3.5,v=mse:3.5")
    ck, cv = (shared_codec(kv, role, D).permuted(perm) for role in ("k", "v"))
    assert ck.tables(x.device).base_query is not None
    rows_k, rows_v = ck.encode(x), cv.encode(x)
    got = kernel.attend(ck.tables(x.device), cv.tables(x.device), q, rows_k, rows_v, None)
    torch.testing.assert_close(got, reference(q, rows_k, rows_v, ck, cv, None), atol=TOL, rtol=0)


class SeparateCalls(CodeKernels):
    """The C++ kernels without the fused decode call: `store`'s encode, `write_rows`, then the read."""

    def fuses(self, *args):
        return False


@pytest.mark.parametrize("kv", ["k=prod:2.5,v=mse:2.5", "k=prod:3.5,v=mse:3.5", "k=mse:3.5,v=mse:3.5",
                                "k=prod:3,v=prod:2,outliers=first"])
@pytest.mark.parametrize("policy", ["per-step+skip", "shared-2"])
def test_the_fused_decode_call_writes_and_reads_as_the_separate_calls(kernel, kv, policy):
    """`CodeRows.attend`'s one C++ call per decode call (encode into the storage's rows, then the read)
    against the encode, `write_rows` and read as separate calls: the same stored bytes and bit-identical
    attention, after a 5-token prefill, through the storage's growth (capacity 8, 9 decode tokens: those
    calls take the separate path), a padding mask, a skip lookup's hidden columns, grouped-query heads
    and an odd batch; a write mask falls back to the separate calls."""
    B, H, Hkv, D, P = 3, 6, 2, 16, 5
    g = torch.Generator().manual_seed(11)
    fused, separate = CodeKernels(compile=False, cpp=True), SeparateCalls(compile=False, cpp=True)
    calls = {"n": 0}
    run = fused.decode_attend

    def counted(*args):
        calls["n"] += 1
        return run(*args)

    fused.decode_attend = counted
    caches = [QuantizedRecurrentCache(B, 3, capacity=8, policy=policy, kv_quant=kv) for _ in range(2)]
    pad = torch.ones(B, 1, 1, P + 9, dtype=torch.bool)
    pad[1, ..., :2] = False
    with torch.no_grad():
        for n, T in enumerate([P] + [1] * 9):
            q = torch.randn(B, H, T, D, generator=g)
            k, v = torch.randn(B, Hkv, T, D, generator=g) * 2, torch.randn(B, Hkv, T, D, generator=g)
            mask = pad[..., : caches[0].seq_len + T] if T == 1 else None
            if n == 7:  # a write mask (the rows that take this token): the storage writes through write_rows
                for cache in caches:
                    cache.write_mask = torch.tensor([[True], [False], [True]])
            for step in range(3):
                key = ("core", 0, step)
                got, want = (cache.attend(key, q, k, v, mask, T > 1, kernels)
                             for cache, kernels in zip(caches, (fused, separate), strict=True))
                assert torch.equal(got, want), (n, step)
            for cache in caches:
                cache.write_mask = None
                cache.close(torch.tensor([[3] * T, [2] * T, [1] * T]))
                cache.advance(T)
    for (K1, V1), (K2, V2) in zip(caches[0].kv.values(), caches[1].kv.values(), strict=True):
        assert K1.dtype == torch.uint8 and torch.equal(K1, K2) and torch.equal(V1, V2)
    assert caches[0].capacity == 16
    # decode calls fused: all but the write-masked token's and the growing one's (3 keys each)
    assert calls["n"] == 9 * 3 - 3 - 3


@pytest.mark.parametrize("spec", ["k=prod:2.5,v=mse:2.5", "k=mse:3.5,v=prod:3,outliers=calibrated", "k=mse:4,v=mse:1"])
def test_the_plain_decode_call_writes_the_codes_and_reads_as_the_reference(kernel, spec):
    """`decode_attend(plain=True)` (the C++ decode's: the encode's products and norms by plain loops, no
    ATen call): the new column's bytes equal `turbo_encode`'s (they could differ where a rotated entry
    sits within float32 rounding of a bucket boundary: not at these seeds), the other columns untouched,
    and the read over the written rows equal to the eager read; grouped heads, a padding mask, head dims
    64 (every eight-entry group's bits from one load) and 20."""
    for D, (H, Hkv) in ((64, (4, 4)), (20, (6, 2))):
        B, S, start = 2, 12, 9
        g = torch.Generator().manual_seed(D)
        x = torch.randn(B, Hkv, S, D, generator=g) * 2
        ck, cv = codecs(spec, D, x, x)
        tk, tv = ck.tables(x.device), cv.tables(x.device)
        store_k, store_v = ck.encode(x).contiguous(), cv.encode(x).contiguous()
        before_k, before_v = store_k.clone(), store_v.clone()
        q = torch.randn(B, H, 1, D, generator=g)
        k, v = torch.randn(B, Hkv, 1, D, generator=g), torch.randn(B, Hkv, 1, D, generator=g)
        pad = torch.ones(B, 1, 1, start + 1, dtype=torch.bool)
        pad[1, ..., :3] = False
        out, finite = kernel.module.decode_attend(q, k, v, kernel.codec(tk), kernel.codec(tv), store_k, store_v,
                                                  start, pad, plain=True)
        assert finite
        for store, before, want in ((store_k, before_k, turbo_encode(k, tk)[0]), (store_v, before_v,
                                                                                   turbo_encode(v, tv)[0])):
            assert torch.equal(store[:, :, start], want[:, :, 0])
            others = torch.ones(S, dtype=torch.bool)
            others[start] = False
            assert torch.equal(store[:, :, others], before[:, :, others])
        want = reference(q, store_k[:, :, : start + 1], store_v[:, :, : start + 1], ck, cv, pad)
        torch.testing.assert_close(out, want, atol=TOL, rtol=0)
