"""Text for the server: encoding prompts, the chat template, incremental decoding, stop strings.

`TextCodec` wraps the model directory's `tokenizer.json` (the fast Rust tokenizer) and, for chat,
its Jinja chat template, compiled at start-up and rendered in a bounded sandbox
(`chat_template.py`). A model directory without a tokenizer is served for token-id prompts only:
text fields are empty and tokens are shown as `token_id:N`.
"""

from __future__ import annotations

import codecs
import json
import re
import weakref
from collections.abc import Callable
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

from recurrent_depth.data.tokenizer import tokenizer_failures_as_errors
from recurrent_depth.serving.chat_template import ChatTemplate, load_template

REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence yields
MAX_INCOMPLETE_TOKENS = 3  # tokens an incomplete UTF-8 character can span at the end of a text (its 1-3 bytes)
MAX_TEXT_CHARS = 64 << 20  # rendered chat prompts stop here whatever the context
# Unicode noncharacters (reserved for a program's internal use) mark special-token text in messages.
PLACEHOLDER_OPEN, PLACEHOLDER_CLOSE = "\ufdd0", "\ufdd1"
_PLACEHOLDER = re.compile("\ufdd0(\\d+)\ufdd1")
_BYTE_PIECE = re.compile("<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback token
# `TextCodec.byte_kind` of a token that is not a byte: one that ends a run of bytes, one that decoding leaves out
# (a skipped special token), one whose part in a run is not known (the slow, exact way decodes it)
BOUNDARY, GONE, UNSURE = -1, -2, -3
_PIECE_CHARS = set("<>0123456789abcdefxABCDEF")  # what a `<0xNN>` piece is written with


def special_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """The texts of a `tokenizers.Tokenizer`'s special tokens as one pattern, longest first (None: it has none)."""
    added = tokenizer.get_added_tokens_decoder()
    specials = sorted({t.content for t in added.values() if t.special and t.content}, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in specials)) if specials else None


class LiteralSpecials:
    """Special-token texts inside messages (contents, tool calls, tools, template variables) kept as plain text, so
    that a message cannot forge a turn: `escape` swaps each for a placeholder (noted in `literals`) before the chat
    template renders, and `encode` tokenizes the render with each placeholder's text put back as plain text and the
    template's own special tokens as their ids. The server's prompts (`TextCodec.encode_chat`) and SFT's examples
    (`data.chat.ExampleEncoder`) are both tokenized this way, so training sees what serving sends."""

    def __init__(self, pattern: re.Pattern[str] | None) -> None:
        self.pattern = pattern  # `special_pattern(tokenizer)`
        self.literals: list[str] = []

    def escape(self, value: Any, where: str) -> Any:
        """`value` (a string, or lists and dicts of them: a tool call's arguments, a tool's name) escaped."""
        if self.pattern is None:  # (no special token to forge)
            return value
        if isinstance(value, str):
            if PLACEHOLDER_OPEN in value or PLACEHOLDER_CLOSE in value:
                raise ValueError(f"{where} holds the Unicode noncharacter U+FDD0 or U+FDD1, which rdepth serve "
                                 "reserves for its own use: remove it")
            return self.pattern.sub(self._swap, value)
        if isinstance(value, list):
            return [self.escape(v, where) for v in value]
        if isinstance(value, dict):
            return {self.escape(k, where): self.escape(v, where) for k, v in value.items()}
        return value

    def _swap(self, match: re.Match[str]) -> str:
        self.literals.append(match.group(0))
        return f"{PLACEHOLDER_OPEN}{len(self.literals) - 1}{PLACEHOLDER_CLOSE}"

    def encode(self, tokenizer: Any, text: str, check: Callable[[str], None] | None = None) -> list[int]:
        """The ids of a rendered `text` holding placeholders, as `tokenizer` encodes the render in one call
        but with each placeholder's text put back as plain text. Encoding each piece between the template's special
        tokens alone differed from that: a sentencepiece-style tokenizer (Metaspace "first": Llama-2, Mistral) began
        every piece with '\u2581' as the start of a text, and a special token's lstrip/rstrip (Phi-3's) no longer took
        in the whitespace beside it. `check(text)` (a bound on its size) sees the text before it is tokenized."""
        if self.pattern is None:  # (no special token: `escape` noted no literal)
            raise ValueError("LiteralSpecials.encode needs the special-token pattern of the tokenizer")
        copy, alias, back = _aliased(tokenizer, self.pattern)
        template_text = _PLACEHOLDER.sub("", text)
        if PLACEHOLDER_OPEN in template_text or PLACEHOLDER_CLOSE in template_text:
            raise ValueError("the chat template writes the Unicode noncharacter U+FDD0 or U+FDD1, which rdepth "
                             "reserves for its own use: remove it from the template")
        controls = 0

        def swap(match: re.Match[str]) -> str:
            nonlocal controls
            if match.group(1) is not None:  # a placeholder: the literal's text, which the copy reads as text
                return self.literals[int(match.group(1))]
            controls += 1
            return alias[match.group(0)]

        aliased = re.sub(f"{_PLACEHOLDER.pattern}|{self.pattern.pattern}", swap, text)
        if check is not None:
            check(aliased)
        with tokenizer_failures_as_errors():  # a 400 for the request, not a dead worker
            ids = copy.encode(aliased, add_special_tokens=False).ids
        if sum(i in back for i in ids) != controls:  # (a `single_word` special token not standing alone)
            raise ValueError("the chat template writes a special token where the tokenizer does not read it as one "
                             "(a single_word token inside a word): fix the template")
        return [back.get(i, i) for i in ids]


