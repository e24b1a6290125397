"""Mutation hunt, round 7: tests that kill surviving mutants of the server's request validation (serving/protocol.py,
transport.py, prep.py, handlers.py, adapters.py, chat_template.py), each against the documented rule
(docs/serving.md; OpenAI's and vLLM's API semantics), not against the current output. Mostly the parsers called
directly; one in-process app (httpx's ASGITransport) for what only a handler checks."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.data.tokenizer import save_tokenizer, train_tokenizer
from recurrent_depth.serving import build_app
from recurrent_depth.serving.adapters import NAME_MAX_CHARS, adapter_dir_inside, check_adapter_name
from recurrent_depth.serving.chat_template import content_text
from recurrent_depth.serving.prep import Preparer, PrepSpec
from recurrent_depth.serving.protocol import (
    MAX_TEMPLATE_KWARGS,
    APIError,
    Limits,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_request_body,
)
from recurrent_depth.serving.transport import BodyBudget, read_body, require_json

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64
LIMITS = Limits(max_seq_len=64, mean_recurrence=4, vocab_size=VOCAB, max_num_steps=16)
USER = [{"role": "user", "content": "hi"}]


def refused(parse, body: dict, param: str, limits: Limits = LIMITS) -> str:
    """The 400 message of `body`, which must name `param`."""
    with pytest.raises(APIError) as caught:
        parse(body, limits, None)
    assert (caught.value.status, caught.value.param) == (400, param), caught.value.message
    assert "\n" not in caught.value.message
    return caught.value.message


# ---------------------------------------------------------------------------------------- protocol.py
def test_every_bound_takes_its_limit_and_refuses_one_past_it():
    """docs/serving.md: n <= 16, logprobs <= 20, at most 16 stop strings, 128 tools, 64 chat_template_kwargs names,
    256 sequences a request (prompts x n), stop/detokenize ids inside the vocabulary [0, V), depth <= the server's
    --max-num-steps, a seed of 64 signed bits (vLLM's range): each limit itself is allowed."""
    ok = parse_completion({"prompt": [1], "n": 16, "logprobs": 20, "stop": ["s"] * 16, "num_steps": 16,
                           "stop_token_ids": [0, VOCAB - 1], "seed": -(2**63)}, LIMITS, None)
    assert (ok.sampling.n, ok.logprobs, len(ok.sampling.stop), ok.sampling.stop_token_ids) == (16, 20, 16, [0, 63])
    assert parse_completion({"prompt": [1], "n": 1, "seed": 2**63 - 1}, LIMITS, None).sampling.seed == 2**63 - 1
    assert len(parse_completion({"prompt": [[1]] * 16, "n": 16}, LIMITS, None).prompts) == 16  # 256 sequences
    refused(parse_completion, {"prompt": [1], "n": 17}, "n")
    refused(parse_completion, {"prompt": [1], "n": 0}, "n")  # (OpenAI: n >= 1; it was read as 1)
    refused(parse_completion, {"prompt": [1], "logprobs": 21}, "logprobs")
    refused(parse_completion, {"prompt": [1], "stop": ["s"] * 17}, "stop")
    refused(parse_completion, {"prompt": [1], "stop": ["s", ""]}, "stop")
    refused(parse_completion, {"prompt": [1], "stop_token_ids": [VOCAB]}, "stop_token_ids")
    refused(parse_completion, {"prompt": [1], "num_steps": 17}, "num_steps")
    refused(parse_completion, {"prompt": [1], "seed": 2**63}, "seed")
    refused(parse_completion, {"prompt": [[1]] * 257}, "prompt")
    refused(parse_completion, {"prompt": [[1]] * 129, "n": 2}, "prompt")
    tool = {"type": "function", "function": {"name": "f"}}
    chat = {"messages": USER, "tool_choice": "none"}
    assert len(parse_chat({**chat, "tools": [tool] * 128}, LIMITS, None).tools) == 128
    refused(parse_chat, {**chat, "tools": [tool] * 129}, "tools")
    names = {f"k{i}": i for i in range(MAX_TEMPLATE_KWARGS)}
    assert parse_chat({"messages": USER, "chat_template_kwargs": names}, LIMITS, None).template_kwargs == names
    refused(parse_chat, {"messages": USER, "chat_template_kwargs": {**names, "one_more": 1}}, "chat_template_kwargs")
    assert parse_detokenize({"tokens": [0, VOCAB - 1]}, LIMITS, None).tokens == [0, VOCAB - 1]
    refused(parse_detokenize, {"tokens": [VOCAB]}, "tokens")


def test_a_body_nested_exactly_to_the_limit_is_taken():
    """MAX_JSON_NESTING levels are allowed; one more is the 400."""
    from recurrent_depth.serving.protocol import MAX_JSON_NESTING

    def nested(levels: int) -> bytes:  # an object holding `levels` - 1 levels of lists
        return json.dumps({"x": json.loads("[" * (levels - 1) + "]" * (levels - 1))}).encode()

    assert parse_request_body(nested(MAX_JSON_NESTING))
    with pytest.raises(APIError, match=f"over {MAX_JSON_NESTING} levels"):
        parse_request_body(nested(MAX_JSON_NESTING + 1))


def test_fields_that_cannot_change_the_answer_pass_and_the_rest_are_400s():
    """docs/serving.md "Ignored because they cannot change the result": presence/frequency penalties of 0, best_of
    equal to n, modalities ["text"], an empty stream_options without stream, an empty suffix or logit_bias; the
    same fields asking for something else are 400s naming them."""
    harmless = {"presence_penalty": 0, "frequency_penalty": 0.0, "n": 3, "best_of": 3, "modalities": ["text"],
                "stream_options": {}, "suffix": "", "logit_bias": {}}
    assert parse_completion({"prompt": [1], **harmless}, LIMITS, None).sampling.n == 3
    for field, value in (("presence_penalty", 0.5), ("frequency_penalty", -1), ("best_of", 1),
                         ("modalities", ["text", "audio"]), ("stream_options", {"include_usage": True}),
                         ("stream_options", True), ("suffix", "x"), ("logit_bias", {"1": 5})):
        refused(parse_completion, {"prompt": [1], **harmless, field: value}, field)
    for options in (True, "include_usage", [{"include_usage": True}]):  # (not an object: one was a TypeError, a 500)
        assert "must be an object" in refused(parse_completion, {"prompt": [1], "stream": True,
                                                                 "stream_options": options}, "stream_options")


def test_top_logprobs_needs_logprobs_and_continuing_needs_an_assistants_final_message():
    refused(parse_chat, {"messages": USER, "top_logprobs": 2}, "top_logprobs")
    assert parse_chat({"messages": USER, "logprobs": True, "top_logprobs": 2}, LIMITS, None).top_logprobs == 2
    refused(parse_chat, {"messages": USER, "continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message")


def test_a_prompt_and_max_tokens_that_fill_the_context_exactly_fit():
    """prompt + max_tokens == the context is allowed; one more token is context_length_exceeded naming max_tokens,
    or the prompt (chat: the messages) where the prompt alone fills the context."""
    chat = parse_chat({"messages": USER}, LIMITS, None).sampling
    assert chat.options(60, 4, LIMITS).max_new_tokens == 4
    with pytest.raises(APIError) as caught:
        chat.options(60, 5, LIMITS)
    assert (caught.value.param, caught.value.code) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(APIError) as caught:
        chat.options(64, 1, LIMITS)
    assert caught.value.param == "messages"


# ---------------------------------------------------------------------------------------- transport.py
def test_a_body_of_exactly_the_size_limit_is_read_and_one_byte_more_is_a_413():
    async def body_of(size: int, declared: str | None, budget: BodyBudget) -> bytes:
        async def receive() -> dict:
            return {"type": "http.request", "body": b"x" * size, "more_body": False}

        with budget.holding() as share:
            return await read_body(receive, 10, 5.0, declared, share)

    assert asyncio.run(body_of(10, "10", BodyBudget(10))) == b"x" * 10  # (the budget too: exactly full)
    for declared in ("11", None):
        with pytest.raises(APIError) as caught:
            asyncio.run(body_of(11, declared, BodyBudget(100)))
        assert caught.value.status == 413
    with pytest.raises(APIError) as caught:
        asyncio.run(body_of(10, "10", BodyBudget(9)))
    assert caught.value.status == 503


def test_the_json_media_type_is_read_as_http_reads_it():
    """RFC 9110: media types are case-insensitive and may carry parameters (a charset)."""
    require_json("Application/JSON; charset=utf-8")
    require_json("application/json")
    for other in ("text/plain", None, "application/jsonx"):
        with pytest.raises(APIError) as caught:
            require_json(other)
        assert caught.value.status == 415


# ---------------------------------------------------------------------------------------- prep.py
def test_a_token_prompt_of_exactly_the_context_is_prepared():
    """A token-id prompt of max_seq_len tokens fits the context (max_tokens 0 with echo scores it); one more token
    is the 400."""
    preparer = Preparer(PrepSpec(None, VOCAB, LIMITS, None, memory_headroom=None))
    body = {"prompt": [1] * 64, "max_tokens": 0, "echo": True, "logprobs": 1}
    result = preparer.prepare("completions", json.dumps(body).encode())
    assert result[0] == "ok" and len(result[2][0]) == 64, result
    result = preparer.prepare("completions", json.dumps({**body, "prompt": [1] * 65}).encode())
    assert result[:2] == ("error", 400) and result[4] == "prompt", result


def test_a_text_prompt_that_encodes_to_no_tokens_is_a_400(tmp_path):
    """An empty text without the tokenizer's special tokens is no prompt at all: a 400 naming it, not a row with
    nothing to read."""
    save_tokenizer(train_tokenizer(["def add(a, b):\n    return a + b\n"] * 4, 300), tmp_path)
    limits = Limits(max_seq_len=64, mean_recurrence=4, vocab_size=300)
    preparer = Preparer(PrepSpec(str(tmp_path), 300, limits, None, memory_headroom=None))
    result = preparer.prepare("completions", json.dumps({"prompt": "", "add_special_tokens": False}).encode())
    assert result[:2] == ("error", 400) and result[4] == "prompt" and "no tokens" in result[2], result
    assert preparer.prepare("completions", json.dumps({"prompt": "def"}).encode())[0] == "ok"


# ---------------------------------------------------------------------------------------- adapters.py
def test_adapter_names_take_256_characters_and_start_with_a_letter_or_digit():
    check_adapter_name("a" * NAME_MAX_CHARS, "lora_name")
    for name in ("a" * (NAME_MAX_CHARS + 1), "-x", ".hidden", "/abs"):
        with pytest.raises(ValueError, match="lora_name"):
            check_adapter_name(name, "lora_name")


def test_an_adapter_whose_weights_link_outside_the_root_is_refused(tmp_path):
    """adapter_dir_inside: the adapter's files must stay under --lora-updates-root, each of them (its config
    inside does not make weights read from outside safe)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a").mkdir(parents=True)
    outside.mkdir()
    (root / "a" / "adapter_config.json").write_text("{}")
    (outside / "adapter_model.safetensors").write_bytes(b"")
    (root / "a" / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="leads outside"):
        adapter_dir_inside(root, "a")
    for given in ("../outside", str(outside)):  # (refused before it is read: no probing of what lies outside)
        with pytest.raises(ValueError, match="leads outside"):
            adapter_dir_inside(root, given)
    (root / "a" / "adapter_model.safetensors").unlink()
    (root / "a" / "adapter_model.safetensors").write_bytes(b"")
    assert adapter_dir_inside(root, "a") == (root / "a").resolve()


# ---------------------------------------------------------------------------------------- chat_template.py
def test_only_text_parts_with_string_text_are_read():
    assert content_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "c") == "a\nb"
    for part, said in (({"type": "image_url", "image_url": {"url": "x"}}, "image_url"),
                       ({"type": "text", "text": 5}, "must be a string")):
        with pytest.raises(ValueError, match=said):
            content_text([part], "messages[0].content")


# ---------------------------------------------------------------------------------------- handlers.py
@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(0)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB)).eval()


def test_the_handlers_checks_the_key_and_the_room_a_request_needs(model):
    """RFC 9110 §11.1: an auth scheme is case-insensitive ("bearer KEY" is the key). A completions prompt that
    fills the context with max_tokens null (the rest of the context, as vLLM's) leaves no room: a 400
    context_length_exceeded, not an empty answer."""
    app = build_app(model, model_name="m", api_key="k", tokenizer_workers=1)
    full = [1] * model.config.max_seq_len

    async def ask() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as client:
                return [await client.get("/v1/models", headers={"Authorization": "bearer k"}),
                        await client.get("/v1/models", headers={"Authorization": "Bearer nope"}),
                        await client.post("/v1/completions", headers={"Authorization": "BEARER k"},
                                          json={"prompt": full, "max_tokens": None}),
                        await client.post("/v1/completions", headers={"Authorization": "Bearer k"},
                                          json={"prompt": [1], "max_tokens": 1, "ttt_params": "core", "ttt_steps": 1,
                                                "ttt_lr": 0.01})]

    models, wrong, no_room, one_token_ttt = asyncio.run(ask())
    assert models.status_code == 200 and wrong.status_code == 401
    assert no_room.status_code == 400, no_room.text
    assert no_room.json()["error"]["code"] == "context_length_exceeded"
    # TTT-E2E trains on the prompt's next-token loss: a 1-token prompt has none, refused before it is queued
    assert one_token_ttt.status_code == 400, one_token_ttt.text
    assert one_token_ttt.json()["error"]["param"] == "ttt_params"
    assert "at least 2 tokens" in one_token_ttt.json()["error"]["message"]


# ---------------------------------------------------------------------------------------- train/run_record.py
def test_a_resumed_log_keeps_the_records_through_its_step_and_writes_strict_json(tmp_path):
    """JsonlLog: on resume the lines through `keep_through` stay (and are what `kept` holds: the trainer finds an
    earlier final validation there); a value JSON lacks (a diverged NaN loss) is written as null."""
    from recurrent_depth.train.run_record import JsonlLog

    path = tmp_path / "eval.jsonl"
    path.write_text("".join(json.dumps({"step": s, "final": s == 2}) + "\n" for s in (1, 2, 3)))
    log = JsonlLog(path, keep_through=2)
    assert log.kept == [{"step": 1, "final": False}, {"step": 2, "final": True}]
    log.write({"step": 3, "loss": float("nan")})
    log.close()
    assert path.read_text().splitlines()[-1] == '{"step": 3, "loss": null}'


# ---------------------------------------------------------------------------------------- inference/speculative.py
def test_under_official_defaults_each_verify_pass_draws_its_own_s0(monkeypatch):
    """docs/inference.md (speculative decoding): with a random s0, `defaults="official"`'s verify pass draws a fresh
    s0 over the round's drafted columns, as the official loop does; under our defaults it continues the drafts'
    states (no draw of its own)."""
    from recurrent_depth.inference import generate
    from recurrent_depth.inference.session import Session

    draws: list[int] = []  # the columns of each s0 draw
    original = Session.initial_states

    def counted(self, like, rows, valid=None):
        draws.append(like.shape[1])
        return original(self, like, rows, valid)

    monkeypatch.setattr(Session, "initial_states", counted)
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB)).eval()
    lookahead, kwargs = 3, dict(max_new_tokens=7, num_steps=4, draft_steps=2, init_scale=1.0)
    for defaults, verify_draws in (("official", True), (None, False)):
        draws.clear()
        out = generate(model, [[1, 2, 3, 4, 5]], lookahead=lookahead, defaults=defaults, **kwargs)
        assert draws[0] == 5 and set(draws[1:]) <= {1, lookahead}, draws  # prefill, then drafts (and verifies)
        assert out.stats["rounds"] >= 1
        assert draws.count(lookahead) == (out.stats["rounds"] if verify_draws else 0), (defaults, draws)


def test_only_our_defaults_undo_the_s0_draws_of_rejected_drafts(monkeypatch):
    """docs/inference.md: with a random s0 and a seed, our speculative decoding undoes the draws of rejected drafts
    (the next column draws greedy decoding's s0 again: a repeated draw); `defaults="official"` does not (its verify
    draws afresh, as the official loop's), so each of its draft draws is new."""
    from recurrent_depth.inference import generate
    from recurrent_depth.inference.session import Session

    drafts: list[float] = []  # each one-column s0 draw, as its sum
    original = Session.initial_states

    def recorded(self, like, rows, valid=None):
        s = original(self, like, rows, valid)
        if like.shape[1] == 1:
            drafts.append(float(s.double().sum()))
        return s

    monkeypatch.setattr(Session, "initial_states", recorded)
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB)).eval()
    kwargs = dict(max_new_tokens=10, num_steps=4, draft_steps=1, lookahead=3, init_scale=1.0, seed=3)
    for defaults in ("official", None):
        drafts.clear()
        stats = generate(model, [[1, 2, 3, 4, 5]], defaults=defaults, **kwargs).stats
        assert stats["accepted_drafts"] < stats["drafted_tokens"], stats  # (some drafts rejected)
        repeated = len(drafts) - len(set(drafts))
        assert (repeated > 0) == (defaults is None), (defaults, drafts)
