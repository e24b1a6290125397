"""`rdepth info`'s autoregressive-decoding price still is what a windowed cache allocates now that a windowed read
after a drop returns at least `read_floor(head_dim)` columns (zeros before the held ones): the zeros are built per
read, never held, so neither the generation cache's stores nor the serving pool's grow.

At head dim 16 (`read_floor` 32) with W = 8 every read after a drop holds fewer than 32 columns, so every one of
them is padded: the reads below return up to 63 columns from stores of at most 47 (bf16; 31 for code rows)."""

from __future__ import annotations

import json

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.inference import cache as cache_module
from recurrent_depth.inference.cache import FULL_WINDOW_CACHE_ENV, decoding_window_columns, read_floor
from recurrent_depth.inference.generate import generate
from recurrent_depth.serving.kv_pool import SlotKVPool
from tests.serving_fixtures import serve_rows

pytestmark = pytest.mark.usefixtures("one_thread")

# W = 8 from a 4-token prompt reaches the bf16 bound (2W + 31 = 47 columns) before column 112 (tests/test_gaps_s33.py)
WINDOW, CONTEXT, PROMPT, HEAD_DIM = 8, 112, 4, 16
SPEC = "k=prod:3.5,v=mse:3.5"


def _config() -> rd.ModelConfig:
    return rd.ModelConfig(vocab_size=64, hidden_size=2 * HEAD_DIM, num_heads=2, num_kv_heads=2, intermediate_size=96,
                          prelude_layers=1, core_layers=2, coda_layers=1, max_seq_len=CONTEXT, mean_recurrence=2,
                          attention_windows=[WINDOW] * 4)


def _info(tmp_path, capsys, *flags: str) -> dict:
    _config().to_json(tmp_path / "config.json")
    assert main(["info", "--model", str(tmp_path), "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def _model() -> rd.RecurrentDepthLM:
    torch.manual_seed(0)
    return rd.RecurrentDepthLM(_config()).to(torch.bfloat16).eval()


def _record(monkeypatch) -> dict[str, int]:
    """Over a `generate`: the most bytes the windowed stores allocated at once, the longest store (columns), the
    longest read (columns) and the most zero columns a read returned before its first held one."""
    seen = {"bytes": 0, "store": 0, "read": 0, "zeros": 0}
    write_rows = cache_module.StaticRecurrentCache.write_rows

    def recording(self, key, k, v):
        out = write_rows(self, key, k, v)
        base = self.split(key)[0]
        seen["bytes"] = max(seen["bytes"], sum(K.nbytes + V.nbytes for K, V in self.kv.values()))
        seen["store"] = max(seen["store"], self.kv[base][0].shape[3])
        seen["read"] = max(seen["read"], out[0].shape[2])
        seen["zeros"] = max(seen["zeros"], self.first.get(base, 0) - self.first_column(key))
        return out

    monkeypatch.setattr(cache_module.StaticRecurrentCache, "write_rows", recording)
    return seen


@pytest.mark.parametrize("kv_quant", [None, SPEC])
def test_info_prices_what_generate_allocates_with_floored_reads(kv_quant, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(FULL_WINDOW_CACHE_ENV, raising=False)
    info = _info(tmp_path, capsys, *(["--kv-quant", kv_quant] if kv_quant else []))
    price = (info["cache_bytes_at_max_seq_len_bf16_autoregressive"] if kv_quant is None
             else info["cache_bytes_at_max_seq_len_quantized_autoregressive_by_kv_policy"]["per-step+deepest"])
    seen = _record(monkeypatch)
    prompt = torch.randint(0, 64, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    out = generate(_model(), prompt, max_new_tokens=CONTEXT - PROMPT, num_steps=2, do_sample=False, eos_token_id=[],
                   init_scale=0.0, kv_quant=kv_quant)
    held = decoding_window_columns(WINDOW, torch.bfloat16 if kv_quant is None else None)  # (code rows: float32's)
    assert seen["store"] == held and seen["bytes"] == price  # the bound is reached, and priced exactly
    assert out.cache_allocated_bytes <= price and int(out.cache_bytes.max()) <= price
    # the floor's zeros came back with reads longer than any store (so built per read, not held)
    assert seen["zeros"] == read_floor(HEAD_DIM) == 32 and seen["read"] > held


def test_the_serving_pool_allocates_infos_price_per_row_with_floored_reads(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(FULL_WINDOW_CACHE_ENV, raising=False)
    price = _info(tmp_path, capsys)["cache_bytes_at_max_seq_len_bf16_autoregressive"]
    g = torch.Generator().manual_seed(2)
    work = [(torch.randint(0, 64, (n,), generator=g).tolist(),
             dict(max_new_tokens=m, num_steps=2, init_scale=0.0, eos_token_id=[])) for n, m in ((4, 60), (30, 50))]
    pads = [0]
    pool_write = SlotKVPool.write_rows

    def recording(self, key, k, v):
        out = pool_write(self, key, k, v)
        pads.append(self._pad)
        return out

    monkeypatch.setattr(SlotKVPool, "write_rows", recording)
    _, dec, peak = serve_rows(_model(), work, max_rows=2)
    assert dec.pool.rows == 2 and peak == dec.pool.nbytes() == 2 * price
    assert max(pads) == read_floor(HEAD_DIM)  # (its reads were floored: the zeros are not in the pool's bytes)

