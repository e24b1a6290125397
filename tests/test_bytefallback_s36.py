"""Incremental decoding with SentencePiece byte-fallback decoders (Llama-2's, Mistral's, Gemma's: byte tokens
`<0x80>`, the `ByteFallback` decoder): a run of byte tokens that never completes a UTF-8 character kept the
decoder's window open, and each new token decoded the whole run again (quadratic: an echoed prompt of 8000 lone
`<0x80>` tokens, its text offsets measured on the event loop, decoded 32 million ids). The run's text is now kept
as it grows (`ByteRun`), and what the decoder emits, chunk by chunk, is what it emitted before."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

from recurrent_depth.serving.responses import echo_offsets
from recurrent_depth.serving.text import BOUNDARY, GONE, REPLACEMENT, TextCodec

PIECES = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", "t", "h", "e", "a",
          "\u2581t", "\u2581th", "\u2581the", "\u2581a", "中",
          "<0x+8>"]  # (ByteFallback reads that as byte 08 too: the decoder decodes around it the slow way)
CHAINS = {  # the decoders of Llama-2's and Mistral's tokenizer.json, Gemma's, and an older Metaspace one
    "llama": lambda: [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                      decoders.Strip(" ", 1, 0)],
    "gemma": lambda: [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()],
    "metaspace": lambda: [decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="never")],
    # (drops every "\u2581" of the text's first piece, a whole run of bytes: decoded the slow way)
    "metaspace-first": lambda: [decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")],
}


def fallback_codec(path, chain: str) -> TextCodec:
    merges = [("\u2581", "t"), ("\u2581t", "h"), ("\u2581th", "e"), ("\u2581", "a")]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(PIECES)}, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence(CHAINS[chain]())
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    codec = TextCodec(path, len(PIECES))
    assert codec.byte_runs == (chain != "metaspace-first")
    return codec


@pytest.fixture(scope="module")
def codecs_(tmp_path_factory) -> dict[str, TextCodec]:
    root = tmp_path_factory.mktemp("bytefallback")
    return {chain: fallback_codec(root / chain, chain) for chain in CHAINS}


def byte(value: int) -> int:
    return PIECES.index(f"<0x{value:02X}>")


def reference_pieces(codec: TextCodec, ids: list[int], continuation: bool, skip: bool) -> list[str]:
    """What the decoder emitted for each token, then at its flush, before the change: the same window, decoded
    whole for every token."""
    anchor = codec.anchor if continuation else []
    prefix = read = sent = 0
    out = []
    for n in range(1, len(ids) + 1):
        before = codec.decode(anchor + ids[prefix:read], skip)
        after = codec.decode(anchor + ids[prefix:n], skip)
        start = len(before) + sent
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            prefix, read, sent = read, n, 0
            out.append(after[start:])
            continue
        stable = len(after.rstrip(REPLACEMENT))
        out.append(after[start:stable] if stable > start else "")
        sent += max(0, stable - start)
    tail = codec.decode(anchor + ids[prefix:], skip)[len(codec.decode(anchor + ids[prefix:read], skip)) + sent:]
    return [*out, tail if read < len(ids) else ""]


def pieces(codec: TextCodec, ids: list[int], continuation: bool = False, skip: bool = True) -> list[str]:
    decoder = codec.decoder(continuation=continuation, skip_special_tokens=skip)
    return [decoder.push(t) for t in ids] + [decoder.flush()]


def full(codec: TextCodec, ids: list[int], continuation: bool, skip: bool) -> str:
    anchor = codec.anchor if continuation else []
    return codec.decode(anchor + ids, skip)[len(codec.decode(anchor, skip)):]


def valid(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def sends_a_character_its_run_takes_back(codec: TextCodec, ids: list[int], skip: bool) -> bool:
    """Whether a run of byte tokens (skipped special tokens left out) begins with whole characters, which the
    decoder sends as they complete, but is not valid UTF-8 as a whole, so that a whole decode shows every byte of
    it as U+FFFD: the only text in which the decoder's and a whole decode differ (a stream cannot take back what it
    sent; tokenizers' own `DecodeStream` raises there)."""
    run = b""
    for kind in [*(8 if PIECES[t] == "<0x+8>" else codec.byte_kind(t, skip) for t in ids), BOUNDARY]:
        if kind >= 0:
            run += bytes([kind])
        elif kind != GONE:
            if not valid(run) and any(valid(run[:k]) for k in range(1, len(run))):
                return True
            run = b""
    return False


