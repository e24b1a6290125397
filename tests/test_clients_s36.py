"""Found by driving `rdepth serve` with real clients (the `openai` client, lm-eval's local-completions and
local-chat-completions, httpx): a run of tokens that never completes a UTF-8 character was decoded again whole
for each new token (an echoed prompt of 8000 such tokens held the event loop 11 s), and a chat request's
`add_special_tokens: true` was ignored without a word."""

from __future__ import annotations

import pytest

from recurrent_depth.data.tokenizer import save_tokenizer, train_tokenizer
from recurrent_depth.serving.protocol import APIError, Limits, parse_chat
from recurrent_depth.serving.responses import echo_offsets
from recurrent_depth.serving.text import TextCodec

CORPUS = ["def add(a, b):\n    return a + b\n", "héllo wörld, ünïcode text 🙂 and more text.\n"] * 4
LIMITS = Limits(max_seq_len=256, mean_recurrence=4, vocab_size=320, max_num_steps=64)


@pytest.fixture(scope="module")
def codec(tmp_path_factory) -> TextCodec:
    """A byte-level BPE tokenizer (every byte a token), as the project's models have."""
    out = tmp_path_factory.mktemp("clients_tok")
    save_tokenizer(train_tokenizer(CORPUS, 320), out)
    return TextCodec(out, 320)


def counting(codec: TextCodec, monkeypatch) -> list[int]:
    """Count the token ids `codec.decode` is given, in all (a measure of decoding work that does not depend on
    the machine's speed)."""
    work, decode = [0], codec.decode
    monkeypatch.setattr(codec, "decode", lambda ids, *a, **k: work.__setitem__(0, work[0] + len(ids))
                        or decode(ids, *a, **k))
    return work


def byte_token(codec: TextCodec, value: int) -> int:
    return next(i for i in range(320) if codec.token_bytes(i) == bytes([value]))


@pytest.mark.parametrize("continuation", [True, False], ids=["completion", "echoed-prompt"])
def test_a_run_of_bytes_that_never_completes_a_character_decodes_in_linear_work(codec, monkeypatch, continuation):
    """The decoder kept its window open while the text ended in U+FFFD, so a run of lone continuation bytes (a
    client's token-id prompt with echo + logprobs, or a model's output) was decoded again whole for every token:
    2000 tokens cost ~4 million decoded ids (~4 s for 4000 on the event loop or the engine thread); now a few
    ids per token. The text is still exactly the whole run's decode, valid characters between the runs too."""
    n = 2000
    lone, lead = byte_token(codec, 0x80), byte_token(codec, 0xE4)  # (0xE4 0xB8 0xAD is "中")
    ids = [lone] * n + [lead, byte_token(codec, 0xB8), byte_token(codec, 0xAD)] + [lone] * 5 + [lead]
    want = codec.decode(codec.anchor + ids)[len(codec.decode(codec.anchor)):] if continuation else codec.decode(ids)
    work = counting(codec, monkeypatch)
    decoder = codec.decoder(continuation=continuation)
    pieces = [decoder.push(t) for t in ids]
    assert "".join(pieces) + decoder.flush() == want and "中" in want
    assert work[0] < 40 * len(ids), work[0]  # (was ~len(ids)**2)
    assert "".join(pieces[: n // 2]) == "\ufffd" * (n // 2 - 3)  # (they stream: at most 3 tokens wait)


def test_echo_offsets_of_such_a_prompt_are_linear_work_and_index_its_text(codec, monkeypatch):
    """`echo` + `logprobs` measures the prompt's text offsets with the same decoder, on the event loop."""
    ids = [byte_token(codec, 0x80)] * 2000
    work = counting(codec, monkeypatch)
    offsets, length = echo_offsets(codec, ids)
    assert work[0] < 40 * len(ids), work[0]
    assert length == len(codec.decode(ids, skip_special_tokens=False)) == 2000
    assert offsets == sorted(offsets) and offsets[-1] <= length


def test_chat_refuses_add_special_tokens_true_as_tokenize_does():
    """A chat completion ignored `add_special_tokens: true` (vLLM's chat adds a BOS on top of the template's for it),
    while /tokenize, which renders a chat as a chat completion does, refused it: now both refuse it in one line."""
    messages = [{"role": "user", "content": "a"}]
    with pytest.raises(APIError) as info:
        parse_chat({"messages": messages, "add_special_tokens": True}, LIMITS, {"m"})
    assert info.value.status == 400 and info.value.param == "add_special_tokens"
    assert "chat template writes the special tokens" in info.value.message
    for value in (False, None):  # (false is what the template needs; null is as left out)
        parse_chat({"messages": messages, "add_special_tokens": value}, LIMITS, {"m"})