# Each tokenizer's copy for `LiteralSpecials.encode` (built on the first message holding a special token's text)
_ALIASED: weakref.WeakKeyDictionary[Any, tuple[str, Any, dict[str, str], dict[int, int]]] = \
    weakref.WeakKeyDictionary()


def _aliased(tokenizer: Any, pattern: re.Pattern[str]) -> tuple[Any, dict[str, str], dict[int, int]]:
    """A copy of `tokenizer` that reads its special tokens' texts as plain text, in which each special token has a
    second text, its alias (a number between U+FDD0 and U+FDD1, which `escape` keeps out of the messages: the
    placeholders' form, all put back before this copy encodes), with the same flags
    (lstrip, rstrip, normalized): the copy encodes a render with aliases as `tokenizer` does it with the special
    tokens' texts. Returns the copy, each special text's alias, and each alias id's token id in `tokenizer`."""
    cached = _ALIASED.get(tokenizer)
    if cached is not None and cached[0] == pattern.pattern:
        return cached[1:]
    from tokenizers import AddedToken, Tokenizer

    specials = {t.content: t for t in tokenizer.get_added_tokens_decoder().values() if t.special and t.content}
    # (each between U+FDD0 and U+FDD1, which the render holds nowhere else: no alias matches across two of them, even
    # in tokenizers' separate passes for normalized and raw tokens)
    alias = {text: f"{PLACEHOLDER_OPEN}{i}{PLACEHOLDER_CLOSE}" for i, text in enumerate(sorted(specials))}
    copy = Tokenizer.from_str(tokenizer.to_str())
    copy.encode_special_tokens = True  # the special tokens' texts are plain text; the aliases are not special
    copy.add_tokens([AddedToken(alias[text], special=False, normalized=t.normalized, lstrip=t.lstrip,
                                rstrip=t.rstrip, single_word=t.single_word) for text, t in specials.items()])
    back: dict[int, int] = {}
    for text, name in alias.items():
        i = copy.token_to_id(name)
        if i is None or tokenizer.id_to_token(i) is not None:  # (a vocabulary with gaps in its ids)
            raise ValueError("this tokenizer's ids leave no free id past its tokens, which a message holding a "
                             "special token's text needs: remove that text from the message")
        back[i] = tokenizer.token_to_id(text)
    _ALIASED[tokenizer] = (pattern.pattern, copy, alias, back)
    return copy, alias, back


class ContextTooLong(ValueError):
    """A text that cannot fit the model's context, known before tokenizing it."""


def _piece_rules(decoder: Any) -> tuple[list[tuple[str, str]], bool]:
    """What a SentencePiece-style decoder (Gemma's, Llama's) does to one piece: its replacements (`Metaspace`,
    `Replace("\u2581", " ")`) and whether `<0xHH>` pieces stand for byte HH (`ByteFallback`)."""
    try:
        state = json.loads(decoder.__getstate__())
    except Exception:  # noqa: BLE001 - no decoder, or one without a readable state: pieces as they are
        return [], False
    steps = state.get("decoders") or [] if state.get("type") == "Sequence" else [state]
    replacements, fallback = [], False
    for step in steps:
        kind = step.get("type") if isinstance(step, dict) else None
        if kind == "Metaspace":
            replacements.append((step.get("replacement") or "\u2581", " "))
        elif kind == "Replace" and isinstance((step.get("pattern") or {}).get("String"), str):
            replacements.append((step["pattern"]["String"], step.get("content") or ""))
        elif kind == "ByteFallback":
            fallback = True
    return replacements, fallback


