"""A bf16 model's serving pool, quantized or not, against each request generated alone (docs/serving.md).

Reported: a bf16 model with sliding windows served from a quantized pool (`k=prod:3.5,v=mse:3.5`) gave some
requests other greedy tokens in a batch than alone. Measured (tiny bf16 model, windows [5, 9, full, 5], 2-4 rows,
30 greedy tokens, 4 seeds: 36 requests per case): quantized 3 of 36 differ, unquantized 0 of 36 but its
log-probabilities differ from alone's too (up to ~8e-3, bf16 rounding), float32 none (~5e-7). The cause is the
batch's attention read, not the codec: a windowed layer (and every layer of an unquantized pool) runs one SDPA over
every row's held columns, a shorter row's padded to the longest row's and masked, and CPU SDPA rounds a padded
read otherwise than the row's own (1 ulp of the output in ~1 of 5 random bf16 reads). The codec's encode and decode
are batch invariant and its per-row state (each row's calibrated channel order) stays with its row: with each row's
SDPA run over its own columns only, every request's tokens and steps equal `generate` alone, rows joining, leaving
and moving, and its log-probabilities to bf16 rounding (the linear layers' bf16 GEMMs of B rows still round a row
otherwise than alone in ~1 of 500 rows: 3.4e-4 here at one token of the float pool; a row given another row's
state reads other codes or keys, ~0.1 and more). A row alone in the pool reads bitwise what `generate` reads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import recurrent_depth as rd
from recurrent_depth.inference.generate import generate
from tests.serving_fixtures import serve_rows
from tests.test_window_s35 import VOCAB, _bf16_model

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = "k=prod:3.5,v=mse:3.5"  # a channel split: each row's outlier channels calibrated from its own prompt
WINDOWS = [5, 9, None, 5]
BF16_TOL = 1e-2  # a log-probability's bf16 rounding (a logit's ulp at |logit| ~ 2: 7.8e-3)


def _per_row_sdpa(sdpa):
    """SDPA run row by row, each row's keys cut after its last visible column: the read a row alone makes."""

    def attention(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        if attn_mask is None or attn_mask.dtype != torch.bool or q.shape[0] == 1:
            return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)
        out = []
        for b in range(q.shape[0]):
            mask = attn_mask[b if attn_mask.shape[0] > 1 else 0]
            visible = mask.reshape(-1, mask.shape[-1]).any(0).nonzero()
            n = int(visible.max()) + 1 if len(visible) else mask.shape[-1]
            out.append(sdpa(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], attn_mask=mask[None, ..., :n],
                            is_causal=is_causal, **kwargs))
        return torch.cat(out)

    return attention


def _jobs(seed: int) -> list[tuple[list[int], dict]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (n,), generator=g).tolist(),
             dict(max_new_tokens=m, num_steps=2, init_scale=0.0, eos_token_id=[]))
            for n, m in ((9, 24), (21, 14), (14, 20), (30, 12))]


def _alone(model, prompt: list[int], kw: dict, spec: str | None) -> list[tuple[int, int, float]]:
    out = generate(model, torch.tensor(prompt), output_logits=True, kv_quant=spec, **kw)
    tokens = out.token_lists()[0]
    logp = torch.log_softmax(out.logits[0].float(), -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    return list(zip(tokens, out.steps[0, : len(tokens)].tolist(), logp.tolist()))


@pytest.mark.parametrize("spec", [SPEC, None], ids=["quantized", "float"])
def test_bf16_pool_rows_equal_each_request_alone_once_the_padded_read_is_the_rows_own(spec, monkeypatch):
    """No state crosses rows: with the padding's rounding taken out, 4 requests through 3 rows (the 4th joins
    where the first left, a row moves into the freed place) are `generate` alone to the GEMMs' bf16 rounding."""
    model = _bf16_model(WINDOWS)
    monkeypatch.setattr(F, "scaled_dot_product_attention", _per_row_sdpa(F.scaled_dot_product_attention))
    work = _jobs(5)
    out, dec, _ = serve_rows(model, work, max_rows=3, kv_quant=spec)
    assert dec.pool.windows and (spec is not None or dec.pool.dtype == torch.bfloat16)
    assert (dec.pool.codes is not None) == (spec is not None)
    if spec is not None:  # each row's own calibrated channel order (the per-row codec state under test)
        assert dec.pool.orders
    for j, (prompt, kw) in enumerate(work):
        tokens, steps, logp = zip(*_alone(model, prompt, kw, spec))
        assert [(r.token, r.steps) for r in out[j]] == list(zip(tokens, steps)), j
        torch.testing.assert_close(torch.tensor([r.logprob for r in out[j]]), torch.tensor(logp), rtol=0,
                                   atol=BF16_TOL)


def test_a_row_alone_in_a_bf16_quantized_windowed_pool_is_generate_bitwise():
    """Unpatched SDPA: one row has no other row's padding, so its read is `generate`'s."""
    model = _bf16_model(WINDOWS)
    prompt, kw = _jobs(5)[1]
    kw = dict(kw, max_new_tokens=40)  # past the windows' room: the row moves its held columns down
    out, dec, _ = serve_rows(model, [(prompt, kw)], max_rows=1, kv_quant=SPEC)
    assert dec.pool.first[0] >= 32
    assert [(r.token, r.steps, r.logprob) for r in out[0]] == _alone(model, prompt, kw, SPEC)


@pytest.mark.parametrize("windows", [[16, None, 16, None, 16, None], [16] * 6], ids=["mixed", "all-windowed"])
def test_a_quantized_cache_with_a_recent_window_keeps_the_full_caches_logits_in_bf16(windows, monkeypatch):
    """docs/inference.md: a quantized windowed cache's logits are bitwise the same quantized cache keeping every
    column, its bf16 recent-token window (`window=`) included, past the first drop, on a mixed windowed / full
    layout with soft-capped attention. (The retrofitted Gemma-2 divergence once blamed on aligning a bf16 model's code
    rows to 32 was a softmax over fewer than 16 held columns, at either alignment: `MIN_READ_COLUMNS`,
    tests/test_kvqwin_s36.py.)"""
    cfg = rd.ModelConfig(vocab_size=VOCAB, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=96,
                         prelude_layers=2, core_layers=2, coda_layers=2, max_seq_len=256, attention_windows=windows,
                         attn_logit_softcapping=50.0)  # (as the retrofitted Gemma-2 that showed it)
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(cfg).to(torch.bfloat16).eval()
    prompt = torch.randint(0, VOCAB, (1, 51), generator=torch.Generator().manual_seed(0))
    logits = []
    for full in ("", "1"):
        monkeypatch.setenv("RDEPTH_FULL_WINDOW_CACHE", full)
        logits.append(generate(model, prompt, max_new_tokens=30, num_steps=4, init_scale=0.0, output_logits=True,
                               eos_token_id=[], kv_quant=SPEC + ",window=8").logits)
    assert torch.equal(logits[0], logits[1])
