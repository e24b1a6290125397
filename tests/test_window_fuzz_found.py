"""What the seeded differential fuzzer of the sliding-window KV bound found (bounded cache vs
`RDEPTH_FULL_WINDOW_CACHE=1`, bitwise): a window crossing column 512 read differently from the full cache, as CPU
SDPA reduces a decode query's keys in blocks of 512 columns from the first column it is given."""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference.cache import (
    FULL_WINDOW_CACHE_ENV,
    SDPA_KV_BLOCK,
    decoding_window_columns,
    make_cache,
    read_start,
    window_align,
    window_start,
)
from recurrent_depth.inference.generate import generate

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 61


def _generate(monkeypatch, bounded: bool, window: int, prompt: int, new: int, max_seq_len: int = 640,
              **options) -> rd.GenerationOutput:
    cfg = rd.ModelConfig(vocab_size=VOCAB, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=40,
                         prelude_layers=1, core_layers=1, coda_layers=1, max_seq_len=max_seq_len,
                         attention_windows=[window, window, None])
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    ids = torch.randint(0, VOCAB, (1, prompt), generator=torch.Generator().manual_seed(1))
    with monkeypatch.context() as patch:
        if bounded:
            patch.delenv(FULL_WINDOW_CACHE_ENV, raising=False)
        else:
            patch.setenv(FULL_WINDOW_CACHE_ENV, "1")  # (read when generation builds its cache)
        return generate(model, ids, max_new_tokens=new, num_steps=2, init_scale=0.0, output_logits=True,
                        eos_token_id=[], do_sample=False, **options)


@pytest.mark.parametrize("kv_quant", [None, "k=mse:4,v=mse:4"])
def test_a_window_crossing_column_512_gives_the_full_cache_logits_bitwise(monkeypatch, kv_quant):
    """Prompt 490, W = 32: the held columns cross column 512 from the 24th new token on; the old read of the held
    columns alone differed from the full cache's by ~1e-4 in the logits (SDPA's key blocks started at the first
    held column, not at column 0)."""
    bounded = _generate(monkeypatch, True, 32, 490, 40, kv_quant=kv_quant)
    full = _generate(monkeypatch, False, 32, 490, 40, kv_quant=kv_quant)
    assert torch.equal(bounded.sequences, full.sequences)
    assert torch.equal(bounded.logits, full.logits)
    assert bounded.cache_allocated_bytes < full.cache_allocated_bytes  # (still bounded: the prefix is not held)


def test_read_start_goes_back_to_the_block_a_read_crosses():
    assert read_start(496, 512) == 496  # within block 0
    assert read_start(496, 513) == 0  # crosses column 512: from block 0's start
    assert read_start(512, 600) == 512  # starts a block
    assert read_start(1040, 1100) == 1040
    assert read_start(1000, 1100) == SDPA_KV_BLOCK


def test_a_dynamic_windowed_read_across_a_block_is_prefixed_with_zero_columns():
    """The plain reference pads as the static cache does: the same columns, zeros before its first held one."""
    reads = {}
    for implementation in ("static", "dynamic"):
        cache = make_cache(implementation, 1, 1, capacity=600, windows={("prelude", 0): 4})
        gen = torch.Generator().manual_seed(0)
        for _ in range(515):
            k, v = torch.randn(1, 1, 1, 2, generator=gen), torch.randn(1, 1, 1, 2, generator=gen)
            reads[implementation] = cache.update_kv(("prelude", 0), k, v)
            cache.close(1, 1)
            cache.advance(1)
        assert 0 < cache.first[("prelude", 0)] < SDPA_KV_BLOCK and cache.first_column(("prelude", 0)) == 0
    K, V = reads["static"]
    assert K.shape[1] == 515 and torch.equal(K, reads["dynamic"][0]) and torch.equal(V, reads["dynamic"][1])
    assert not K[0, : 512 - 16].any()  # (columns no window sees: zeros, masked)


def test_a_window_of_a_block_or_more_starts_its_held_columns_on_a_block_and_reads_without_a_copy(monkeypatch):
    """W >= 512 crosses an SDPA block at nearly every read: its held columns start on a block (`window_align`), so
    `read_start` never pads (no per-read copy), and the logits stay bitwise the full cache's."""
    assert window_align(SDPA_KV_BLOCK) == SDPA_KV_BLOCK and window_align(SDPA_KV_BLOCK - 1) == 16
    assert window_start(1100, 512) == 512 and window_start(1100, 64) == 1024
    assert decoding_window_columns(512) == 2 * 512 + SDPA_KV_BLOCK - 1
    # (a 600-token prompt allocates 600 + W columns: the first drop comes at column 1112, holding from 512 on)
    bounded = _generate(monkeypatch, True, 512, 600, 540, max_seq_len=1140)
    full = _generate(monkeypatch, False, 512, 600, 540, max_seq_len=1140)
    assert torch.equal(bounded.sequences, full.sequences)
    assert torch.equal(bounded.logits, full.logits)
    assert bounded.cache_allocated_bytes < full.cache_allocated_bytes
    cache = make_cache("static", 1, 1, capacity=1300, windows={("prelude", 0): SDPA_KV_BLOCK})
    K = None
    for _ in range(1200):  # (one write a column, as decoding writes)
        K, _ = cache.update_kv(("prelude", 0), torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
        cache.close(1, 1)
        cache.advance(1)
        first = cache.first.get(("prelude", 0), 0)
        assert first % SDPA_KV_BLOCK == 0 and cache.first_column(("prelude", 0)) == first  # (no zero prefix)
    assert cache.first[("prelude", 0)] == SDPA_KV_BLOCK and K.shape[1] == 1200 - SDPA_KV_BLOCK and K.all()