def _runs_decode_alone(decoder: Any) -> bool:
    """Whether `decoder` (a `ByteFallback` chain: Llama's, Mistral's, Gemma's) writes a run of `<0xNN>` pieces after
    other text as the run alone: the characters of its bytes where they are all valid UTF-8 (each character's text
    the same after any other text), else one U+FFFD per byte. Steps before `ByteFallback` must leave `<0xNN>`
    pieces as they are; the later ones act on each character (one-character `Replace`, `Metaspace` that drops no
    leading replacement) or on the text's start (`Strip` of one character after `Fuse`); none empties a piece, so
    text before a run keeps `Strip` off it."""
    try:
        state = json.loads(decoder.__getstate__())
    except Exception:  # noqa: BLE001 - no decoder, or one without a readable state
        return False
    steps = state.get("decoders") or [] if state.get("type") == "Sequence" else [state]
    fallback = fused = False
    for step in steps:
        kind = step.get("type") if isinstance(step, dict) else None
        if kind == "ByteFallback":
            fallback = True
        elif kind == "Fuse":
            if not fallback:  # (fused first, the pieces are one string: no `<0xNN>` piece is left to read as a byte)
                return False
            fused = True
        elif kind == "Replace" and isinstance((step.get("pattern") or {}).get("String"), str):
            old, new = step["pattern"]["String"], step.get("content") or ""
            if REPLACEMENT in old or not new or (len(old) != 1 if fallback else _PIECE_CHARS & set(old + new)):
                return False
        elif kind == "Metaspace":  # (any other prepend_scheme drops every replacement of the first piece)
            if step.get("replacement") in _PIECE_CHARS | {REPLACEMENT} or step.get("prepend_scheme") != "never":
                return False
        elif kind == "Strip":  # (after `Fuse`: the text's start, which the text before a run holds)
            if not (fallback and fused and step.get("content") != REPLACEMENT and step.get("start", 0) <= 1
                    and step.get("stop", 0) == 0):
                return False
        else:
            return False
    return fallback


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


def tokenizer_file(path: str | Path | None, required: bool = False) -> Path | None:
    """The `tokenizer.json` that `path` (a directory or that file) names; None where a directory has
    none and `required` is False. A ValueError line for a path that is missing, not a regular file or
    directory (a FIFO, a device), or a directory whose `tokenizer.json` is not a regular file."""
    if path is None:
        return None
    given = Path(path)
    if not given.exists():
        raise ValueError(f"tokenizer {str(given)!r}: no such file or directory (expected a directory holding "
                         "tokenizer.json, or that file)")
    if given.is_dir():
        file = given / "tokenizer.json"
        if not file.exists() and not file.is_symlink():
            if required:
                raise ValueError(f"tokenizer {str(given)!r}: the directory holds no tokenizer.json")
            return None
    else:
        file = given
    if not file.is_file():  # a FIFO would block the read, a device never end it
        raise ValueError(f"tokenizer {str(file)!r} is not a regular file")
    return file


def turn_end_ids(model_dir: str | Path, vocab_size: int) -> list[int]:
    """The ids a chat turn ends at in `model_dir`, sorted: what `rdepth serve` stops a chat at
    (`TextCodec.chat_stop_ids`: `<|end_turn|>` and the chat template's end of turn). [] where the directory has no
    tokenizer.json, no usable chat template, or a tokenizer that does not fit `vocab_size`. The generation configs
    that transformers users load add them to eos_token_id (integrations/export.py, integrations/hf.py)."""
    try:
        codec = TextCodec(model_dir, vocab_size)
    except ValueError:  # a tokenizer the model cannot serve: no chat to stop
        return []
    return sorted(codec.chat_stop_ids) if codec.chat is not None else []


