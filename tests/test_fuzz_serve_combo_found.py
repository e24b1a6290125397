"""Bugs a differential fuzzer of `rdepth serve` found (seeded random completions and chats, n > 1, logprobs, echo,
stops, greedy and seeded sampling, concurrent, on int8 / int4 weights, LoRA modules and a quantized KV pool), each
answer compared with `generate` on that request alone."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.inference import generate
from recurrent_depth.inference.options import OFFICIAL_STOP_IDS
from recurrent_depth.serving import build_app
from tests.test_serving import LiveServer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 17, 33, 2]
OFFICIAL_BEGIN = OFFICIAL_STOP_IDS[0]  # (Huginn's begin_text: an official stop, not the config's eos)


def greedy(model: rd.RecurrentDepthLM, n: int, **kw) -> list[int]:
    out = generate(model, torch.tensor(PROMPT), max_new_tokens=n, num_steps=3, init_scale=0.0, eos_token_id=[], **kw)
    return out.token_lists()[0]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[Path, rd.RecurrentDepthLM, list[int]]:
    """A token-ids-only tiny model of Huginn's vocabulary whose greedy answer to PROMPT holds its eos (the 3rd token)
    and, as the 5th, the official stop 65504: ids swapped into place (a permutation of the vocabulary: embedding and
    head rows move together, so the model is the same one with other names for two tokens)."""
    torch.manual_seed(7)
    cfg = rd.ModelConfig.from_preset("tiny", vocab_size=65536)
    model = rd.RecurrentDepthLM(cfg).eval()
    tokens = greedy(model, 6)
    assert len(set(tokens[:5])) == 5 and OFFICIAL_BEGIN not in tokens, tokens  # (else the seed needs changing)
    with torch.no_grad():
        for weight in {id(p): p for p in (model.transformer.wte.weight, model.lm_head.weight)}.values():
            weight[[tokens[4], OFFICIAL_BEGIN]] = weight[[OFFICIAL_BEGIN, tokens[4]]]
    model.config.eos_token_id = tokens[2]
    tokens = greedy(model, 6)
    assert tokens[2] == model.config.eos_token_id and tokens[4] == OFFICIAL_BEGIN, tokens
    out = tmp_path_factory.mktemp("served")
    model.save_pretrained(out)
    return out, model, tokens


@pytest.fixture(scope="module")
def live(served):
    with LiveServer(build_app(served[0], model_name="tiny", tokenizer_workers=1)) as server:
        yield server


def complete(live: LiveServer, **body) -> dict:
    body = dict(model="tiny", prompt=PROMPT, temperature=0, num_steps=3, init_scale=0, logprobs=0, **body)
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.filterwarnings("ignore::UserWarning")  # (the always-last lookup's note on its reads)
@pytest.mark.parametrize("extra", [
    {},
    {"kv_quant": "k=mse:4,v=mse:4"},  # another spec than the pool's (none): runs alone
    {"kv_policy": "always-last-m4", "exit_criterion": "kl", "exit_threshold": 1e-9},  # a lookup the pool lacks
], ids=["batch", "solo-kv-quant", "solo-always-last"])
def test_ignore_eos_runs_past_the_models_eos_alone_as_in_the_batch(live, served, extra):
    """ignore_eos dropped the model's eos from the job's stop ids only: a request that runs alone (its own session)
    still stopped there, with finish_reason "length" and 3 of its 6 tokens, where the batch ran on."""
    _, model, _ = served
    r = complete(live, max_tokens=6, ignore_eos=True, **extra)
    want = greedy(model, 6, **extra)
    assert model.config.eos_token_id in want[:-1]
    assert r["usage"]["completion_tokens"] == 6 and r["choices"][0]["finish_reason"] == "length"
    assert len(r["choices"][0]["logprobs"]["tokens"]) == 6


@pytest.mark.parametrize("extra", [{}, {"kv_quant": "k=mse:4,v=mse:4"}], ids=["batch", "solo"])
def test_official_defaults_stop_at_the_official_stop_ids_as_generate_does(live, served, extra):
    """`generate(defaults="official")` stops at the official code's hard-coded ids (65504, 65505, 65508); a served
    request with defaults "official" ran past them in the batch, and alone ended there as "length"."""
    _, model, tokens = served
    want = greedy(model, 8, defaults="official", **extra)
    assert want == tokens[:5] and want[-1] == OFFICIAL_BEGIN  # (generate stops there)
    r = complete(live, max_tokens=8, ignore_eos=True, defaults="official", **extra)
    assert r["usage"]["completion_tokens"] == len(want) and r["choices"][0]["finish_reason"] == "stop"
