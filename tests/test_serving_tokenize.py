"""vLLM's `POST /tokenize` and `POST /detokenize` in `rdepth serve`: /tokenize of messages gives exactly the ids a
chat completion of them runs on (the same worker-side rendering), of a prompt the ids a completion runs on;
/detokenize turns ids back into text; errors have the server's shapes (401, 404 unknown model, 400 naming the
field)."""

from __future__ import annotations

import json

import httpx
import pytest

from recurrent_depth.serving import build_app
from recurrent_depth.serving.prep import Preparer, PrepSpec
from tests.test_serving import LiveServer
from tests.test_serving_chat_extras import LIMITS, PREFILL, USER, VOCAB, chat_dir  # noqa: F401 (chat_dir: a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = "sk-tokenize"


def prepared(chat_dir, kind: str, body: dict) -> tuple:  # noqa: F811
    spec = PrepSpec(str(chat_dir), VOCAB, LIMITS, frozenset({"m"}), memory_headroom=None)
    return Preparer(spec).prepare(kind, json.dumps(body).encode())


@pytest.mark.parametrize("fields", [{}, {"add_generation_prompt": False},
                                    {"chat_template_kwargs": {"enable_thinking": False}}])
def test_tokenize_messages_gives_the_chat_prompt_ids(chat_dir, fields):  # noqa: F811
    chat = prepared(chat_dir, "chat", {"messages": USER, **fields})
    tok = prepared(chat_dir, "tokenize", {"messages": USER, **fields})
    assert tok[0] == chat[0] == "ok"
    assert tok[2] == chat[2] and len(chat[2][0]) > 5


def test_tokenize_refuses_what_it_cannot_answer_naming_the_field(chat_dir):  # noqa: F811
    cases = [({"prompt": "a", "messages": USER}, "prompt"), ({"prompt": 3}, "prompt"),
             ({"prompt": "a", "max_tokens": 3}, "max_tokens"), ({"prompt": "a", "add_generation_prompt": True},
                                                                "add_generation_prompt"),
             ({"messages": USER, "add_special_tokens": True}, "add_special_tokens"),
             ({"messages": USER, "continue_final_message": True}, "continue_final_message"),
             ({"prompt": "a", "model": "other"}, "model")]
    for body, param in cases:
        result = prepared(chat_dir, "tokenize", body)
        assert result[0] == "error" and result[4] == param, (body, result)
        assert result[1] == (404 if param == "model" else 400)
    result = prepared(chat_dir, "detokenize", {"tokens": [1, VOCAB]})
    assert result[:2] == ("error", 400) and result[4] == "tokens" and str(VOCAB) in result[2]


def test_the_live_routes(chat_dir):  # noqa: F811
    auth = {"Authorization": f"Bearer {KEY}"}
    with LiveServer(build_app(chat_dir, model_name="m", api_key=KEY)) as live:
        def post(route: str, body: dict, headers: dict = auth) -> httpx.Response:
            return httpx.post(f"{live.url}{route}", json=body, headers=headers, timeout=60)

        # messages: the ids a chat completion runs on (its usage counts the same prompt)
        answer = post("/tokenize", {"model": "m", "messages": PREFILL, "add_generation_prompt": False,
                                    "continue_final_message": True})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        chat = prepared(chat_dir, "chat", {"messages": PREFILL, "continue_final_message": True})[2][0]
        assert body == {"count": len(chat), "max_model_len": LIMITS.max_seq_len, "tokens": chat}
        completion = post("/v1/chat/completions", {"model": "m", "messages": PREFILL, "max_tokens": 1,
                                                   "continue_final_message": True,
                                                   "add_generation_prompt": False}).json()
        assert completion["usage"]["prompt_tokens"] == len(chat)

        # a prompt: the completion's ids, special tokens as asked; the pieces on request; a round trip back
        text = "The quick brown fox"
        plain = post("/tokenize", {"prompt": text, "return_token_strs": True}).json()
        assert plain["tokens"] == prepared(chat_dir, "completions", {"prompt": [text], "echo": True})[2][0]
        assert len(plain["token_strs"]) == plain["count"] > 1 and "".join(plain["token_strs"]) != ""
        bare = post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()
        assert bare["tokens"] == plain["tokens"][1:]  # (the tokenizer's bos left out)
        assert post("/detokenize", {"model": "m", "tokens": bare["tokens"]}).json() == {"prompt": text}
        back = post("/detokenize", {"tokens": chat}).json()["prompt"]
        assert back.startswith("<|im_start|>user\n") and back.endswith("jumps over ")  # special tokens kept

        assert post("/tokenize", {"prompt": text}, headers={}).status_code == 401
        missing = post("/detokenize", {"model": "nope", "tokens": [1]})
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
        wrong = post("/detokenize", {"tokens": "1 2"})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "tokens"
