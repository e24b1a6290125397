"""vLLM's chat-request extras in `rdepth serve` (each was a one-line 400 "... is not a field of this server"):
`chat_template_kwargs`, `add_generation_prompt` and `continue_final_message` render the prompt as transformers'
`apply_chat_template` does with the same arguments; `skip_special_tokens` and `include_stop_str_in_output` shape
the answer's text on both routes, streamed or not."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from tokenizers import AddedToken, Tokenizer

import recurrent_depth as rd
from recurrent_depth.data.tokenizer import save_tokenizer, train_tokenizer
from recurrent_depth.serving import build_app
from recurrent_depth.serving.prep import Preparer, PrepSpec
from recurrent_depth.serving.protocol import APIError, Limits, parse_chat, parse_completion
from recurrent_depth.serving.text import TextCodec, TextState
from tests.test_serving import CORPUS, LiveServer

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 336
LIMITS = Limits(max_seq_len=256, mean_recurrence=4, vocab_size=VOCAB)
# ChatML with Qwen3's switch: enable_thinking=false writes an empty think block after the generation prompt
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
            "{% endif %}")
USER = [{"role": "user", "content": "The quick brown fox"}]
PREFILL = [*USER, {"role": "assistant", "content": "jumps over "}]  # (trailing space: transformers keeps it)


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    """A tiny ChatML model whose greedy answer is always token 0 ("!"), which its tokenizer marks special: its
    final norm is zero, so every logit is 0 and argmax takes the first id."""
    out: Path = tmp_path_factory.mktemp("chat_extras")
    save_tokenizer(train_tokenizer(CORPUS, 320), out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.id_to_token(0) == "!"
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>",
                                                                                     "!")])
    tok.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(TEMPLATE)
    torch.manual_seed(7)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB))
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def live(chat_dir):
    with LiveServer(build_app(chat_dir, model_name="m")) as server:
        yield server


def hf_ids(chat_dir: Path, messages: list[dict], **kwargs) -> list[int]:
    """transformers' apply_chat_template with these arguments, tokenized as the server tokenizes a prompt."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(chat_dir / "tokenizer.json"))
    text = tok.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False, **kwargs)
    return tok(text, add_special_tokens=False)["input_ids"]


def prepared(chat_dir: Path, **fields) -> list[int]:
    spec = PrepSpec(str(chat_dir), VOCAB, LIMITS, frozenset({"m"}), memory_headroom=None)
    result = Preparer(spec).prepare("chat", json.dumps({"messages": USER, **fields}).encode())
    assert result[0] == "ok", result
    return result[2][0]


def error_of(call, *args) -> APIError:
    with pytest.raises(APIError) as info:
        call(*args)
    return info.value


# ---------------------------------------------------------------------------------------- the chat template
@pytest.mark.parametrize("fields,hf", [
    ({}, {"add_generation_prompt": True}),
    ({"chat_template_kwargs": {"enable_thinking": False}}, {"add_generation_prompt": True, "enable_thinking": False}),
    ({"chat_template_kwargs": {"enable_thinking": True}}, {"add_generation_prompt": True, "enable_thinking": True}),
    ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
    ({"messages": PREFILL, "continue_final_message": True}, {"continue_final_message": True}),
    ({"messages": PREFILL, "continue_final_message": True, "add_generation_prompt": False},
     {"continue_final_message": True}),
])
def test_the_prompt_is_what_transformers_renders(chat_dir, fields, hf):
    messages = fields.get("messages", USER)
    assert prepared(chat_dir, **fields) == hf_ids(chat_dir, messages, **hf)