class TextCodec:
    """Encode/decode with a model directory's tokenizer; None-safe when there is none.

    `context` (the model's max_seq_len) bounds what is worth tokenizing: a text longer than
    `context` x the longest token (in bytes) cannot fit, and is refused before it is tokenized.
    """

    def __init__(self, model_dir: str | Path | None, vocab_size: int, context: int | None = None,
                 required: bool = False, probe_end_of_turn: bool = True) -> None:
        """`model_dir`: a directory holding `tokenizer.json` (and the chat template), a `tokenizer.json`
        file (the template is then read beside it), or None. A directory without `tokenizer.json` is
        served for token ids only unless `required` (a tokenizer the user named): then, as for a path
        that is missing or not a regular file or directory (a FIFO), a ValueError line.
        `probe_end_of_turn=False` leaves `template_end_of_turn` (a render of the template) to the caller:
        the server runs it in a preparation worker, under its memory limit (`PrepPool.end_of_turn`)."""
        self.probe_end_of_turn = probe_end_of_turn
        self.vocab_size = vocab_size
        self.context = context
        self.tokenizer: Any = None
        self.source = str(model_dir) if model_dir is not None else None  # what workers rebuild this codec from
        file = tokenizer_file(model_dir, required)
        self.model_dir = file.parent if file is not None else (Path(model_dir) if model_dir is not None else None)
        if file is not None:
            from recurrent_depth.data.tokenizer import check_fits_vocab, load_tokenizer

            self.tokenizer = load_tokenizer(file)
            check_fits_vocab(self.tokenizer, vocab_size, file)
        self.special_ids: set[int] = set()
        self.eos_ids: set[int] = set()
        self.chat_stop_ids: set[int] = set()
        self.longest_token_bytes = 1
        self._special_pattern: re.Pattern[str] | None = None
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
            self._special_pattern = special_pattern(self.tokenizer)
        self._strings: dict[int, str] = {}
        byte_level = self.tokenizer is not None and "ByteLevel" in type(self.tokenizer.decoder).__name__
        self._byte_level = byte_level
        self._piece_rules: tuple[list[tuple[str, str]], bool] = ([], False)
        if self.tokenizer is not None:
            self.longest_token_bytes = max(  # (pieces as the normalizer writes them: min_tokens' bound)
                (len(self.token_bytes(i)) for i in range(self.tokenizer.get_vocab_size(with_added_tokens=True))),
                default=1) or 1
            if not byte_level:  # a SentencePiece piece shows its text: "\u2581the" is " the", "<0xE2>" byte E2
                self._piece_rules = _piece_rules(self.tokenizer.decoder)
        self.chat: ChatTemplate | None = None
        self.chat_error: str | None = None
        if self.tokenizer is not None and self.model_dir is not None:
            self._load_chat_template()

    def _load_chat_template(self) -> None:
        """Compile the directory's chat template now (start-up), not on the first chat request."""
        assert self.model_dir is not None
        try:
            source, variables = load_template(self.model_dir)
            if source is None:
                self.chat_error = "no chat_template.jinja or chat_template in tokenizer_config.json"
                return
            cap = (self.context or MAX_TEXT_CHARS) * self.longest_token_bytes
            self.chat = ChatTemplate(source, variables, max_output_chars=min(cap, MAX_TEXT_CHARS))
        except Exception as exc:  # noqa: BLE001 - a broken template only disables chat
            self.chat_error = f"the chat template could not be loaded: {type(exc).__name__}: {exc}"
            return
        if self.probe_end_of_turn:
            self.chat_stop_ids |= self.template_end_of_turn()

    def template_end_of_turn(self) -> set[int]:
        """The special token the chat template writes right after an assistant's content, e.g. ChatML's
        `<|im_end|>`: what `rdepth sft` teaches the model to end its turn with, so chat stops there too
        (only `<|end_turn|>` was known, and a ChatML model's chat ran on to max_tokens)."""
        assert self.chat is not None
        sentinel = "rdepthendofturnprobe"
        try:
            text = self.chat.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": sentinel}],
                                    add_generation_prompt=False)
            at = text.find(sentinel)
            ids = self._ids(text[at + len(sentinel):], add_special_tokens=False) if at >= 0 else []
        except Exception:  # noqa: BLE001 - a template that cannot render this pair keeps the named stops
            return set()
        return {ids[0]} if ids and ids[0] in self.special_ids else set()

    @property
    def has_tokenizer(self) -> bool:
        return self.tokenizer is not None

    # ------------------------------------------------------------------ prompts
    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens `text` encodes to, without tokenizing it: no token covers
        more bytes than the vocabulary's longest (after the tokenizer's normalizer, which may
        shorten text)."""
        if self.tokenizer is not None and self.tokenizer.normalizer is not None:
            with tokenizer_failures_as_errors():
                text = self.tokenizer.normalizer.normalize_str(text)
        return -(-len(text.encode("utf-8", "surrogatepass")) // self.longest_token_bytes)

    def check_fits(self, text: str, param: str) -> None:
        """ValueError (context_length_exceeded) for a text that cannot fit the context."""
        if self.context is None:
            return
        least = self.min_tokens(text)
        if least > self.context:
            raise ContextTooLong(
                f"the {param} is {len(text.encode('utf-8', 'surrogatepass'))} bytes, so at least {least} tokens "
                f"(no token is longer than {self.longest_token_bytes} bytes): more than the model's context of "
                f"{self.context} tokens")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer.json: send token-id prompts")
        self.check_fits(text, "prompt")
        return self._ids(text, add_special_tokens)

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        with tokenizer_failures_as_errors():  # a 400 for the request, not a dead worker
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    variables: dict[str, Any] | None = None) -> list[int]:
        """Token ids of the chat template applied to `messages` (and `tools`, the template's `tools` variable),
        with the assistant's turn opened (`add_generation_prompt`) or the final message left open to continue
        (`continue_final_message`); `variables`: extra template variables (`ChatTemplate.render`'s).

        Special-token strings inside message contents, tools and variables stay plain text (so a message cannot forge
        a turn): they are swapped for placeholders before rendering, and the render is tokenized as in one call with
        those texts read as plain text (`LiteralSpecials.encode`), as a render without them is.
        """
        if self.chat is None:
            raise ValueError(f"this model directory has no usable chat template ({self.chat_error}); "
                             "use /v1/completions")
        for m in messages:
            self.check_fits(m["content"], "message content")
        literal = LiteralSpecials(self._special_pattern)
        escaped = [{k: literal.escape(v, f"messages[{i}].{k}") for k, v in m.items()} for i, m in enumerate(messages)]
        escaped_tools = None if tools is None else [literal.escape(t, f"tools[{i}]") for i, t in enumerate(tools)]
        escaped_variables = None if variables is None else {
            k: literal.escape(v, f"chat_template_kwargs.{k}") for k, v in variables.items()}
        text = self.chat.render(escaped, add_generation_prompt, escaped_tools, continue_final_message,
                                escaped_variables)
        if not literal.literals:  # the common case: exactly what tokenizing the rendered text gives
            self.check_fits(text, "rendered chat prompt")
            return self._ids(text, add_special_tokens=False)
        return literal.encode(self.tokenizer, text, lambda whole: self.check_fits(whole, "rendered chat prompt"))

    # ------------------------------------------------------------------ output
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids, special tokens left out (as OpenAI-compatible servers do: vLLM's
        `skip_special_tokens=True`) unless `skip_special_tokens` is False (an echoed token-id prompt)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

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
        replacements, fallback = self._piece_rules
        if token not in self.special_ids and (replacements or fallback):
            byte = _BYTE_PIECE.fullmatch(piece) if fallback else None
            if byte is not None:
                return bytes([int(byte.group(1), 16)])
            for old, new in replacements:
                piece = piece.replace(old, new)
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

    @cached_property
    def byte_runs(self) -> bool:
        """Whether `IncrementalDecoder` may write a run of byte-fallback tokens without decoding it again for each
        token (`ByteRun`): a SentencePiece byte-fallback decoder that `_runs_decode_alone` knows, and an anchor to
        decode a character after."""
        return self.tokenizer is not None and not self._byte_level and bool(self.anchor) \
            and _runs_decode_alone(self.tokenizer.decoder)

    def byte_kind(self, token: int, skip_special_tokens: bool) -> int:
        """What `token` is to a byte-fallback decoder: its byte (0-255) for a `<0xNN>` piece, GONE for a special
        token that decoding skips, BOUNDARY for any other piece (it ends a run of bytes), UNSURE for an id without
        a piece, an empty piece, or a piece the decoder may read as a byte that `_BYTE_PIECE` does not (`<0x+8>`, an
        added token's)."""
        if skip_special_tokens and token in self.special_ids:
            return GONE
        piece = self.tokenizer.id_to_token(token)
        if not piece:  # (an empty piece would leave the text before a run empty: `Strip` would reach the run)
            return UNSURE
        if len(piece) != 6 or not piece.startswith("<0x") or not piece.endswith(">"):
            return BOUNDARY
        byte = _BYTE_PIECE.fullmatch(piece)
        return int(byte.group(1), 16) if byte is not None and token not in self._added_ids else UNSURE

    @cached_property
    def _added_ids(self) -> set[int]:
        """Added tokens' ids (special or not: an added `<0x41>` is not one of the model's byte pieces)."""
        return set(self.tokenizer.get_added_tokens_decoder())

    def decoder(self, continuation: bool = False, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, continuation, skip_special_tokens)

    @cached_property
    def anchor(self) -> list[int]:
        """One plain token (a letter) that continuation text is decoded after: a decoder that strips its
        text's leading space (Llama's and Mistral's `Strip`, `Metaspace`) strips the anchor's, not the
        first generated token's (a completion " the" came out as "the")."""
        if self.tokenizer is None:
            return []
        for letter in "aeoxAEOX":
            token = self.tokenizer.token_to_id(letter)
            if token is not None and token not in self.special_ids and self.decode([token]) == letter:
                return [token]
        return []


class ByteRun:
    """The text a byte-fallback decoder (`TextCodec.byte_runs`) writes for a run of `<0xNN>` tokens after other
    text, kept up to date token by token instead of decoding the run again: its characters while its bytes are
    whole valid UTF-8, else one U+FFFD per byte. A run that is not valid UTF-8 never becomes valid again (a later
    byte cannot repair it), so from then on each byte adds one U+FFFD until a token that is not a byte ends the run."""

    def __init__(self, codec: TextCodec, skip_special_tokens: bool, start: int, front: bool) -> None:
        """start: the index of its first token in the decoder's ids; front: it opens the decoded text, so its first
        character is decoded alone (a `Strip` of the text's leading space acts on it), the rest after the anchor."""
        self.codec, self.skip, self.start = codec, skip_special_tokens, start
        self.front, self.alone = front, front
        self.bytes = 0
        self.chars: list[str] | None = []  # its complete characters' text; None once its bytes are not valid UTF-8
        self.trail = 0  # U+FFFD characters at the end of `chars` (the text of a valid EF BF BD)
        self.pending: list[int] = []  # the tokens of an incomplete character at its end
        self.utf8 = codecs.getincrementaldecoder("utf-8")()
        self.after = len(codec.decode(codec.anchor))

    def add(self, token: int, byte: int) -> None:
        self.bytes += 1
        if self.chars is None:
            return
        self.pending.append(token)
        try:
            if not self.utf8.decode(bytes([byte])):  # (an incomplete character)
                return
        except UnicodeDecodeError:
            self.chars = None
            return
        if self.alone:
            text, self.alone = self.codec.decode(self.pending, self.skip), False
        else:  # (a character's text does not depend on what it follows: `_runs_decode_alone`)
            text = self.codec.decode(self.codec.anchor + self.pending, self.skip)[self.after :]
        self.pending = []
        kept = text.rstrip(REPLACEMENT)
        self.trail = len(text) - len(kept) + (self.trail if not kept else 0)
        self.chars.extend(text)

    def _whole(self) -> list[str] | None:
        """Its characters where its bytes are whole valid UTF-8 (else its text is one U+FFFD per byte)."""
        return self.chars if not self.pending else None

    def __len__(self) -> int:
        chars = self._whole()
        return len(chars) if chars is not None else self.bytes

    def trailing(self) -> int:
        """The U+FFFD characters its text ends with."""
        return self.trail if self._whole() is not None else self.bytes

    def text(self, i: int, j: int) -> str:
        """Its text's characters [i:j] (0 <= i, j <= len)."""
        chars = self._whole()
        return "".join(chars[i:j]) if chars is not None else REPLACEMENT * (j - i)


class _Window:
    """A decoder window's text: `head`, decoded, then a `ByteRun`'s (if any), without joining them."""

    def __init__(self, head: str, run: ByteRun | None = None) -> None:
        self.head, self.run = head, run

    def __len__(self) -> int:
        return len(self.head) + (len(self.run) if self.run is not None else 0)

    def incomplete(self) -> bool:
        """Whether it ends in U+FFFD."""
        if self.run is not None and len(self.run):
            return self.run.trailing() > 0
        return self.head.endswith(REPLACEMENT)

    def stable(self) -> int:
        """Its length without the U+FFFD at its end."""
        if self.run is not None and len(self.run) > self.run.trailing():
            return len(self) - self.run.trailing()
        return len(self.head.rstrip(REPLACEMENT))

    def slice(self, i: int, j: int) -> str:
        """Its characters [i:j] (0 <= i, j <= len)."""
        out, size = self.head[i:j], len(self.head)
        if self.run is not None and j > size:
            out += self.run.text(max(i - size, 0), j - size)
        return out


class IncrementalDecoder:
    """Text deltas of a growing token list, without decoding the whole list each time.

    Decodes a short window (`ids[prefix:]`) and emits what it adds beyond `ids[prefix:read]`;
    an incomplete UTF-8 sequence at the end is held back until a later token completes it, but the
    text before it is emitted now (`sent` counts it): holding the whole delta held every token of a
    text whose tokens each end inside a character (CJK in byte-level vocabularies), so nothing
    streamed, and a stop string in it was never seen when generation then ended (max_tokens, eos).
    """

    def __init__(self, codec: TextCodec, continuation: bool = False, skip_special_tokens: bool = True) -> None:
        """continuation: the ids continue a text (a completion after its prompt), so a first token's leading
        space is text (decoded after `codec.anchor`); skip_special_tokens: as `TextCodec.decode`'s."""
        self.codec = codec
        self.skip = skip_special_tokens
        self.anchor = codec.anchor if continuation else []
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0
        self.sent = 0  # characters past `ids[prefix:read]`'s text already emitted (before an incomplete tail)
        self._texts: dict[tuple[int, int], str] = {}  # `_text`'s decodes of the window's start
        # byte-fallback decoders: the window's run of bytes (from `_run_from` on, while it is known) and its text
        self._run_from: int | None = 0
        self._run: ByteRun | None = None

    def _text(self, end: int) -> str:
        """`ids[prefix:end]` decoded (after the anchor), kept while it is asked for again: the text before the
        window's unread tokens, and before its run of bytes."""
        key = (self.prefix, end)
        if key not in self._texts:
            if len(self._texts) > 4:
                self._texts.clear()
            self._texts[key] = self.codec.decode(self.anchor + self.ids[self.prefix : end], self.skip)
        return self._texts[key]

    def push(self, token: int) -> str:
        self.ids.append(token)
        if not self.codec.has_tokenizer:
            return ""
        before = self._text(self.read)
        after = self._run_window(token) if self.codec.byte_runs else None
        if after is None:
            after = _Window(self.codec.decode(self.anchor + self.ids[self.prefix :], self.skip))
        start = len(before) + self.sent
        if len(after) > len(before) and not after.incomplete():
            self.prefix, self.read, self.sent = self.read, len(self.ids), 0
            return after.slice(start, len(after))
        # an incomplete character at the end: the text before it is final (later bytes cannot change it)
        stable = after.stable()
        out = ""
        if stable > start:
            self.sent += stable - start
            out, start = after.slice(start, stable), stable
        # (byte-level decoders only: a SentencePiece byte-fallback decoder shows a whole run of byte tokens as
        # U+FFFD once any of it is invalid, so there a later token can change the run's earlier text)
        if self.codec._byte_level and len(self.ids) - self.read > MAX_INCOMPLETE_TOKENS:
            out += self._settle(after.head, start)
        return out

    def _run_window(self, token: int) -> _Window | None:
        """The window's text where it ends in a run of byte tokens: its text before the run, decoded once, and the
        run's (`ByteRun`), so a run that never completes a character (which keeps the window open) is not
        decoded again for each token (quadratic: 8000 lone `<0x80>` tokens cost 32 million decoded ids). None:
        decode the window (the token ends a run, or the run holds a token of unknown part in it)."""
        kind = self.codec.byte_kind(token, self.skip)
        if kind in (BOUNDARY, UNSURE):
            self._run_from = len(self.ids) if kind == BOUNDARY else None
            return None
        if self._run_from is None:
            return None
        start = max(self._run_from, self.prefix)  # (the window may begin inside the run)
        front = start == self.prefix and not self.anchor
        run = self._run
        if run is None or run.start != start or run.front != front:  # (a moved window: its run anew)
            run = self._run = ByteRun(self.codec, self.skip, start, front)
            added = self.ids[start:]
        else:
            added = [token]
        for t in added:
            byte = self.codec.byte_kind(t, self.skip)
            if byte >= 0:
                run.add(t, byte)
        return _Window(self._text(start), run)

    def _settle(self, after: str, start: int) -> str:
        """Close the window before its last `MAX_INCOMPLETE_TOKENS` tokens where the text up to there can no longer
        change: a run of bytes that never completes a character (U+FFFD at the end after every token) kept the
        window open, so each token decoded the whole run again (quadratic: an echoed 8000-token prompt of such
        bytes held the event loop 11 s). `after`: the window's text; `start`: how much of it is emitted. Returns
        the text it emits."""
        at = len(self.ids) - MAX_INCOMPLETE_TOKENS
        # an incomplete character has at most 3 bytes, so it lies within the last 3 tokens if each has a byte
        if any(not self.codec.decode([t], self.skip) for t in self.ids[at:]):
            return ""
        settled = self.codec.decode(self.anchor + self.ids[self.prefix : at], self.skip)
        # the window from the token before `at` (its context, as a moved window keeps) must read the same after it
        context = self.codec.decode(self.anchor + self.ids[at - 1 : at], self.skip)
        rest = self.codec.decode(self.anchor + self.ids[at - 1 :], self.skip)
        if not after.startswith(settled) or rest[len(context) :] != after[len(settled) :] \
                or not rest.startswith(context):
            return ""
        out = after[start : len(settled)]
        self.prefix, self.read, self.sent = at - 1, at, max(0, start - len(settled))
        return out

    def flush(self) -> str:
        """Whatever is still held back (an incomplete UTF-8 tail decodes to U+FFFD)."""
        if not self.codec.has_tokenizer or self.read == len(self.ids):
            return ""
        before = self.codec.decode(self.anchor + self.ids[self.prefix : self.read], self.skip)
        after = self.codec.decode(self.anchor + self.ids[self.prefix :], self.skip)
        self.prefix = self.read = len(self.ids)
        out, self.sent = after[len(before) + self.sent :], 0
        return out


class TextState:
    """A completion's text as tokens arrive: incremental decoding plus stop strings.

    `push(token)` returns (text safe to emit now, stop string hit). Text that could be the start
    of a stop string is held back until it is clear; a hit cuts the text just before the stop
    string (which is not returned, as OpenAI's API does, unless `include_stop`: vLLM's
    include_stop_str_in_output); `matched` is then that stop string (vLLM's `stop_reason`).
    `skip_special_tokens`: as `TextCodec.decode`'s.
    """

    def __init__(self, codec: TextCodec, stop: list[str], skip_special_tokens: bool = True,
                 include_stop: bool = False) -> None:
        # (a completion continues its prompt)
        self.decoder = codec.decoder(continuation=True, skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.pending = ""
        self.text = ""
        self.matched: str | None = None  # the stop string generation ended at

    def _before_stop(self, buffer: str) -> str | None:
        """`buffer` cut just before its first stop string (after it with `include_stop`), which becomes `matched`;
        None where it holds none."""
        hits = [(i, s) for i, s in ((buffer.find(s), s) for s in self.stop) if i >= 0]
        if not hits:
            return None
        at, self.matched = min(hits, key=lambda hit: hit[0])  # the first stop string in the text
        return buffer[: at + len(self.matched) if self.include_stop else at]

    def push(self, token: int) -> tuple[str, bool]:
        buffer = self.pending + self.decoder.push(token)
        out = self._before_stop(buffer)
        if out is not None:
            self.pending = ""
            self.text += out
            return out, True
        cut = max(0, len(buffer) - self.hold) if self.stop else len(buffer)
        out, self.pending = buffer[:cut], buffer[cut:]
        self.text += out
        return out, False

    def push_stop_token(self, token: int) -> str:
        """Text to emit for the stop token (an eos or `stop_token_ids` id) that ended generation: none, or with
        `include_stop` (vLLM's include_stop_str_in_output keeps it) the text held back so far and the token's own
        (e.g. `<|im_end|>` under skip_special_tokens false), not searched for stop strings (vLLM's is not either:
        the stop token already ended generation). `flush` gives the rest."""
        if not self.include_stop:
            return ""
        out = self.pending + self.decoder.push(token)
        self.pending = ""
        self.text += out
        return out

    def flush(self) -> str:
        """The held-back tail once generation ended without hitting a stop string, cut at one it completes (the
        U+FFFD an incomplete UTF-8 tail decodes to, where a stop string holds one): `matched` then says which."""
        buffer = self.pending + self.decoder.flush()
        out = self._before_stop(buffer)
        out = buffer if out is None else out
        self.pending = ""
        self.text += out
        return out
