"""The serving pool's sliding-window bound under `--kv-quant`: a windowed layer holds each row's recent code rows.

As tests/test_serve_window_pool.py for float entries, with a quantized pool: a plain codec, one with a bf16
recent-token window (its entries are tagged with absolute columns and written back at each row's own held
position) and a calibrated channel split at head dim 8 (its decode floor, `exact_decode_columns` = 7, is more than
the windows: the rows hold at least that many columns). Oracles: each request generated alone with the same spec,
and the same schedule through the quantized pool holding every column (`RDEPTH_FULL_WINDOW_CACHE=1`). Rows join
and leave (moved rows), with exit criteria, a KV budget and a skip lookup, and move their windowed columns down.
Tokens and steps match exactly, log-probabilities to TOL (test_serving_kv_quant.py's), and bitwise for a row
alone in the pool.
"""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference import generate
from recurrent_depth.inference.cache import FULL_WINDOW_CACHE_ENV, decoding_window_columns
from recurrent_depth.inference.kv_codec import exact_decode_columns, layer_codec
from recurrent_depth.serving.batch import BatchDecoder
from recurrent_depth.serving.kv_pool import QuantizedSlotKVPool
from tests.serving_fixtures import serve_rows

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-4
WINDOWS = [3, 2, None, 4]  # prelude W, core W / full, coda W (largest 4)
SPECS = {
    "plain": "k=mse:4,v=mse:4",
    "recent-window": "k=prod:2.5,v=mse:2.5,window=6",
    "calibrated-split": "k=mse:3.5,v=mse:3.5,outliers=calibrated",
}
MODES = [dict(num_steps=2), dict(num_steps=3, exit_criterion="kl", exit_threshold=1e-2),
         dict(num_steps=3, kv_budget=2), dict(num_steps=3, kv_policy="per-step+skip", exit_criterion="kl",
                                              exit_threshold=5e-2)]
# every row runs past its room (29 columns from its first held one, a multiple of 16) and moves its columns down
PROMPTS = (21, 37, 53, 36)
NEW = (12, 10, 14, 11)


def build(layout: str = "sandwich") -> rd.RecurrentDepthLM:
    """Head dim 8, 2 KV heads; Huginn's layout runs the batch's fused runner, a pre-norm one the model's modules."""
    torch.manual_seed(3)
    cfg = rd.ModelConfig(vocab_size=256, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=40,
                         prelude_layers=1, core_layers=2, coda_layers=1, max_seq_len=256, attention_windows=WINDOWS,
                         block_layout=layout)
    return rd.RecurrentDepthLM(cfg).eval()


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    return build()


def jobs() -> list[tuple[list[int], dict]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, 256, (n,), generator=g).tolist(), dict(max_new_tokens=m, init_scale=0.0, **mode))
            for n, m, mode in zip(PROMPTS, NEW, MODES)]


def serve(model, work, spec: str, max_rows: int = 3) -> tuple[dict[int, list], BatchDecoder, int]:
    """`serving_fixtures.serve_rows` with the quantized pool of `spec`."""
    return serve_rows(model, work, max_rows, kv_quant=spec)


