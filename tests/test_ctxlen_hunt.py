"""Generation at the end of the context, on a tiny model with max_seq_len 32: no interface returns or runs past
max_seq_len, a decode at the last position gives the logits of a full forward, and the server refuses a
`max_tokens` past the room the prompt leaves as vLLM does (400 `context_length_exceeded` naming the numbers)."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.serving import build_app
from tests.test_serving import LiveServer, model_dir  # noqa: F401 - (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

CONTEXT = 32


@pytest.fixture(scope="module")
def short_model() -> rd.RecurrentDepthLM:
    torch.manual_seed(0)
    return rd.RecurrentDepthLM(dataclasses.replace(rd.ModelConfig.from_preset("tiny"), max_seq_len=CONTEXT)).eval()


def test_finish_round_stops_at_the_context(short_model):
    """finish_round commits the round past max_new_tokens, but it returned max_seq_len + 1 tokens (33 of 32) when
    the round reached the context's end: a sequence this model cannot read back. The output stays greedy
    decoding's (exact verification at init_scale 0), cut at the context."""
    kw = dict(init_scale=0.0, num_steps=4)
    longest, past_max_new = 0, False
    for lookahead, prompt_len, new in [(2, 30, 2), (4, 29, 2), (4, 29, 3), (4, 30, 2), (4, 20, 3)]:
        torch.manual_seed(prompt_len)
        ids = torch.randint(0, 256, (1, prompt_len))
        out = rd.generate(short_model, ids, max_new_tokens=new, draft_steps=3, lookahead=lookahead,
                          finish_round=True, **kw)
        length = out.sequences.shape[1]
        assert length <= CONTEXT, (lookahead, prompt_len, new, length)
        greedy = rd.generate(short_model, ids, max_new_tokens=length - prompt_len, **kw)
        assert torch.equal(out.sequences, greedy.sequences)
        assert out.finish_reasons == ["length"]
        longest = max(longest, length)
        past_max_new |= length > prompt_len + new
    assert longest == CONTEXT and past_max_new  # the cases reach the end, and finish_round still goes past


def test_prompt_plus_new_tokens_past_the_context_is_refused_naming_both(short_model):
    ids = torch.randint(0, 256, (1, CONTEXT))
    assert rd.generate(short_model, ids[:, :-1], max_new_tokens=1, init_scale=0.0).sequences.shape[1] == CONTEXT
    with pytest.raises(ValueError, match=r"prompt length 31 \+ max_new_tokens 2 exceeds the model's max_seq_len=32"):
        rd.generate(short_model, ids[:, :-1], max_new_tokens=2, init_scale=0.0)
    # a left-padded batch counts each row's real tokens: a long row and a short one fill the context exactly
    mask = torch.ones(2, CONTEXT - 2, dtype=torch.long)
    mask[1, :20] = 0
    out = rd.generate(short_model, ids[:, : CONTEXT - 2].expand(2, -1), attention_mask=mask, max_new_tokens=2,
                      init_scale=0.0, num_steps=4)
    alone = rd.generate(short_model, ids[:, 20: CONTEXT - 2], max_new_tokens=2, init_scale=0.0, num_steps=4)
    assert torch.equal(out.sequences[1, -2:], alone.sequences[0, -2:])


def test_decode_at_the_last_position_matches_a_full_forward(short_model):
    """RoPE and the cache at position max_seq_len - 1: a decode after a prefill of max_seq_len - 1 tokens gives
    the last token's logits of one forward over the whole sequence; one token more is refused."""
    ids = torch.randint(0, 256, (1, CONTEXT))
    with torch.no_grad():
        full = short_model(ids, num_steps=4, init_scale=0.0).logits
        cache = rd.DynamicCache()
        short_model(ids[:, :-1], num_steps=4, init_scale=0.0, cache=cache)
        last = short_model(ids[:, -1:], num_steps=4, init_scale=0.0, cache=cache).logits
        torch.testing.assert_close(last[0, -1], full[0, -1], atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="exceeds max_seq_len=32"):
            short_model(ids[:, -1:], num_steps=4, init_scale=0.0, cache=cache)


@pytest.fixture(scope="module")
def live(model_dir):  # noqa: F811 - (the fixture above)
    torch.manual_seed(0)
    cfg = rd.ModelConfig.from_preset("tiny", vocab_size=320, max_seq_len=CONTEXT)
    with LiveServer(build_app(rd.RecurrentDepthLM(cfg), tokenizer_dir=model_dir, model_name="tiny",
                              tokenizer_workers=1)) as server:
        yield server


@pytest.mark.parametrize("route, field, extra", [
    ("/v1/completions", "max_tokens", {"prompt": list(range(1, 29))}),
    ("/v1/chat/completions", "max_tokens", {"messages": [{"role": "user", "content": "def"}]}),
    ("/v1/chat/completions", "max_completion_tokens", {"messages": [{"role": "user", "content": "def"}]}),
])
def test_max_tokens_past_the_context_is_a_context_length_400_naming_the_numbers(live, route, field, extra):
    """A max_tokens above the whole context was a plain range error ("expected an integer <= 32", no code, no
    prompt length), while one just past the room left got `context_length_exceeded`; both now get the latter."""
    for value in (5000, CONTEXT):
        r = httpx.post(live.url + route, json={"model": "tiny", field: value, **extra}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == field, error
        assert f"{field} is {value}" in error["message"] and "context of 32 tokens" in error["message"], error
    ok = httpx.post(live.url + route, json={"model": "tiny", field: 2, "temperature": 0, **extra}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] <= 2, ok.text
