"""Bugs an HTTP fuzzer of `rdepth serve` found (seeded random bodies against a live tiny ChatML model), each
checked against what the server must do rather than what it did."""

from __future__ import annotations

import json

import pytest
from fastapi.responses import JSONResponse

from recurrent_depth.data.tokenizer import save_tokenizer, train_tokenizer
from recurrent_depth.inference.options import GenerationOptions
from recurrent_depth.serving.batch import BatchDecoder, PromptScores, RowRequest
from recurrent_depth.serving.engine import Done, PromptEvent, TokenOut
from recurrent_depth.serving.protocol import APIError, Limits, parse_chat, parse_completion, parse_tokenize
from recurrent_depth.serving.responses import Choice, apply_event, completion_body, completion_chunks
from recurrent_depth.serving.text import IncrementalDecoder, TextCodec
from tests.batch_support import serve_in_one_batch
from tests.test_serving import CORPUS

pytestmark = pytest.mark.usefixtures("one_thread")

LIMITS = Limits(max_seq_len=256, mean_recurrence=4, vocab_size=336)


@pytest.mark.parametrize("parse, body", [
    (parse_completion, {"prompt": "a", "\ud800": 1}),
    (parse_chat, {"messages": [{"role": "user", "content": "a"}], "x\udfff": True}),
    (parse_tokenize, {"prompt": "a", "\ud800": 1}),
])
def test_an_unknown_field_named_by_a_lone_surrogate_is_a_400_not_a_500(parse, body):
    """JSON allows "\\ud800" as a field name; the 400 naming it (in `param` and the message) could not be
    written as UTF-8, so the client got a 500 "internal error: UnicodeEncodeError"."""
    args = (body, LIMITS, {"m"})
    with pytest.raises(APIError) as info:
        parse(*args)
    assert info.value.status == 400
    response = JSONResponse(info.value.body(), status_code=400)  # what app.py's handler answers
    error = json.loads(response.body)["error"]
    name = next(k for k in body if k not in ("prompt", "messages"))
    assert error["param"] == name.encode("utf-8", "backslashreplace").decode()  # e.g. the text \ud800
    assert error["param"] in error["message"] or name.encode("unicode_escape").decode() in error["message"]


@pytest.mark.filterwarnings("ignore:kv_policy='per-step\\+skip'")  # (its lookup still hides columns in the pool)
@pytest.mark.parametrize("policy", ["per-step+skip", "compress-s2"])
def test_a_prompt_joining_mid_token_of_a_row_that_hides_columns_is_exact(tiny_model, policy):
    """A row whose KV lookup hides columns (skip; compress-sN) left its core step in the pool between two
    core steps of a token; a new request's prefill then read it with no token columns (`key_mask`: TypeError),
    and the newcomer got a 500 "generation failed" while the other client's request went on. The newcomer must
    instead produce what it produces alone."""
    steps = tiny_model.config.mean_recurrence
    hider = GenerationOptions(max_new_tokens=6, do_sample=False, kv_policy=policy, num_steps=steps)
    plain_kw = {"max_new_tokens": 5, "do_sample": False, "num_steps": steps}
    dec = BatchDecoder(tiny_model, max_rows=2)
    dec.add(RowRequest([5, 6, 7], hider.validate(steps), 0), tag="hider")
    dec.step()  # one core step of the hider's next token: it is inside a token now
    plain = GenerationOptions(**plain_kw).validate(steps)
    _, first, _ = dec.add(RowRequest([9, 10, 11, 12], plain, 0), tag="plain")
    got = [first]
    while len(got) < plain_kw["max_new_tokens"]:
        got += [result for seq, result in dec.step() if seq.tag == "plain"]
    alone = serve_in_one_batch(tiny_model, [([9, 10, 11, 12], plain_kw)])[0]
    assert [r.token for r in got] == [r.token for r in alone]


@pytest.fixture(scope="module")
def bos_codec(tmp_path_factory) -> TextCodec:
    """A tokenizer that adds a BOS (`<|begin_text|>`) to text prompts, as `rdepth tokenizer` trains them."""
    out = tmp_path_factory.mktemp("bos_codec")
    save_tokenizer(train_tokenizer(CORPUS, 320), out)
    return TextCodec(out, 336)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_text_offsets_index_the_returned_text_of_a_string_prompt_with_a_bos(bos_codec, stream):
    """A string prompt is echoed as sent, but its BOS's text was counted in `text_offset`: the completion's first
    token sat at 14 + len(prompt) in a text of len(prompt) + its own, so a client locating the answer by offset
    (OpenAI's text_offset: into the returned text) cut it wrong. Each offset must be where its text starts."""
    codec, prompt = bos_codec, "The quick brown fox"
    req = parse_completion({"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 3, "stream": stream},
                           LIMITS, {"m"})
    prompt_ids = codec.encode(prompt, add_special_tokens=True)
    assert codec.token_string(prompt_ids[0]) == "<|begin_text|>"
    tokens = codec.encode(" jumps over", add_special_tokens=False)[:3]
    decoder = IncrementalDecoder(codec, continuation=True)
    pieces = [decoder.push(t) for t in tokens]
    events = [PromptEvent(0, PromptScores([None] + [-1.0] * (len(prompt_ids) - 1),
                                          [None] + [[(1, -0.5)]] * (len(prompt_ids) - 1)))]
    events += [TokenOut(0, t, piece, 4, "fixed", -1.0, [(t, -1.0)]) for t, piece in zip(tokens, pieces)]
    events.append(Done(0, "length", "", len(tokens), 4 * len(tokens)))
    choices = [Choice(0, list(prompt_ids))]
    if stream:
        text, offsets = "", []
        for event in events:
            for chunk in completion_chunks(codec, event, apply_event(event, choices), req, {}):
                item = chunk["choices"][0]
                text += item["text"]
                offsets += item["logprobs"]["text_offset"] if item["logprobs"] else []
    else:
        for event in events:
            apply_event(event, choices)
        item = completion_body(codec, req, {}, choices, [prompt_ids])["choices"][0]
        text, offsets = item["text"], item["logprobs"]["text_offset"]
    assert text == prompt + "".join(pieces) and len(offsets) == len(prompt_ids) + len(tokens)
    assert offsets[:2] == [0, 0]  # the BOS (no text in the answer), then the prompt's first token
    want = [len(prompt) + len("".join(pieces[:i])) for i in range(len(tokens))]
    assert offsets[len(prompt_ids):] == want  # the completion starts right after the echoed prompt
    for offset, t in zip(offsets[1:len(prompt_ids)], prompt_ids[1:]):
        assert text[offset:].startswith(codec.decode([t])), (offset, t)
