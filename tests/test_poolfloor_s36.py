"""A windowed read after a drop holds at least `read_floor` columns, as zeros before its first held one, in the
serving pool too (`SlotKVPool._read_pad`), and more at head dims under 25 (`inference.cache.read_floor`).

The pool read its held positions [0, Lw) without the generation cache's floor (`MIN_READ_COLUMNS`), so a row whose
prompt left it holding 8 to 15 columns read a soft-capped (plain math, `eager_attention`) layer otherwise than
`generate` and the full pool (float32, head dim 64, window 8: log-probabilities 2e-7 apart in 7 of 8 prompts; reading
more held positions after the row's own column does not help: MKL's q @ k^T rounds a read's last n % 8 columns in
another kernel, so a read must end at the row's column, with zeros before). At head dim 16 the floor of 16 was not
enough: a decode read of under 25 columns (D x columns < 400, `kv_codec.SMALL_MATMUL`) multiplies in aten's
small-bmm loop, the full read in MKL, logits ~5e-7 apart; `read_floor` (32 at D = 16) makes both MKL's."""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference.cache import (
    FULL_WINDOW_CACHE_ENV,
    MIN_READ_COLUMNS,
    floored_start,
    read_floor,
    read_start,
)
from recurrent_depth.inference.generate import generate
from recurrent_depth.model.mixers.attention import eager_attention
from recurrent_depth.serving.kv_pool import SlotKVPool
from tests.serving_fixtures import serve_rows

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 96


def test_the_read_floor_rises_where_a_decode_matmul_would_take_the_small_loop():
    assert read_floor() == read_floor(64) == read_floor(25) == read_floor(256) == MIN_READ_COLUMNS
    assert read_floor(24) == read_floor(16) == 32 and read_floor(8) == 64
    assert read_start(64, 73, 32) == 32 and read_start(64, 96, 32) == 64  # 32 held: as held
    assert read_start(32, 41, 64) == 0  # (nothing before column 0)
    assert read_start(528, 537, 32) == 0  # 32 earlier is the block before: from its start, as the full read's blocks
    assert floored_start(512, 520) == 0 and floored_start(0, 5) == 0
    assert read_start(1008, 1030, 32) == 512  # (crossing a block boundary: from its block's start, as before)


@pytest.mark.parametrize("head_dim", [8, 16, 64])
def test_eager_attention_over_a_floored_windowed_read_is_the_full_reads_bitwise(head_dim):
    """torch only: the windowed read [read_start, c], zeros before the held columns, against [0, c]."""
    g = torch.Generator().manual_seed(head_dim)
    window, floor = 8, read_floor(head_dim)
    for column in range(24, 90, 5):
        for queries in (1, 3):
            first = (column - queries + 1 - window + 1) // 16 * 16
            start = read_start(first, column + 1, floor)
            q = torch.randn(1, queries, 2, head_dim, generator=g)
            k, v = (torch.randn(1, column + 1, 1, head_dim, generator=g) for _ in range(2))
            cols, qcols = torch.arange(column + 1), torch.arange(column + 1 - queries, column + 1)[:, None]
            mask = ((cols <= qcols) & (cols > qcols - window))[None, None]
            full, _ = eager_attention(q, k, v, mask, False, head_dim**-0.5, 50.0)
            k_w, v_w = (torch.cat([torch.zeros(1, first - start, 1, head_dim), x[:, first:]], 1) for x in (k, v))
            windowed, _ = eager_attention(q, k_w, v_w, mask[..., start:], False, head_dim**-0.5, 50.0)
            assert torch.equal(windowed, full), (column, queries)


def _soft_capped(hidden: int) -> rd.RecurrentDepthLM:
    cfg = rd.ModelConfig(vocab_size=VOCAB, hidden_size=hidden, num_heads=2, num_kv_heads=1, intermediate_size=96,
                         prelude_layers=2, core_layers=2, coda_layers=2, max_seq_len=256,
                         attention_windows=[8, None, 8, None, 8, None], attn_logit_softcapping=50.0)
    torch.manual_seed(0)
    return rd.RecurrentDepthLM(cfg).eval()


def _alone(model, prompt: list[int], kw: dict) -> list[tuple[int, int, float]]:
    out = generate(model, torch.tensor(prompt), output_logits=True, **kw)
    tokens = out.token_lists()[0]
    logp = torch.log_softmax(out.logits[0], -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    return list(zip(tokens, out.steps[0, : len(tokens)].tolist(), logp.tolist()))


@pytest.mark.parametrize("hidden", [128, 32], ids=["head-dim-64", "head-dim-16"])
def test_a_soft_capped_row_served_past_its_prompts_drop_is_generate_and_the_full_pool_bitwise(hidden, monkeypatch):
    """A 24-token prompt leaves its row holding columns 16.. (9 to 15 of them for its next tokens): the pool and
    `generate` (windowed and full) agree bitwise, log-probabilities included."""
    model = _soft_capped(hidden)
    prompt = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    kw = dict(max_new_tokens=12, num_steps=2, init_scale=0.0, eos_token_id=[])
    runs = []
    for full in ("", "1"):
        monkeypatch.setenv(FULL_WINDOW_CACHE_ENV, full)
        out, dec, _ = serve_rows(model, [(prompt, kw)], max_rows=1)
        assert bool(dec.pool.windows) == (not full) and dec.pool.first[0] == (0 if full else 16)
        runs += [[(r.token, r.steps, r.logprob) for r in out[0]], _alone(model, prompt, kw)]
    assert all(run == runs[3] for run in runs)  # (the full cache's generate)


def test_a_batch_pads_its_windowed_reads_only_where_every_row_dropped_that_many_columns():
    """Zeros stand for columns a row dropped (outside its window); a row that dropped none would see them."""
    pool = SlotKVPool(windows={("prelude", 0): 8}, head_dim=64)
    pool.first = [16, 32, 0, 512]
    assert pool._read_pad([0], 9) == 16 and pool._read_pad([0, 1], 9) == 16
    assert pool._read_pad([0, 1], 16) == 0  # (16 held positions read)
    assert pool._read_pad([0, 2], 9) == 0  # row 2 dropped nothing
    assert pool._read_pad([3], 9) == 512 and pool._read_pad([0, 3], 9) == 0  # (512 zeros: more than row 0 dropped)
