"""A quantized windowed store of a bf16 model aligns its held columns as a bf16 store does (`read_dtype`).

A sliding-window layer reads its code rows decoded to the model's dtype, then SDPA (`CodeRows.update_heads`; only
layers without a window read the codes in float32), so with MKL's AVX-512 kernels (MKL_CBWR unset) a bf16 model's
quantized reads held from an odd multiple of 16 round 1 ulp otherwise than the full cache's in ~1 % of calls, as
bf16 rows do (k=prod:3.5,v=mse:3.5: 48 of 4,000 raw reads of 1 to 16 queries; none of 4,000 from multiples of 32).
The static cache's code rows, the dynamic reference and the serving pool used the 16-column alignment (their rows
are uint8, or the reference passed no dtype). The suite pins MKL_CBWR=AVX2,STRICT, where the alignment does not
decide that rounding (tests/test_window_s35.py), so these tests check the rule: every first held column is a
multiple of 32 for a bf16 model (the old rule gave odd multiples of 16 here), 16 for a float32 one, the tokens (and
the caches' logits) equal the full cache's, and `rdepth info` prices the code rows at the bf16 bound.
"""

from __future__ import annotations

import json

import pytest
import torch

from recurrent_depth.cli import main
from recurrent_depth.inference import session as session_module
from recurrent_depth.inference.cache import FULL_WINDOW_CACHE_ENV, decoding_window_columns, read_dtype
from recurrent_depth.inference.generate import generate
from recurrent_depth.inference.kv_codec import CodeRows, KVQuant, exact_decode_columns, shared_codec
from tests.serving_fixtures import serve_rows
from tests.test_window_s35 import VOCAB, _bf16_model, _firsts

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = "k=prod:3.5,v=mse:3.5"


def test_code_rows_are_read_in_the_dtype_they_decode_to():
    codes = CodeRows(SPEC, lambda key, k, v: None)
    rows = torch.zeros(1, 1, 4, 8, dtype=torch.uint8)
    assert read_dtype(rows, codes) is None  # (before the first store: float32's alignment)
    codes.dtype = torch.bfloat16
    assert read_dtype(rows, codes) == torch.bfloat16
    assert read_dtype(rows.float(), codes) == torch.float32  # float rows: their own (a reference's round trips)
    assert read_dtype(rows, None) == torch.uint8


def _generate(model, implementation: str, monkeypatch, bounded: bool):
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=40, num_steps=2, do_sample=False, output_logits=True,
                  init_scale=0.0, eos_token_id=[], cache_implementation=implementation, kv_quant=SPEC)
    with monkeypatch.context() as patch:
        firsts = _firsts(patch, implementation)
        if not bounded:
            patch.setattr(session_module, "layer_windows", lambda *args, **kwargs: {})
        return generate(model, ids, **kwargs), firsts


@pytest.mark.parametrize("implementation", ["static", "dynamic"])
def test_a_bf16_models_quantized_cache_holds_from_multiples_of_32_and_equals_the_full_cache(implementation,
                                                                                          monkeypatch):
    monkeypatch.delenv(FULL_WINDOW_CACHE_ENV, raising=False)
    model = _bf16_model([5, 9, None, 5])
    bounded, firsts = _generate(model, implementation, monkeypatch, bounded=True)
    # (with 16-column alignment W = 5 first holds from 16 on column 20 on)
    assert max(firsts) >= 32 and all(f % 32 == 0 for f in firsts)
    full, _ = _generate(model, implementation, monkeypatch, bounded=False)
    assert torch.equal(bounded.sequences, full.sequences)
    assert torch.equal(bounded.logits, full.logits)
    assert bounded.cache_allocated_bytes < full.cache_allocated_bytes


def test_a_float32_models_quantized_cache_keeps_the_16_column_alignment(monkeypatch):
    monkeypatch.delenv(FULL_WINDOW_CACHE_ENV, raising=False)
    model = _bf16_model([5, 9, None, 5]).float()
    _, firsts = _generate(model, "static", monkeypatch, bounded=True)
    assert all(f % 16 == 0 for f in firsts) and any(f % 32 for f in firsts)


def test_a_bf16_quantized_serving_pool_aligns_its_rows_to_32_and_equals_the_full_pool(monkeypatch):
    monkeypatch.delenv(FULL_WINDOW_CACHE_ENV, raising=False)
    model = _bf16_model([5, None, 9, 5])
    g = torch.Generator().manual_seed(11)
    work = [(torch.randint(0, VOCAB, (n,), generator=g).tolist(),
             dict(max_new_tokens=m, num_steps=2, init_scale=0.0, eos_token_id=[]))
            for n, m in ((9, 30), (21, 40))]
    out, dec, _ = serve_rows(model, work, max_rows=2, kv_quant=SPEC)
    pool = dec.pool
    assert pool.codes is not None and pool.codes.dtype == torch.bfloat16
    assert pool.dtype == torch.bfloat16 and pool.held == decoding_window_columns(pool.reach, torch.bfloat16)
    assert all(pool.kv[base][0].shape[3] == pool.held for base in pool.windows)
    assert max(pool.first) >= 32 and all(f % 32 == 0 for f in pool.first)
    monkeypatch.setenv(FULL_WINDOW_CACHE_ENV, "1")  # the same schedule through a pool holding every column
    full, full_dec, _ = serve_rows(model, work, max_rows=2, kv_quant=SPEC)
    assert not full_dec.pool.windows
    for j in range(len(work)):
        assert [r.token for r in out[j]] == [r.token for r in full[j]], j


def test_info_prices_a_quantized_windowed_store_at_the_bf16_bound(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(FULL_WINDOW_CACHE_ENV, raising=False)
    model = _bf16_model([13, 13, 13, 13])
    config = model.config
    config.to_json(tmp_path / "config.json")
    assert main(["info", "--model", str(tmp_path), "--kv-quant", SPEC, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    decoding = info["cache_bytes_at_max_seq_len_quantized_autoregressive_by_kv_policy"]["per-step+deepest"]
    per_token = info["kv_cache_bytes_per_token_quantized_by_kv_policy"]["per-step+deepest"]
    kv_quant = KVQuant.parse(SPEC)
    floor = exact_decode_columns((shared_codec(kv_quant, "k", config.head_dim),
                                  shared_codec(kv_quant, "v", config.head_dim)))
    columns = decoding_window_columns(max(13, floor), torch.bfloat16)
    assert columns == 2 * 13 + 31 < config.max_seq_len  # (float32's alignment: 2W + 15)
    assert decoding == per_token * columns
