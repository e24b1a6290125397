"""Bugs a differential fuzzer of the server's streaming found (seeded random completions and chats, streamed and
not, with stops, echo and logprobs, compared with each other, with the tokenizer's decode and with a forward)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from recurrent_depth.serving.text import IncrementalDecoder, TextCodec, TextState

# "é" is C3 A9, "🙂" F0 9F 99 82: in byte-level symbols "Ã©" and "ðŁĻĤ"
E_THEN_LEAD, REST = "Ã©ð", "ŁĻĤ"


@pytest.fixture
def codec(tmp_path: Path) -> TextCodec:
    """A byte-level BPE with a token ending inside a character ("é" + the emoji's first byte), as GPT-2-style
    vocabularies have many (CJK text splits mid-character at most tokens)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    pieces = [*alphabet, "Ã©", E_THEN_LEAD, "ŁĻ", REST]
    merges = [("Ã", "©"), ("Ã©", "ð"), ("Ł", "Ļ"), ("ŁĻ", "Ĥ")]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    return TextCodec(tmp_path, len(pieces))


def test_text_before_an_unfinished_character_streams_and_meets_stop_strings(codec):
    """A token ending inside a character held back its whole text, not just the unfinished bytes: a text whose
    tokens each end mid-character streamed nothing until the end, and a stop string in it was never seen, so
    generation ran on and the answer (streamed or not) held the stop string with finish_reason "length"."""
    tok = codec.tokenizer
    e_lead, rest = tok.token_to_id(E_THEN_LEAD), tok.token_to_id(REST)
    assert codec.decode([e_lead, rest, e_lead]) == "é🙂é\ufffd"

    decoder = IncrementalDecoder(codec)
    assert [decoder.push(t) for t in (e_lead, rest, e_lead)] == ["é", "🙂", "é"]  # (was "", "é🙂", "")
    assert decoder.flush() == "\ufffd"  # only the unfinished byte is held to the end

    state = TextState(codec, ["é"])
    assert state.push(e_lead) == ("", True) and state.matched == "é"  # stops at the token that wrote it
    kept = TextState(codec, ["🙂é"], include_stop=True)
    # (a text that may start the stop string waits for the next; the stop was missed: ("", False) at the last)
    assert [kept.push(t) for t in (e_lead, rest, e_lead)] == [("", False), ("é", False), ("🙂é", True)]
