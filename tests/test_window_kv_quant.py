"""Sliding-window layers hold O(W) columns with a quantized KV cache too (`inference/cache.py` `windows`, `kv_quant`):
greedy generation with the bound gives bitwise the logits of the same quantized cache keeping every column, over
windows, depths, exit criteria, KV-sharing policies, left padding, codecs (calibrated channel splits, the
dequantize read, a bf16 recent-token window), and a long generation holds a bounded number of columns."""

from __future__ import annotations

import pytest
import torch

from recurrent_depth.inference.cache import FULL_WINDOW_CACHE_ENV, WINDOW_ALIGN, layer_windows, make_cache
from recurrent_depth.inference.kv_codec import KVQuant, exact_decode_columns, layer_codec
from tests.test_window_cache import _generate, _model, _prompt

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = {
    # (attention windows, kv heads, prompt (batch, length, left padding), kv_quant, options)
    # head dim 8 with a calibrated split: the decode's back-projection rounds differently on fewer than 7 columns
    # (torch's small-matmul kernel), so windows 2 and 3 keep at least that many (`exact_decode_columns`)
    "split-calibrated-exit-compute": ([3, 2, None, 4], 2, (2, 12, 3), "k=mse:3.5,v=mse:3.5,outliers=calibrated",
                                      dict(num_steps=3, exit_criterion="kl", exit_threshold=1e-2, exit_kv="compute")),
    # a bf16 recent-token window (6) wider than the attention windows: its entries before the held columns are
    # not written back, the others at their held position
    "recent-window-exit-kl": ([3, 5, None, 2], 2, (2, 10, 2), "k=prod:2.5,v=mse:2.5,window=6",
                              dict(num_steps=3, exit_criterion="kl", exit_threshold=1e-2)),
    "dequantize-shared-skip": ([4, 3, 5, 2], 1, (2, 8, 2), "k=prod:3.5,v=mse:4,attn=dequantize",
                               dict(num_steps=4, kv_policy="shared-2+skip", exit_criterion="kl", exit_threshold=1e-2)),
    "randomized-exit": ([3, 4, 6, None], 2, (1, 9, 0), "k=mse:4,v=mse:3",
                        dict(num_steps=3, kv_policy="randomized", seed=3, exit_criterion="kl", exit_threshold=1e-2)),
    "compress-r2-mha": ([2, 3, 3, 5], 4, (2, 7, 1), "k=mse:3.5,v=prod:3", dict(num_steps=2, kv_policy="compress-r2")),
}
RUNS = [(case, "static") for case in CASES] + [("compress-r2-mha", "dynamic")]


@pytest.mark.parametrize(("case", "implementation"), RUNS)
def test_bounded_quantized_cache_gives_the_full_quantized_cache_logits_bitwise(case, implementation, monkeypatch):
    windows, kv_heads, prompt, spec, options = CASES[case]
    model = _model(windows, kv_heads)
    ids, mask = _prompt(*prompt, seed=len(case))
    kwargs = dict(max_new_tokens=32, cache_implementation=implementation, kv_quant=spec, **options)
    bounded = _generate(model, ids, mask, True, monkeypatch, **kwargs)
    full = _generate(model, ids, mask, False, monkeypatch, **kwargs)
    assert torch.equal(bounded.sequences, full.sequences)
    assert torch.equal(bounded.steps, full.steps)
    assert torch.equal(bounded.logits, full.logits)
    assert bounded.cache_allocated_bytes < full.cache_allocated_bytes  # (every window is passed)
    assert int(bounded.cache_bytes[:, -1].max()) < int(full.cache_bytes[:, -1].min())


def test_a_long_quantized_generation_holds_o_w_columns_per_windowed_layer(monkeypatch):
    """100 new tokens with W = 8 in every layer: bounded bytes held and allocated, as for float entries."""
    W, steps, new = 8, 2, 100
    spec = "k=mse:4,v=mse:4"
    model = _model([W] * 4)
    ids, _ = _prompt(1, 5, 0, seed=7)
    quant = KVQuant.parse(spec)
    entry = quant.bytes_per_token(model.config.head_dim, model.config.num_kv_heads)  # one column's k and v code rows
    lanes = 1 + 2 * steps + 1  # prelude, core layers x per-step slots, coda
    kwargs = dict(max_new_tokens=new, num_steps=steps, eos_token_id=[], kv_quant=spec)
    bounded = _generate(model, ids, None, True, monkeypatch, **kwargs)
    full = _generate(model, ids, None, False, monkeypatch, **kwargs)
    assert torch.equal(bounded.sequences, full.sequences)
    assert int(bounded.cache_bytes.max()) <= lanes * (2 * W + WINDOW_ALIGN) * entry
    assert bounded.cache_allocated_bytes <= lanes * (2 * W + WINDOW_ALIGN) * entry
    assert int(full.cache_bytes[0, -1]) == lanes * (5 + new - 1) * entry


@pytest.mark.parametrize("dim", [4, 8, 16])
def test_a_decode_of_at_least_exact_decode_columns_rounds_each_column_as_a_longer_one(dim):
    """The floor a quantized windowed store keeps: a calibrated split's decode of its last n columns equals the
    whole decode's for every n from the floor on (and the floor is needed: one column fewer differs at dim 8)."""
    quant = KVQuant.parse("k=mse:3.5,v=mse:3.5,outliers=calibrated")
    x = torch.randn(1, 2, 40, dim, generator=torch.Generator().manual_seed(dim))
    codec = layer_codec(quant, "k", dim, x[:, :, :12])
    rows = codec.encode(x)
    whole = codec.decode(rows)
    floor = exact_decode_columns((codec, codec))
    for n in range(floor, 40):
        assert torch.equal(codec.decode(rows[:, :, -n:].contiguous()), whole[:, :, -n:]), n
    if dim == 8:
        assert not torch.equal(codec.decode(rows[:, :, -(floor - 1):].contiguous()), whole[:, :, -(floor - 1):])


def test_a_quantized_cache_keeps_the_windows_it_is_given():
    model = _model([3, None, 5, 4])
    cache = make_cache("static", 1, 1, kv_quant="k=mse:4,v=mse:4", windows=layer_windows(model))
    assert cache.windows == {("prelude", 0): 3, ("core", 1): 5, ("coda", 0): 4}


def test_the_benchmark_measures_the_quantized_bound(capsys, monkeypatch):
    """benchmarks/window_cache.py --kv-quant: every variant runs the quantized cache; the bound holds fewer code
    bytes and agrees with the full quantized cache token for token."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import window_cache as bench

    monkeypatch.setattr(bench.Memory, "mmap_threshold", lambda self, size: None)  # (see test_bench_window_smoke)
    monkeypatch.delenv(FULL_WINDOW_CACHE_ENV, raising=False)
    spec = "k=mse:4,v=mse:4"
    assert bench.main(["--quick", "--layouts", "mistral", "--kv-quant", spec]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert record["kv_quant"] == KVQuant.parse(spec).name
    runs = record["results"][0]["runs"]
    assert all(run["agreement"] == 1.0 for run in runs.values())
    full = runs["full"]["held_bytes"]
    # code rows: the full cache holds every column's (prelude, 2 core layers x 2 slots, coda; head dim 8, 2 KV heads;
    # 16 + 64 columns, the last token not fed back)
    assert full == 6 * (16 + 64 - 1) * KVQuant.parse(spec).bytes_per_token(8, 2)
    assert 0 < runs["bounded"]["held_bytes"] < full
