"""vLLM's stop reporting in `rdepth serve`: each choice's `stop_reason` is the stop string matched or the request's
`stop_token_ids` id that ended it (null on the model's eos, on length), and `include_stop_str_in_output` keeps a stop
token's text as it keeps a stop string; on both routes, streamed or not, through the openai client too."""

from __future__ import annotations

import json

import httpx
import pytest

import recurrent_depth as rd
from recurrent_depth.serving import build_app
from recurrent_depth.serving.text import TextCodec, TextState
from tests.test_serving import LiveServer
from tests.test_serving_chat_extras import PREFILL, VOCAB, chat_dir  # noqa: F401 - (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

BANG = 0  # the tiny model's every greedy token: "!", a special token of its ChatML tokenizer


@pytest.fixture(scope="module")
def live(chat_dir):  # noqa: F811 - (the fixture above)
    """`chat_dir`'s model with "!" as its config's eos_token_id: a request ends on the model's eos at once, or
    (with ignore_eos) on its stop_token_ids."""
    model = rd.RecurrentDepthLM.from_pretrained(chat_dir)
    model.config.eos_token_id = BANG
    with LiveServer(build_app(model, tokenizer_dir=chat_dir, model_name="m", tokenizer_workers=1)) as server:
        yield server


def answer(live, route: str, **fields) -> tuple[str, str | None, int | str | None]:
    """(text, finish_reason, stop_reason) of one greedy request, checked to be what its stream gives: the same
    text, and both reasons on the choice's last chunk."""
    if route == "chat":
        base = {"messages": PREFILL, "continue_final_message": True}
    else:
        base = {"prompt": "The quick"}
    body = {**base, "model": "m", "max_tokens": 3, "temperature": 0, "init_scale": 0, "skip_special_tokens": False,
            **fields}
    url = f"{live.url}/v1/{'chat/' if route == 'chat' else ''}completions"
    choice = httpx.post(url, json=body, timeout=60).json()["choices"][0]
    text = choice["message"]["content"] if route == "chat" else choice["text"]
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
        chunks = [json.loads(line[6:])["choices"][0] for line in response.iter_lines() if line.startswith("data: {")]
    pieces = [c["delta"].get("content") or "" if route == "chat" else c["text"] for c in chunks]
    last = chunks[-1]
    assert "".join(pieces) == text
    assert (last["finish_reason"], last["stop_reason"]) == (choice["finish_reason"], choice["stop_reason"])
    return text, choice["finish_reason"], choice["stop_reason"]


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_stop_reason_and_the_stop_tokens_text(live, route):
    # the model's eos: no stop_reason, also when the request lists it; its text kept only on request
    assert answer(live, route) == ("", "stop", None)
    assert answer(live, route, stop_token_ids=[BANG]) == ("", "stop", None)
    assert answer(live, route, include_stop_str_in_output=True) == ("!", "stop", None)
    # past the eos (ignore_eos): the request's own stop token is the reason, its text cut unless asked for
    assert answer(live, route, ignore_eos=True, stop_token_ids=[BANG]) == ("", "stop", BANG)
    assert answer(live, route, ignore_eos=True, stop_token_ids=[BANG], include_stop_str_in_output=True) == (
        "!", "stop", BANG)
    # a stop string is its own reason; the length none
    assert answer(live, route, ignore_eos=True, stop=["x", "!!"]) == ("", "stop", "!!")
    assert answer(live, route, ignore_eos=True, stop="!!", include_stop_str_in_output=True) == ("!!", "stop", "!!")
    assert answer(live, route, ignore_eos=True) == ("!!!", "length", None)


def test_the_openai_client_receives_stop_reason(live):
    """The field is an extra of the openai client's models, read as vLLM's users read it."""
    client = live.client()
    kw = {"model": "m", "max_tokens": 3, "temperature": 0,
          "extra_body": {"init_scale": 0, "ignore_eos": True, "stop_token_ids": [BANG]}}
    completion = client.completions.create(prompt="The quick", **kw).choices[0]
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw).choices[0]
    assert completion.stop_reason == chat.stop_reason == BANG
    assert completion.finish_reason == chat.finish_reason == "stop"


def test_a_held_back_tail_comes_before_the_stop_tokens_text(chat_dir):  # noqa: F811 - (the fixture above)
    """Text held back as a possible stop string ("c" of "cd") is emitted before the stop token's own text."""
    codec = TextCodec(chat_dir, VOCAB, 256)
    *ids, end = codec.tokenizer.encode("a bc<|im_end|>", add_special_tokens=False).ids
    state = TextState(codec, ["cd"], skip_special_tokens=False, include_stop=True)
    pieces = [state.push(token)[0] for token in ids]
    assert state.pending == "c"
    pieces += [state.push_stop_token(end), state.flush()]
    assert "".join(pieces) == state.text == "a bc<|im_end|>" and state.matched is None
