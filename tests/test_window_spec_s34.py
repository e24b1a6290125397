"""Speculative decoding and the parallel sampler bound their sliding-window layers' caches too
(`inference/cache.py`: `window_back`; `speculative._window_back`): tokens and logits equal those of a cache that
keeps every column, bitwise, and a windowed store's columns stay within W plus a round's rollback.

The models have head dim 8 (`_model`), where CPU SDPA with MKL's AVX-512 kernels rounds a multi-query read of 8 to 11
held columns otherwise than the full read (`MULTI_QUERY_WINDOW_SLACK`); the suite pins MKL's AVX2 path (conftest:
MKL_CBWR), which does not, so only `MKL_CBWR=AUTO` on an AVX-512 machine makes these tests fail without the slack.
The batch test's model has head dim 16, which needs no slack on either path: it sets it to 0, so that the rollback
and hole terms alone must keep what the verify reads."""

from __future__ import annotations

import pytest
import torch

from recurrent_depth.inference import cache as cache_module
from recurrent_depth.inference import session as session_module
from recurrent_depth.inference import speculative
from recurrent_depth.inference.cache import MULTI_QUERY_WINDOW_SLACK, WINDOW_ALIGN
from recurrent_depth.inference.generate import generate
from tests.test_window_cache import _model, _prompt

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(model, ids, mask, bounded: bool, monkeypatch, implementation: str = "static", **options):
    """Generate, recording each windowed store's most columns (allocated, static; held, dynamic)."""
    columns: dict[tuple, int] = {}
    static, dynamic = cache_module.StaticRecurrentCache, cache_module.DynamicRecurrentCache
    write_rows, update_kv = static.write_rows, dynamic.update_kv

    def note(cache, counts) -> None:
        for base, n in counts:
            if base in cache.windows:
                columns[base] = max(columns.get(base, 0), n)

    def recording_write_rows(self, key, k, v):
        out = write_rows(self, key, k, v)
        note(self, ((base, K.shape[3]) for base, (K, _) in self.kv.items()))
        return out

    def recording_update_kv(self, key, k, v, ctx=None):
        out = update_kv(self, key, k, v, ctx)
        note(self, ((base, sum(e is not None for e in cols)) for (base, _), cols in self.entries.items()))
        return out

    with monkeypatch.context() as patch:
        patch.setattr(static, "write_rows", recording_write_rows)
        patch.setattr(dynamic, "update_kv", recording_update_kv)
        if not bounded:  # every column kept
            patch.setattr(session_module, "layer_windows", lambda *args, **kwargs: {})
        options = {"do_sample": False, **options}
        out = generate(model, ids, attention_mask=mask, output_logits=True, init_scale=0.0, eos_token_id=[],
                       max_new_tokens=options.pop("new"), cache_implementation=implementation, **options)
    return out, columns


def _check_equal(bounded, full) -> None:
    assert torch.equal(bounded.sequences, full.sequences)
    assert torch.equal(bounded.steps, full.steps)
    assert torch.equal(bounded.logits, full.logits)


def _bound(implementation: str, reach: int, span: int, prompt: int) -> int:
    """The most columns a windowed store takes: a drop keeps from a write's first query's reach back (aligned down)
    and allocates `reach` more (static; the prompt's store P + reach before the first drop); a write spans `span`."""
    if implementation == "static":
        return max(prompt + reach, span + 2 * reach + WINDOW_ALIGN)
    return span + reach + WINDOW_ALIGN


SPECULATIVE = {
    # (windows, prompt (batch, length, left padding), implementation, options). The 2-query verify right after a
    # drop reads 8 to 11 columns without the slack: logits differ (MKL_CBWR=AUTO, AVX-512).
    "static-lookahead-2": ([4] * 4, (1, 10, 0), "static", dict(lookahead=2, new=80)),
    "dynamic-mixed-lookahead-3": ([4, None, 6, 4], (1, 10, 0), "dynamic", dict(lookahead=3, new=40)),
    "quantized-threshold": ([4] * 4, (1, 10, 0), "static",
                            dict(lookahead=3, new=32, verification_threshold=0.3, kv_quant="k=prod:3.5,v=mse:3.5")),
}


