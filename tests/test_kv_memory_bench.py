"""The counting of benchmarks/kv_memory.py on a tiny model (the benchmark itself is heavy)."""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import pytest
import torch

import recurrent_depth as rd

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import kv_memory as km  # noqa: E402


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(0)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"num_steps": 3, "speed_tokens": 3, "repeats": 1, **kw})


@pytest.mark.parametrize("kwargs", [{}, {"kv_policy": "shared-2", "kv_quant": "k=prod:3.5,v=mse:3.5"}],
                         ids=["per-step bf16", "shared-2 + tq3.5"])
def test_bytes_per_token_is_per_cached_token(model, kwargs):
    """At fixed depth every token, prompt or generated, keeps the same entries, so the bytes per
    cached token equal the decode bytes per token exactly (the last chosen token is never cached)."""
    prompts = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(1))
    reference = torch.randint(0, model.config.vocab_size, (2, 4), generator=torch.Generator().manual_seed(2))
    r = km.measure(model, prompts, reference, kwargs, args())
    assert r["bytes_per_token"] == r["decode_bytes_per_token"] > 0
    cfg = model.config
    if not kwargs:  # counted in bf16: (prelude + coda + r core) entries of k and v per token
        layers = cfg.prelude_layers + cfg.coda_layers + 3 * cfg.core_layers
        assert r["bytes_per_token"] == layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2


def test_cpu_speed_is_not_invented_from_a_negative_time(model, monkeypatch):
    """A prefill-only call costing more CPU than the whole call measures nothing (it used to be
    clamped to 1e-9 s and reported as ~1e9 tokens/s)."""
    clock = itertools.chain([0.0, 1.0, 3.0], itertools.count(10.0))  # decode 1 s - prefill 2 s < 0
    monkeypatch.setattr(km.time, "process_time", lambda: next(clock))
    prompt = torch.randint(0, model.config.vocab_size, (1, 4), generator=torch.Generator().manual_seed(3))
    out = km.decode_speeds(model, prompt, {"per-step bf16": {}}, args())
    assert out["per-step bf16"]["cpu_tokens_per_s"] is None
