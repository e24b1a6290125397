"""The serving pool's sliding-window bound: a windowed layer holds each row's recent columns only.

Oracles: each request generated alone (`generate`, its windowed cache), and the same schedule through the pool
holding every column (`RDEPTH_FULL_WINDOW_CACHE=1`). Rows of different lengths join and leave (moved rows), with
exit criteria, a KV budget and a skip lookup; prompts are longer than the windows and 40+ tokens are generated,
so each row moves its windowed columns down several times. Tokens and steps match exactly; log-probabilities to
TOL as in test_serving_batch.py (rows padded to the call's longest read round differently from a row alone,
with every column held or not), and bitwise for a row alone in the pool (its held columns start at a multiple
of `WINDOW_ALIGN`, so the attention's sums keep their lanes).
"""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference import generate
from recurrent_depth.inference.cache import FULL_WINDOW_CACHE_ENV, decoding_window_columns
from tests.serving_fixtures import serve_rows as serve

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
WINDOWS = [5, None, 3, 8]  # prelude W, core full / W, coda W (max 8)
MODES = [dict(num_steps=3), dict(num_steps=4, exit_criterion="kl", exit_threshold=1e-2),
         dict(num_steps=4, kv_budget=2), dict(num_steps=5, kv_policy="per-step+skip", exit_criterion="kl",
                                              exit_threshold=5e-2)]
PROMPTS = (21, 9, 37, 14, 26)  # longer than the windows (one shorter than the largest + alignment)
NEW = (44, 41, 47, 42, 45)


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(5)
    cfg = rd.ModelConfig.from_preset("tiny", attention_windows=WINDOWS)
    return rd.RecurrentDepthLM(cfg).eval()


def jobs() -> list[tuple[list[int], dict]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(0, 256, (n,), generator=g).tolist(),
             dict(max_new_tokens=m, init_scale=0.0, **MODES[j % len(MODES)]))
            for j, (n, m) in enumerate(zip(PROMPTS, NEW))]


def test_windowed_rows_hold_their_recent_columns_and_equal_each_request_alone(model, monkeypatch):
    work = jobs()
    out, dec, peak = serve(model, work)
    pool = dec.pool
    assert set(pool.windows) == {("prelude", 0), ("core", 1), ("coda", 0)}  # (the tiny preset: 1 + 2 + 1 layers)
    # O(W): every windowed storage holds decoding_window_columns(8) columns per row, whatever the context
    assert pool.held == decoding_window_columns(8) < max(n + m for n, m in zip(PROMPTS, NEW)) // 2
    for base in pool.windows:
        assert pool.kv[base][0].shape[3] == pool.held
    assert pool.kv[("core", 0)][0].shape[3] >= max(n + m for n, m in zip(PROMPTS, NEW))  # (no window: all)
    # (slots x rows x Cw columns x one column's bytes, per windowed layer)
    bound = sum(K.shape[0] * pool.rows * pool.held * (K[0, 0, :, 0].nbytes + V[0, 0, :, 0].nbytes)
                for base, (K, V) in pool.kv.items() if base in pool.windows)
    assert peak <= bound
    assert max(pool.first) > 0  # rows moved their windowed columns down

    for j, (prompt, kw) in enumerate(work):
        alone = generate(model, torch.tensor(prompt), seed=j, output_logits=True, **kw)
        tokens = alone.token_lists()[0]
        assert [r.token for r in out[j]] == tokens, j
        assert [r.steps for r in out[j]] == alone.steps[0, : len(tokens)].tolist(), j
        want = torch.log_softmax(alone.logits[0], -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor([r.logprob for r in out[j]]), want, rtol=0, atol=TOL)

    monkeypatch.setenv(FULL_WINDOW_CACHE_ENV, "1")
    full, full_dec, _ = serve(model, work)
    assert not full_dec.pool.windows
    for j in range(len(work)):
        assert [(r.token, r.steps) for r in out[j]] == [(r.token, r.steps) for r in full[j]], j
        torch.testing.assert_close(torch.tensor([r.logprob for r in out[j]]),
                                   torch.tensor([r.logprob for r in full[j]]), rtol=0, atol=TOL)


def test_a_row_alone_in_the_pool_reads_bitwise_what_generate_reads(model, monkeypatch):
    """One row at a time (no other row pads its reads): the bounded pool, the full one and `generate` agree
    bitwise, through moves of the windowed columns (a held range starting off a multiple of 16 would not)."""
    work = [jobs()[j] for j in (2, 3)]
    bounded, dec, _ = serve(model, work, max_rows=1)
    assert dec.pool.first[0] > 16
    monkeypatch.setenv(FULL_WINDOW_CACHE_ENV, "1")
    full, _, _ = serve(model, work, max_rows=1)
    for j, (prompt, kw) in enumerate(work):
        alone = generate(model, torch.tensor(prompt), seed=j, output_logits=True, **kw)
        tokens = alone.token_lists()[0]
        want = torch.log_softmax(alone.logits[0], -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        assert [(r.token, r.logprob) for r in bounded[j]] == list(zip(tokens, want)), j
        assert [(r.token, r.logprob) for r in full[j]] == list(zip(tokens, want)), j