def alone(model, prompt: list[int], kw: dict, seed: int, spec: str) -> tuple[list[int], list[int], list[float]]:
    """(tokens, steps, each token's log-probability) of `generate` alone with `spec`."""
    out = generate(model, torch.tensor(prompt), seed=seed, output_logits=True, kv_quant=spec, **kw)
    tokens = out.token_lists()[0]
    logp = torch.log_softmax(out.logits[0], -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    return tokens, out.steps[0, : len(tokens)].tolist(), logp.tolist()


@pytest.mark.parametrize(("spec", "layout"), [(spec, "sandwich") for spec in SPECS.values()]
                         + [(SPECS["plain"], "pre-norm")], ids=[*SPECS, "plain-reference-runner"])
def test_quantized_windowed_rows_hold_their_recent_code_rows_and_equal_each_request_alone(model, spec, layout,
                                                                                         monkeypatch):
    monkeypatch.delenv(FULL_WINDOW_CACHE_ENV, raising=False)
    model = model if layout == "sandwich" else build(layout)
    work = jobs()
    out, dec, peak = serve(model, work, spec)
    pool = dec.pool
    assert isinstance(pool, QuantizedSlotKVPool)
    assert set(pool.windows) == {("prelude", 0), ("core", 0), ("coda", 0)}
    # the rows hold at least the columns a code row's decode needs to round as a longer read (head dim 8: 7)
    floor = exact_decode_columns((layer_codec(spec, "k", 8), layer_codec(spec, "v", 8)))
    assert floor == 7 and pool.reach == max(4, floor)
    # O(W): every windowed storage holds decoding_window_columns(reach) code rows per row, whatever the context
    assert pool.held == decoding_window_columns(pool.reach) < max(n + m for n, m in zip(PROMPTS, NEW)) // 2
    for base, (K, V) in pool.kv.items():
        assert K.dtype == V.dtype == torch.uint8
        assert K.shape[3] == (pool.held if base in pool.windows else pool.capacity)
    bound = sum(K.shape[0] * pool.rows * pool.held * (K[0, 0, :, 0].nbytes + V[0, 0, :, 0].nbytes)
                for base, (K, V) in pool.kv.items() if base in pool.windows)
    assert 0 < peak <= bound
    assert max(pool.first) > 0  # rows moved their windowed columns down

    for j, (prompt, kw) in enumerate(work):
        tokens, steps, logp = alone(model, prompt, kw, j, spec)
        assert [r.token for r in out[j]] == tokens, j
        assert [r.steps for r in out[j]] == steps, j
        torch.testing.assert_close(torch.tensor([r.logprob for r in out[j]]), torch.tensor(logp), rtol=0, atol=TOL)

    monkeypatch.setenv(FULL_WINDOW_CACHE_ENV, "1")
    full, full_dec, _ = serve(model, work, spec)
    assert not full_dec.pool.windows and full_dec.pool.nbytes() > dec.pool.nbytes()
    for j in range(len(work)):
        assert [(r.token, r.steps) for r in out[j]] == [(r.token, r.steps) for r in full[j]], j
        torch.testing.assert_close(torch.tensor([r.logprob for r in out[j]]),
                                   torch.tensor([r.logprob for r in full[j]]), rtol=0, atol=TOL)


def test_a_row_alone_in_a_quantized_windowed_pool_reads_bitwise_what_generate_reads(model, monkeypatch):
    """One row (no other row pads its reads), bf16 recent-token window: its exact entries are written back at the
    row's held positions after two moves of its windowed columns, and every log-probability is generate's."""
    monkeypatch.delenv(FULL_WINDOW_CACHE_ENV, raising=False)
    spec = SPECS["recent-window"]
    prompt, kw = jobs()[0][0], dict(max_new_tokens=26, init_scale=0.0, num_steps=2)
    out, dec, _ = serve(model, [(prompt, kw)], spec, max_rows=1)
    assert dec.pool.first[0] >= 32
    tokens, steps, logp = alone(model, prompt, kw, 0, spec)
    assert [(r.token, r.steps, r.logprob) for r in out[0]] == list(zip(tokens, steps, logp))


@pytest.mark.parametrize("length", [19, 35])
def test_a_row_alone_keeps_the_decode_floor_and_reads_bitwise_what_generate_reads(model, length, monkeypatch):
    """A calibrated split at head dim 8 decodes fewer than 7 columns with other rounding: a prompt of 16 k + 3
    tokens would leave its first token's read 4 columns under the windows alone (max 4); the row keeps 7."""
    monkeypatch.delenv(FULL_WINDOW_CACHE_ENV, raising=False)
    spec = SPECS["calibrated-split"]
    prompt = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(1)).tolist()
    kw = dict(max_new_tokens=6, init_scale=0.0, num_steps=3)
    out, _, _ = serve(model, [(prompt, kw)], spec, max_rows=1)
    tokens, steps, logp = alone(model, prompt, kw, 0, spec)
    assert [(r.token, r.steps, r.logprob) for r in out[0]] == list(zip(tokens, steps, logp))


def test_a_quantized_pool_with_windows_needs_the_head_dim():
    with pytest.raises(ValueError, match="head_dim"):
        QuantizedSlotKVPool(SPECS["plain"], windows={("prelude", 0): 4})
