"""Text for the server: encoding prompts, the chat template, incremental decoding, stop strings.

`TextCodec` wraps the model directory's `tokenizer.json` (the fast Rust tokenizer) and, for chat,
its Jinja chat template through transformers' `AutoTokenizer`. A model directory without a
tokenizer is served for token-id prompts only: text fields are empty and tokens are shown as
`token_id:N`.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence yields


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """Inverse of the byte-level BPE alphabet: printable stand-in character -> byte value.

    Bytes that are printable Latin-1 characters stand for themselves; the other 68 are shifted
    to code points 256.. in increasing byte order (the convention of GPT-2-style tokenizers).
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table


class TextCodec:
    """Encode/decode with a model directory's tokenizer; None-safe when there is none."""

    def __init__(self, model_dir: str | Path | None, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.tokenizer: Any = None
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self._hf: Any = None
        self._hf_error: str | None = None
        if self.model_dir is not None and (self.model_dir / "tokenizer.json").is_file():
            from recurrent_depth.data.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(self.model_dir)
        self.special_ids: set[int] = set()
        self.eos_ids: set[int] = set()
        self.chat_stop_ids: set[int] = set()
        if self.tokenizer is not None:
            added = self.tokenizer.get_added_tokens_decoder()
            self.special_ids = {i for i, t in added.items() if t.special}
            for name in ("<|end_text|>", "</s>", "<|endoftext|>", "<|eot_id|>"):
                i = self.tokenizer.token_to_id(name)
                if i is not None:
                    self.eos_ids.add(i)
            end_turn = self.tokenizer.token_to_id("<|end_turn|>")
            if end_turn is not None:
                self.chat_stop_ids.add(end_turn)
        self._strings: dict[int, str] = {}
        byte_level = self.tokenizer is not None and "ByteLevel" in type(self.tokenizer.decoder).__name__
        self._byte_level = byte_level

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer is not None

    # ------------------------------------------------------------------ prompts
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer.json: send token-id prompts")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def _chat_tokenizer(self) -> Any:
        if self._hf is None and self._hf_error is None:
            # The fast-tokenizer class reads tokenizer_config.json and chat_template.jinja without
            # consulting config.json (whose model_type transformers does not know).
            from transformers import AutoTokenizer, PreTrainedTokenizerFast

            for loader in (PreTrainedTokenizerFast, AutoTokenizer):
                try:
                    self._hf = loader.from_pretrained(str(self.model_dir))
                    self._hf_error = None
                    break
                except Exception as exc:  # noqa: BLE001 - report any loading failure as "no chat template"
                    self._hf_error = f"{type(exc).__name__}: {exc}"
        return self._hf

    def has_chat_template(self) -> bool:
        if self.tokenizer is None:
            return False
        hf = self._chat_tokenizer()
        return hf is not None and bool(getattr(hf, "chat_template", None))

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The chat template applied to `messages`, with the assistant's generation prompt opened."""
        if not self.has_chat_template():
            detail = f" ({self._hf_error})" if self._hf_error else ""
            raise ValueError(f"this model directory has no chat template{detail}; use /v1/completions")
        return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    # ------------------------------------------------------------------ output
    def decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens left out (as OpenAI-compatible servers do)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token: int) -> bytes:
        """The raw bytes a token stands for (special tokens: their UTF-8 name)."""
        if self.tokenizer is None:
            return b""
        piece = self.tokenizer.id_to_token(token)
        if piece is None:
            return b""
        if self._byte_level and token not in self.special_ids:
            table = _byte_level_alphabet()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        return piece.encode("utf-8")

    def token_string(self, token: int) -> str:
        """A token as shown in logprobs: its text, or `bytes:\\xNN..` when it is not whole UTF-8.

        Distinct tokens get distinct strings (so `top_logprobs` keys never collide) unless two
        tokens decode to the very same text.
        """
        cached = self._strings.get(token)
        if cached is not None:
            return cached
        if self.tokenizer is None:
            out = f"token_id:{token}"
        elif token in self.special_ids:
            out = self.tokenizer.id_to_token(token) or f"token_id:{token}"
        else:
            raw = self.token_bytes(token)
            try:
                out = raw.decode("utf-8")
            except UnicodeDecodeError:
                out = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        self._strings[token] = out
        return out

    def decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self)


class IncrementalDecoder:
    """Text deltas of a growing token list, without decoding the whole list each time.

    Decodes a short window (`ids[prefix:]`) and emits what it adds beyond `ids[prefix:read]`;
    a delta ending in an incomplete UTF-8 sequence is held back until the next token completes it.
    """

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        if not self.codec.has_tokenizer:
            return ""
        before = self.codec.decode(self.ids[self.prefix : self.read])
        after = self.codec.decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete UTF-8 tail decodes to U+FFFD)."""
        if not self.codec.has_tokenizer or self.read == len(self.ids):
            return ""
        before = self.codec.decode(self.ids[self.prefix : self.read])
        after = self.codec.decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]


class TextState:
    """A completion's text as tokens arrive: incremental decoding plus stop strings.

    `push(token)` returns (text safe to emit now, stop string hit). Text that could be the start
    of a stop string is held back until it is clear; a hit cuts the text just before the stop
    string (which is never returned), as OpenAI's API does.
    """

    def __init__(self, codec: TextCodec, stop: list[str]) -> None:
        self.decoder = codec.decoder()
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.pending = ""
        self.text = ""

    def push(self, token: int) -> tuple[str, bool]:
        buffer = self.pending + self.decoder.push(token)
        if self.stop:
            hits = [i for i in (buffer.find(s) for s in self.stop) if i >= 0]
            if hits:
                out = buffer[: min(hits)]
                self.pending = ""
                self.text += out
                return out, True
        cut = max(0, len(buffer) - self.hold) if self.stop else len(buffer)
        out, self.pending = buffer[:cut], buffer[cut:]
        self.text += out
        return out, False

    def flush(self) -> str:
        """The held-back tail once generation ended without hitting a stop string."""
        out = self.pending + self.decoder.flush()
        self.pending = ""
        self.text += out
        return out