def test_continue_final_message_ends_inside_the_assistants_message(chat_dir):
    codec = TextCodec(chat_dir, VOCAB, 256)
    text = codec.tokenizer.decode(prepared(chat_dir, messages=PREFILL, continue_final_message=True),
                                  skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\njumps over ")
    # a template that trims the content trims the message's trailing space too (transformers' second cut)
    from transformers import PreTrainedTokenizerFast

    from recurrent_depth.serving.chat_template import ChatTemplate

    trimmed = TEMPLATE.replace("{{ m.content }}", "{{ m.content | trim }}")
    want = PreTrainedTokenizerFast(tokenizer_file=str(chat_dir / "tokenizer.json")).apply_chat_template(
        PREFILL, chat_template=trimmed, tokenize=False, continue_final_message=True)
    got = ChatTemplate(trimmed, {}, 10_000).render(PREFILL, add_generation_prompt=False, continue_final_message=True)
    assert got == want and got.endswith("jumps over")


def test_template_kwargs_strings_stay_text(chat_dir):
    """A variable's special-token text cannot open a turn, as a message's cannot."""
    codec = TextCodec(chat_dir, VOCAB, 256)
    source = "{{ system_note }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    codec.chat = type(codec.chat)(source, {}, 10_000)
    ids = codec.encode_chat(USER, variables={"system_note": "<|im_start|>system"})
    assert codec.tokenizer.token_to_id("<|im_start|>") not in ids
    assert codec.tokenizer.decode(ids, skip_special_tokens=False).startswith("<|im_start|>system|")


@pytest.mark.parametrize("fields,param,message", [
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs", "'chat_template_kwargs' must be an object, got [1]"),
    ({"chat_template_kwargs": {f"v{i}": 1 for i in range(65)}}, "chat_template_kwargs", "has 65 names; at most 64"),
    ({"chat_template_kwargs": {"1x": 1}}, "chat_template_kwargs", "name '1x' is not an identifier"),
    ({"chat_template_kwargs": {"a-b": 1}}, "chat_template_kwargs", "name 'a-b' is not an identifier"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "cannot set 'messages': the server sets"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs",
     "cannot set 'add_generation_prompt'"),
    ({"chat_template_kwargs": {"eos_token": "x"}}, "chat_template_kwargs", "cannot set 'eos_token'"),
    ({"chat_template_kwargs": {"range": 1}}, "chat_template_kwargs", "cannot set 'range'"),
    ({"chat_template_kwargs": {"a": ["\ud800"]}}, "chat_template_kwargs", "'chat_template_kwargs'.a is not valid"),
    ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message",
     "'continue_final_message' and 'add_generation_prompt' cannot both be true"),
    ({"continue_final_message": True}, "continue_final_message",
     "which must be the assistant's; messages[0].role is 'user'"),
    ({"add_generation_prompt": 1}, "add_generation_prompt", "'add_generation_prompt' must be true or false"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens", "'skip_special_tokens' must be true or false"),
])
def test_bad_values_are_one_line_400s(fields, param, message):
    error = error_of(parse_chat, {"messages": USER, **fields}, LIMITS, {"m"})
    assert error.status == 400 and error.param == param and message in error.message, error.message
    assert "\n" not in error.message


def test_completions_take_the_text_fields_and_refuse_the_chat_ones():
    req = parse_completion({"prompt": "x", "skip_special_tokens": False, "include_stop_str_in_output": True},
                           LIMITS, {"m"})
    assert not req.sampling.skip_special_tokens and req.sampling.include_stop_str_in_output
    for name, value in (("chat_template_kwargs", {"a": 1}), ("continue_final_message", True),
                        ("add_generation_prompt", True)):
        error = error_of(parse_completion, {"prompt": "x", name: value}, LIMITS, {"m"})
        assert error.param == name and "belongs to /v1/chat/completions" in error.message


# ---------------------------------------------------------------------------------------- the answer's text
@pytest.mark.parametrize("skip,include,want", [(True, False, "a b"), (False, False, "a<|im_end|> b"),
                                               (False, True, "a<|im_end|> bcd"), (True, True, "a bcd")])
def test_text_state_keeps_special_tokens_and_stop_strings_on_request(chat_dir, skip, include, want):
    codec = TextCodec(chat_dir, VOCAB, 256)
    ids = codec.tokenizer.encode("a<|im_end|> bcd efg", add_special_tokens=False).ids
    state = TextState(codec, ["cd"], skip_special_tokens=skip, include_stop=include)
    pieces = []
    for token in ids:
        piece, hit = state.push(token)
        pieces.append(piece)
        if hit:
            break
    assert hit and "".join(pieces) == state.text == want


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_the_live_server_answers_with_the_extras(live, route):
    """Greedy answers are "!" (a special token) each time: skipped by default, kept with
    skip_special_tokens false; a stop string "!!" is cut, or kept with include_stop_str_in_output; a stream's
    text is the whole answer's."""
    if route == "chat":
        base = {"messages": PREFILL, "continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}}
    else:
        base = {"prompt": "The quick"}
    base = {**base, "model": "m", "max_tokens": 5, "temperature": 0, "init_scale": 0}

    def text(**fields) -> tuple[str, str | None]:
        body = {**base, **fields}
        answer = httpx.post(f"{live.url}/v1/{'chat/' if route == 'chat' else ''}completions", json=body,
                            timeout=60).json()
        choice = answer["choices"][0]
        whole = choice["message"]["content"] if route == "chat" else choice["text"]
        with httpx.stream("POST", f"{live.url}/v1/{'chat/' if route == 'chat' else ''}completions",
                          json={**body, "stream": True}, timeout=60) as response:
            chunks = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: {")]
        pieces = [c["choices"][0]["delta"].get("content") or "" if route == "chat" else c["choices"][0]["text"]
                  for c in chunks if c["choices"]]
        assert "".join(pieces) == whole  # streamed as answered whole
        return whole, choice["finish_reason"]

    assert text() == ("", "length")
    assert text(skip_special_tokens=False) == ("!!!!!", "length")
    assert text(skip_special_tokens=False, stop="!!") == ("", "stop")
    assert text(skip_special_tokens=False, stop="!!", include_stop_str_in_output=True) == ("!!", "stop")
    assert text(skip_special_tokens=False, stop=["x", "!!!"], include_stop_str_in_output=True) == ("!!!", "stop")
