"""Memory bounds beyond autoregressive decoding for sliding-window models: token-by-token scoring
(`evaluation/scoring.py: stepwise_logprobs`) reads earlier tokens through generate's windowed cache, and the parallel
sampler's per-column buffers (`inference/parallel.py: _Columns`) drop the columns every row has frozen. Both give
exactly what keeping every column gives, on odd lengths with left padding."""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.evaluation import scoring
from recurrent_depth.inference import parallel
from recurrent_depth.inference.generate import generate
from tests.test_window_cache import _model  # (hidden 32, weights tripled: the recurrence amplifies rounding)

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 61  # (test_window_cache's)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# contexts of different odd lengths (left padding), continuations long enough that windowed layers drop columns
REQUESTS = [(_tokens(29, 1), _tokens(23, 2)), (_tokens(7, 3), _tokens(31, 4)), (_tokens(1, 5), _tokens(9, 6))]
SCORING = {
    "kl-exit": dict(exit_criterion="kl", exit_threshold=1.0),
    "kv-budget": dict(kv_budget=2),
    "exit-in-prefill": dict(exit_criterion="kl", exit_threshold=1.0, exit_in_prefill=True),
    "exit-kv-compute": dict(exit_criterion="kl", exit_threshold=1.0, exit_kv="compute"),
    "warm-start": dict(warm_start=True),
    "kv-quant": dict(kv_quant="k=prod:3.5,v=mse:3.5"),
}


@pytest.mark.parametrize("options", list(SCORING.values()), ids=list(SCORING))
def test_stepwise_scoring_reads_through_the_windowed_cache_and_scores_as_the_full_one(options, monkeypatch):
    model = _model([3, 5, None, 4])
    caches = []
    make_cache = scoring.make_cache

    def recorded(*args, **kwargs):
        caches.append(make_cache(*args, **kwargs))
        return caches[-1]

    monkeypatch.setattr(scoring, "make_cache", recorded)
    bounded = scoring.stepwise_logprobs(model, REQUESTS, 5, 0, init_scale=0.0, **options)
    bounded_bytes = sum(cache.nbytes() for cache in caches)  # (a warm start scores the 1-token context apart)
    caches.clear()
    monkeypatch.setattr(scoring, "layer_windows", lambda model: {})
    full = scoring.stepwise_logprobs(model, REQUESTS, 5, 0, init_scale=0.0, **options)
    assert bounded == full  # log-probabilities bitwise, greedy flags, steps per token
    assert any(s < 5 for r in bounded for s in r.steps) or "exit_criterion" not in options
    # the windowed layers dropped their old columns (the full-attention core layer keeps every one)
    assert bounded_bytes < sum(cache.nbytes() for cache in caches)


def _parallel(model, room: int, monkeypatch, max_new_tokens: int, **options) -> rd.GenerationOutput:
    ids = torch.tensor([_tokens(13, 7), [0] * 4 + _tokens(9, 8)])
    mask = (torch.arange(13) >= torch.tensor([[0], [4]])).long()  # row 1 left-padded
    monkeypatch.setattr(parallel, "BUFFER_ROOM", room)
    return generate(model, ids, attention_mask=mask, max_new_tokens=max_new_tokens, num_steps=6, init_scale=0.0,
                    sampler="parallel", output_logits=True, **options)


PARALLEL = {
    "latent-exit": dict(inner_steps=2, exit_criterion="latent-diff", exit_threshold=0.1),
    "sampled-wide": dict(inner_steps=1, wavefront=5, headway=2, exit_criterion="cosine", exit_threshold=2e-2,
                         do_sample=True, seed=[3, 4]),
}


@pytest.mark.parametrize("options", list(PARALLEL.values()), ids=list(PARALLEL))
def test_parallel_sampler_buffers_drop_frozen_columns_and_decode_as_full_buffers(options, monkeypatch):
    model = _model([4, 6, 3, 5])
    full = _parallel(model, 10**6, monkeypatch, 37, **options)  # room for every column: nothing is dropped
    bounded = _parallel(model, 3, monkeypatch, 37, **options)  # drops every few sweeps
    assert torch.equal(bounded.sequences, full.sequences) and torch.equal(bounded.steps, full.steps)
    assert bounded.exit_reasons == full.exit_reasons
    assert torch.equal(bounded.logits, full.logits)
    assert {k: v for k, v in bounded.stats.items() if k != "buffer_bytes"} == \
        {k: v for k, v in full.stats.items() if k != "buffer_bytes"}
    assert bounded.stats["buffer_bytes"] < full.stats["buffer_bytes"] / 2


def test_parallel_sampler_buffers_do_not_grow_with_the_generation(monkeypatch):
    model = _model([4, 6, 3, 5])
    options = dict(inner_steps=4, wavefront=1)  # one position a sweep: the span is one column
    short = _parallel(model, 8, monkeypatch, 16, **options)
    long = _parallel(model, 48, monkeypatch, 48, **options)
    long_bounded = _parallel(model, 8, monkeypatch, 48, **options)
    assert torch.equal(long_bounded.sequences, long.sequences)
    assert long_bounded.stats["buffer_bytes"] == short.stats["buffer_bytes"] < long.stats["buffer_bytes"]