@pytest.mark.parametrize("case", SPECULATIVE)
def test_bounded_speculative_decoding_equals_the_full_cache_and_holds_w_plus_a_round(case, monkeypatch):
    windows, prompt, implementation, options = SPECULATIVE[case]
    model = _model(windows)
    ids, mask = _prompt(*prompt, seed=3)
    kwargs = dict(num_steps=4, draft_steps=1, **options)
    bounded, held = _run(model, ids, mask, True, monkeypatch, implementation, **kwargs)
    full, full_held = _run(model, ids, mask, False, monkeypatch, implementation, **kwargs)
    _check_equal(bounded, full)
    assert held and not full_held  # (the full run names no windowed layer)
    W, L = max(w for w in windows if w), options["lookahead"]
    reach = W + L - 1 + MULTI_QUERY_WINDOW_SLACK  # the window, the drafts the verify seeks back over, the slack
    assert max(held.values()) <= _bound(implementation, reach, L, prompt[1])
    assert bounded.cache_allocated_bytes < full.cache_allocated_bytes


def test_a_batch_whose_rows_hide_rejected_drafts_keeps_their_windows(monkeypatch):
    """Rows accepting different drafts leave holes in the other's columns: a row's W real tokens then span more
    columns, which `_window_back` keeps; the verify seeks back over the drafts, which it keeps too (dropped: the
    seek is refused). At head dim 16 without the slack, so that nothing else covers either (left padding included)."""
    monkeypatch.setattr(speculative, "MULTI_QUERY_WINDOW_SLACK", 0)
    model = _model([4] * 4, kv_heads=1, head_dim=16)
    ids, mask = _prompt(2, 10, 3, seed=3)
    kwargs = dict(num_steps=4, draft_steps=1, lookahead=4, verification_threshold=0.3, new=48)
    bounded, _ = _run(model, ids, mask, True, monkeypatch, **kwargs)
    full, _ = _run(model, ids, mask, False, monkeypatch, **kwargs)
    _check_equal(bounded, full)
    assert bounded.stats["accepted_drafts"] < bounded.stats["drafted_tokens"]  # (rejections: holes)
    assert bounded.cache_allocated_bytes < full.cache_allocated_bytes


PARALLEL = {
    # (windows, prompt, implementation, options). Without the slack the wavefront's reads after a drop round
    # otherwise (MKL_CBWR=AUTO, AVX-512); a padded batch's write mask leaves columns behind its write's start that a
    # drop must keep (`_held_from`).
    "static-batch-padded": ([4] * 4, (2, 10, 3), "static", dict(wavefront=4, new=40)),
    "sampled-quantized": ([4, None, 6, 4], (2, 10, 2), "static",
                          dict(wavefront=3, headway=2, do_sample=True, seed=5, new=48,
                               kv_quant="k=prod:3.5,v=mse:3.5")),
    "dynamic-converged": ([4, 6, 4, 5], (2, 10, 3), "dynamic",
                          dict(wavefront=4, new=32, exit_criterion="latent-diff", exit_threshold=0.05, max_steps=6)),
}


@pytest.mark.parametrize("case", PARALLEL)
def test_bounded_parallel_sampler_equals_the_full_cache_and_holds_o_w(case, monkeypatch):
    windows, prompt, implementation, options = PARALLEL[case]
    model = _model(windows)
    ids, mask = _prompt(*prompt, seed=3)
    kwargs = dict(sampler="parallel", num_steps=3, inner_steps=2, **options)
    bounded, held = _run(model, ids, mask, True, monkeypatch, implementation, **kwargs)
    full, _ = _run(model, ids, mask, False, monkeypatch, implementation, **kwargs)
    _check_equal(bounded, full)
    # the wavefront's write starts where its earliest front stands and seeks no further back: the window alone
    span = max(options["wavefront"], options.get("headway", 1)) + prompt[0] * options["wavefront"]
    reach = max(w for w in windows if w) + MULTI_QUERY_WINDOW_SLACK
    assert max(held.values()) <= _bound(implementation, reach, span, prompt[1])
    assert bounded.cache_allocated_bytes < full.cache_allocated_bytes
