"""A windowed read holds at least `MIN_READ_COLUMNS` columns (`inference.cache.read_start`): torch's CPU softmax sums a
row shorter than its float vector in another order than a longer row, so a soft-capped layer's plain attention
(`eager_attention`) over the 8 to 15 columns a window of 8 holds after a drop rounded otherwise than the full cache's
read (float32 logits ~5e-7 apart from the first drop on; a bf16 retrofitted Gemma-2 0.06, with or without 32-column
alignment of its quantized stores). Reads start 16 columns earlier there, as zeros outside every window."""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference.cache import FULL_WINDOW_CACHE_ENV, MIN_READ_COLUMNS, read_start
from recurrent_depth.inference.generate import generate

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 96


def test_a_read_holding_fewer_than_min_read_columns_starts_that_many_earlier():
    assert MIN_READ_COLUMNS == 16
    assert read_start(0, 9) == 0  # (nothing before column 0)
    assert read_start(32, 41) == 16 and read_start(32, 47) == 16
    assert read_start(32, 48) == 32  # 16 held: as held
    assert read_start(512, 520) == 0  # a block's first column: the whole block before, as the full read's blocks
    assert read_start(1008, 1030) == 512  # (crossing a block boundary: from its block's start, as before)


@pytest.mark.parametrize("kv_quant", [None, "k=prod:3.5,v=mse:3.5,window=8"], ids=["float", "quantized-window"])
def test_a_soft_capped_windowed_cache_keeps_the_full_caches_logits_bitwise(kv_quant, monkeypatch):
    """float32, head dim 64 (where the plain attention's matmuls do not round by the columns read), windows of 8
    on a mixed windowed / full layout, a bf16 recent-token window of 8 too: bitwise past the drops."""
    cfg = rd.ModelConfig(vocab_size=VOCAB, hidden_size=128, num_heads=2, num_kv_heads=1, intermediate_size=96,
                         prelude_layers=2, core_layers=2, coda_layers=2, max_seq_len=256,
                         attention_windows=[8, None, 8, None, 8, None], attn_logit_softcapping=50.0)
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(cfg).eval()
    prompt = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    outs = []
    for full in ("", "1"):  # windowed (drops from column 24 on), then every column kept
        monkeypatch.setenv(FULL_WINDOW_CACHE_ENV, full)
        outs.append(generate(model, prompt, max_new_tokens=24, num_steps=2, init_scale=0.0, output_logits=True,
                             eos_token_id=[], kv_quant=kv_quant))
    windowed, whole = outs
    assert windowed.cache_allocated_bytes < whole.cache_allocated_bytes  # (the windowed layers dropped columns)
    assert torch.equal(windowed.sequences, whole.sequences)
    assert torch.equal(windowed.logits, whole.logits)