def counting(codec: TextCodec, monkeypatch) -> list[int]:
    """Count the token ids `codec.decode` is given, in all (decoding work, whatever the machine's speed)."""
    work, decode = [0], codec.decode
    monkeypatch.setattr(codec, "decode", lambda ids, *a, **k: work.__setitem__(0, work[0] + len(ids))
                        or decode(ids, *a, **k))
    return work


def test_the_decoder_emits_what_it_did_chunk_by_chunk_on_random_byte_runs(codecs_):
    """Seeded fuzz: sequences mixing byte tokens (lone continuation bytes, lead bytes, the bytes of "中", "🙂",
    "\u2581", " ", a valid U+FFFD, ASCII) with pieces and special tokens, each decoded as a completion or not,
    special tokens skipped or not: every chunk is the old decoder's, and the text is the whole decode's but where
    a stream had to send a character that later bytes of its run make invalid."""
    rng = random.Random(36)
    values = [0x80, 0xBF, 0xE4, 0xB8, 0xAD, 0xF0, 0x9F, 0x99, 0x82, 0xE2, 0x96, 0x81, 0xEF, 0xBD, 0x20, 0x41,
              0xC3, 0xA9, 0xED, 0xA0, 0xFF]
    others = [PIECES.index(p) for p in ("\u2581", "a", "\u2581the", "中", "<s>", "</s>", "<0x+8>")]
    same_as_full = 0
    for case in range(2000):
        codec = codecs_[list(CHAINS)[case % len(CHAINS)]]
        size = rng.randint(1, 20)
        ids = [byte(rng.choice(values)) if rng.random() < 0.8 else rng.choice(others) for _ in range(size)]
        if rng.random() < 0.3:  # (whole characters too: runs that stay valid)
            ids = [byte(b) for b in rng.choice(["中🙂\ufffd", " a\u2581 \u2581"]).encode()] + ids
        continuation, skip = rng.random() < 0.5, rng.random() < 0.5
        got, want = pieces(codec, ids, continuation, skip), reference_pieces(codec, ids, continuation, skip)
        assert got == want, (ids, continuation, skip)
        if not sends_a_character_its_run_takes_back(codec, ids, skip):
            assert "".join(got) == full(codec, ids, continuation, skip), (ids, continuation, skip)
            same_as_full += 1
    assert same_as_full > 1000


@pytest.mark.parametrize("chain", ["llama", "gemma", "metaspace"])
@pytest.mark.parametrize("continuation", [False, True], ids=["echoed-prompt", "completion"])
def test_long_byte_runs_decode_in_linear_work(codecs_, monkeypatch, chain, continuation):
    """2000 lone `<0x80>` tokens (never a character), then a piece, then 2000 valid U+FFFD characters (EF BF BD:
    valid, but the text still ends in U+FFFD), then skipped special tokens: each decoded the whole window again
    for every token (~len**2 / 2 ids: 8000 tokens, 32 million); now a few ids per token."""
    codec = codecs_[chain]
    n = 2000
    ids = [byte(0x80)] * n + [PIECES.index("a")] + [byte(b) for b in "\ufffd".encode()] * (n // 3) \
        + [PIECES.index("</s>")] * n + [byte(0xE4), byte(0xB8), byte(0xAD)]
    work = counting(codec, monkeypatch)
    got = pieces(codec, ids, continuation)
    assert work[0] < 20 * len(ids), work[0]  # (was ~len(ids)**2 / 2)
    assert "".join(got) == full(codec, ids, continuation, True)  # (the chunks: the fuzz above)


def test_echo_offsets_of_a_byte_fallback_prompt_are_linear_work(codecs_, monkeypatch):
    """`echo` + `logprobs` measures a token-id prompt's text offsets with the decoder, on the event loop."""
    codec = codecs_["llama"]
    ids = [byte(0x80)] * 4000
    work = counting(codec, monkeypatch)
    offsets, length = echo_offsets(codec, ids)
    assert work[0] < 20 * len(ids), work[0]
    assert length == 4000 and offsets == sorted(offsets) and offsets[-1] <= length
