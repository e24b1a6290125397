"""Serving a chat model's tokenizer (a retrofitted Qwen's ChatML: `<|im_start|>`, `<|im_end|>` added as special
tokens) through the official `openai` client, as vLLM answers it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken, Tokenizer

import recurrent_depth as rd
from recurrent_depth.data.tokenizer import save_tokenizer, train_tokenizer
from recurrent_depth.serving import build_app
from tests.test_serving import CORPUS, LiveServer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def chatml_server(tmp_path_factory):
    """A tiny model whose byte-level BPE tokenizer has ChatML's special tokens, behind a live server."""
    out: Path = tmp_path_factory.mktemp("chatml_model")
    save_tokenizer(train_tokenizer(CORPUS, 320), out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    tok.save(str(out / "tokenizer.json"))
    torch.manual_seed(7)
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=336)).save_pretrained(out)
    with LiveServer(build_app(out, model_name="chatml")) as live:
        yield live, tok


@pytest.mark.parametrize("stream", [False, True])
def test_echo_returns_a_chatml_prompt_with_its_special_tokens(chatml_server, stream):
    """`echo` returned the prompt decoded with special tokens skipped: `<|im_start|>user\\nHi<|im_end|>\\n` came
    back as `user\\nHi\\n`, so a client cutting `text[len(prompt):]` lost the answer's start, and `text_offset`
    ran short of the tokens shown. OpenAI and vLLM return a text prompt as sent (a token-id prompt decoded with
    its special tokens), and offsets count a special token by its text."""
    live, tok = chatml_server
    client = live.client()
    text_prompt = "<|im_start|>user\nThe quick brown fox<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text_prompt, add_special_tokens=False).ids
    assert tok.token_to_id("<|im_start|>") in ids  # (parsed as the special token, not split into characters)
    for prompt in (text_prompt, ids):
        # (Qwen's tokenizer adds no BOS, this one would; init_scale 0: the same s_0 in both requests)
        kw = dict(model="chatml", prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=1,
                  extra_body={"add_special_tokens": False, "init_scale": 0})
        if stream:
            chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
            text = "".join(c.text for c in chunks)
            offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
            tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
        else:
            choice = client.completions.create(**kw).choices[0]
            text, offsets, tokens = choice.text, choice.logprobs.text_offset, choice.logprobs.tokens
        assert text.startswith(text_prompt)
        plain = client.completions.create(model="chatml", prompt=prompt, max_tokens=4, temperature=0,
                                          extra_body={"add_special_tokens": False, "init_scale": 0}).choices[0]
        assert text == text_prompt + plain.text
        assert tokens[0] == "<|im_start|>" and len(tokens) == len(ids) + 4
        for offset, token in zip(offsets[: len(ids)], tokens):  # each prompt token's text starts at its offset
            assert text[offset:].startswith(token)
        assert offsets[len(ids)] == len(text_prompt)  # the completion starts right after the echoed prompt
