"""Sliding-window layers hold O(W) cache columns (`inference/cache.py`: `windows`, `layer_windows`): greedy
generation with the bound equals generation with every column kept, token for token and logit for logit, and a
long generation holds a bounded number of columns per windowed layer."""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference import session as session_module
from recurrent_depth.inference.cache import WINDOW_ALIGN, layer_windows, make_cache
from recurrent_depth.inference.generate import generate

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 61


def _model(windows: list[int | None], kv_heads: int = 2, **overrides) -> rd.RecurrentDepthLM:
    """Hidden 32, 4 heads; weights tripled so that the recurrence amplifies any rounding difference."""
    cfg = rd.ModelConfig(vocab_size=VOCAB, hidden_size=32, num_heads=4, num_kv_heads=kv_heads, intermediate_size=40,
                         prelude_layers=1, core_layers=2, coda_layers=1, max_seq_len=512,
                         attention_windows=windows, **overrides)
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model


def _generate(model, ids, mask, bounded: bool, monkeypatch, **options) -> rd.GenerationOutput:
    """Greedy generation with the windowed layers' columns dropped (bounded) or every column kept."""
    with monkeypatch.context() as patch:
        if not bounded:
            patch.setattr(session_module, "layer_windows", lambda *args, **kwargs: {})
        return generate(model, ids, attention_mask=mask, do_sample=False, output_logits=True, init_scale=0.0,
                        **options)


def _prompt(batch: int, length: int, padding: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    ids = torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    if not padding:
        return ids, None
    mask = torch.ones_like(ids)
    mask[0, :padding] = 0  # row 0 left-padded
    return ids, mask


CASES = {
    # (windows, kv heads, prompt (batch, length, left padding), options)
    "mixed-gqa-padded": ([3, 5, None, 4], 2, (2, 12, 3), {}),
    "prompt-shorter-than-w": ([10, 6, None, 8], 4, (2, 4, 1), {}),
    "all-windowed-mha": ([2, 3, 3, 2], 4, (1, 9, 0), {}),
    "exit-kl": ([3, 5, None, 4], 2, (2, 12, 3), dict(exit_criterion="kl", exit_threshold=1e-2, max_steps=6)),
    "exit-compute": ([3, 4, 6, None], 2, (2, 10, 2), dict(exit_criterion="kl", exit_threshold=1e-2, max_steps=5,
                                                          exit_kv="compute")),
    "shared-skip-exit": ([4, 3, 5, 2], 1, (2, 8, 2), dict(kv_policy="shared-2+skip", exit_criterion="kl",
                                                          exit_threshold=1e-2, max_steps=5)),
    "randomized-exit": ([3, 5, None, 4], 2, (2, 7, 1), dict(kv_policy="randomized", seed=3, exit_criterion="kl",
                                                            exit_threshold=1e-2, max_steps=5)),
    "compress-r3": ([3, 5, 4, 4], 2, (2, 12, 3), dict(kv_policy="compress-r3")),
    "model-modules": ([3, 5, None, 4], 2, (2, 12, 3), dict(fast=False)),
}


# (the dynamic reference, slow, on the settings where its storage works differently)
RUNS = [(case, "static") for case in CASES] + [(case, "dynamic") for case in ("mixed-gqa-padded", "shared-skip-exit",
                                                                             "randomized-exit", "compress-r3")]


@pytest.mark.parametrize(("case", "implementation"), RUNS)
def test_bounded_window_cache_generates_what_the_full_cache_does(case, implementation, monkeypatch):
    windows, kv_heads, prompt, options = CASES[case]
    model = _model(windows, kv_heads)
    ids, mask = _prompt(*prompt, seed=len(case))
    kwargs = dict(max_new_tokens=24, num_steps=3, cache_implementation=implementation, **options)
    bounded = _generate(model, ids, mask, True, monkeypatch, **kwargs)
    full = _generate(model, ids, mask, False, monkeypatch, **kwargs)
    assert torch.equal(bounded.sequences, full.sequences)
    assert torch.equal(bounded.steps, full.steps)
    torch.testing.assert_close(bounded.logits, full.logits, atol=1e-6, rtol=0)
    assert bounded.cache_allocated_bytes < full.cache_allocated_bytes  # (24 new tokens: every window is passed)


def test_a_long_generation_holds_o_w_columns_per_windowed_layer(monkeypatch):
    """200 new tokens with W = 8 in every layer: the static cache allocates and reports (`cache_bytes`) a bounded
    number of columns per (layer, slot), where the full cache holds all 205."""
    W, steps, new = 8, 2, 200
    model = _model([W] * 4)
    ids, _ = _prompt(1, 5, 0, seed=7)
    entry = 2 * model.config.num_kv_heads * model.config.head_dim * 4  # float32 key + value of one column
    lanes = 1 + 2 * steps + 1  # prelude, core layers x per-step slots, coda
    kwargs = dict(max_new_tokens=new, num_steps=steps, eos_token_id=[])
    bounded = _generate(model, ids, None, True, monkeypatch, **kwargs)
    full = _generate(model, ids, None, False, monkeypatch, **kwargs)
    assert torch.equal(bounded.sequences, full.sequences)
    # a store keeps the window widened down to WINDOW_ALIGN and room for W more columns before it drops again
    assert int(bounded.cache_bytes.max()) <= lanes * (2 * W + WINDOW_ALIGN) * entry
    assert bounded.cache_allocated_bytes <= lanes * (2 * W + WINDOW_ALIGN) * entry
    assert int(full.cache_bytes[0, -1]) == lanes * (5 + new - 1) * entry  # (the last token is not fed back)


def test_a_windowed_cache_refuses_to_go_back_past_its_dropped_columns():
    """A seek or truncate behind the columns a windowed cache dropped says so, rather than reading zeros (speculative
    rollback and the wavefront keep what they seek back to through `window_back`)."""
    cache = make_cache("static", 1, 1, capacity=64, windows={("prelude", 0): 4})
    for _ in range(40):
        cache.update_kv(("prelude", 0), torch.randn(1, 1, 1, 2), torch.randn(1, 1, 1, 2))
        cache.close(1, 1)
        cache.advance(1)
    assert cache.first[("prelude", 0)] > 0 and cache.kv[("prelude", 0)][0].shape[3] < 40
    cache.seek(38)  # its window is held
    with pytest.raises(RuntimeError, match=r"layer \('prelude', 0\) \(window 4\) dropped the columns before"):
        cache.truncate(2)


def test_windows_name_the_windowed_layers():
    model = _model([3, None, 5, 4])
    assert layer_windows(model) == {("prelude", 0): 3, ("core", 1): 5, ("coda", 0): 4}
    assert layer_windows(_model([3, 2, 5, 4]))[("core",)] == 5  # compress-rN's one core store: the widest
