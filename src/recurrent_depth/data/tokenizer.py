"""Byte-level BPE tokenizers with Huginn-0125's special-token layout.

Layout: the last 32 ids of the vocabulary are special tokens, in this order::

    vocab_size - 32  <|begin_text|>   bos, written at every document start
    vocab_size - 31  <|end_text|>     eos, written at every document end
    vocab_size - 30  <|begin_header|> chat: opens a role header
    vocab_size - 29  <|end_header|>   chat: closes it
    vocab_size - 28  <|end_turn|>     chat: ends a turn (a stop token)
    vocab_size - 27  <|pad|>
    vocab_size - 26 .. vocab_size - 1 <|reserved_special_0..25|> (unused; ``extra_special_tokens``
                                      take these slots, in order)

so at ``vocab_size = 65536`` the ids are exactly Huginn-0125's (bos 65504, eos 65505,
end_turn 65508, pad 65509) and at any size a config can compute them from ``vocab_size``.
Ids ``0..255`` are the 256 byte symbols and everything in between is learned merges, so any
UTF-8 text round-trips: ``decode(encode(text)) == text``.

A saved directory holds ``tokenizer.json`` (the `tokenizers` file), ``tokenizer_config.json``,
``special_tokens_map.json`` and ``chat_template.jinja``; ``transformers.AutoTokenizer`` loads it
as a ``PreTrainedTokenizerFast`` with bos/eos/pad and the chat template set.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from recurrent_depth.data.corpus import Corpus, Document, DocumentSplit, load_corpus, require_text
from recurrent_depth.files import TOKENIZER_MAX_BYTES, atomic_write_text, read_text

BEGIN_TEXT = "<|begin_text|>"
END_TEXT = "<|end_text|>"
BEGIN_HEADER = "<|begin_header|>"
END_HEADER = "<|end_header|>"
END_TURN = "<|end_turn|>"
PAD = "<|pad|>"
NUM_SPECIAL_SLOTS = 32
SPECIAL_TOKENS: tuple[str, ...] = (BEGIN_TEXT, END_TEXT, BEGIN_HEADER, END_HEADER, END_TURN, PAD) + tuple(
    f"<|reserved_special_{i}|>" for i in range(NUM_SPECIAL_SLOTS - 6)
)
# Keys of `special_token_ids`: the token name without its <| |> brackets.
SPECIAL_TOKEN_NAMES: dict[str, str] = {
    "begin_text": BEGIN_TEXT,
    "end_text": END_TEXT,
    "begin_header": BEGIN_HEADER,
    "end_header": END_HEADER,
    "end_turn": END_TURN,
    "pad": PAD,
}
NUM_BYTE_SYMBOLS = 256
MIN_VOCAB_SIZE = NUM_BYTE_SYMBOLS + NUM_SPECIAL_SLOTS
DEFAULT_VOCAB_SIZE = 4096
# Largest vocabulary `train_tokenizer` trains (64x the largest in use, Gemma's 262144): the `tokenizers` BPE trainer
# reserves tables for vocab_size entries up front, ~66 bytes each, and a request past the machine's memory (2**31 - 1:
# 141 GB) aborts the process.
MAX_TRAINED_VOCAB_SIZE = 1 << 24
DEFAULT_ASSISTANT_NAME = "Huginn"  # the header Huginn-0125's chat template opens the reply with

# Pre-tokenisation split (the widely used cl100k pattern): words with one leading non-letter,
# numbers in groups of at most three digits, punctuation runs, newline runs, and whitespace runs
# that leave the last space to the next word. Splitting is lossless, so round trips stay exact.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# Documents longer than this many characters are tokenised (and fed to the BPE trainer) in pieces of at
# most this size, so the tokenizer's per-token bookkeeping (~100x the text in bytes) stays bounded.
PIECE_CHARS = 1 << 18


def text_pieces(text: str, piece_chars: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in consecutive pieces of at most `piece_chars` characters; a text that fits is one piece.

    A cut goes, by preference, right after a newline that a non-space character follows, else between a
    letter and a space that a letter follows. The byte-level tokenizer's pre-tokenisation
    (`SPLIT_PATTERN`) always ends a word at such a point and starts the next one there
    without looking back, so the pieces' token ids concatenate to exactly the whole text's. Only a
    window of `piece_chars` with neither point (one endless word) gets a plain cut.
    """
    if piece_chars < 2:
        raise ValueError(f"piece_chars must be >= 2, got {piece_chars}")
    start = 0
    while len(text) - start > piece_chars:
        cut = _cut_point(text, start, start + piece_chars)
        yield text[start:cut]
        start = cut
    yield text[start:]


def _cut_point(text: str, start: int, end: int) -> int:
    """The last cut in (start, end] after a newline before non-space, else in `letter|space letter`, else end."""
    pos = end
    while (newline := text.rfind("\n", start, pos)) >= 0:
        if not text[newline + 1].isspace():  # newline + 1 <= end - 1 < len(text)
            return newline + 1
        pos = newline
    pos = end
    while (space := text.rfind(" ", start + 1, pos)) >= 0:
        if text[space - 1].isalpha() and space + 1 < len(text) and text[space + 1].isalpha():
            return space
        pos = space
    return end


def slot_tokens(extra_special_tokens: Sequence[str] = ()) -> tuple[str, ...]:
    """The 32 special-slot tokens in id order: `SPECIAL_TOKENS` with `extra_special_tokens` (a user's own,
    e.g. tool-call markers) in the first reserved slots, so the named tokens keep their ids."""
    extra = list(extra_special_tokens)
    free = NUM_SPECIAL_SLOTS - len(SPECIAL_TOKEN_NAMES)
    if isinstance(extra_special_tokens, str) or not all(isinstance(t, str) and t.strip() == t != "" for t in extra):
        raise ValueError(f"extra special tokens must be non-empty strings without surrounding whitespace, "
                         f"got {extra_special_tokens!r}")
    if len(extra) > free:
        raise ValueError(f"at most {free} extra special tokens fit the reserved slots, got {len(extra)}")
    taken = [t for t in extra if t in SPECIAL_TOKENS or extra.count(t) > 1]
    if taken:
        raise ValueError(f"extra special token {taken[0]!r} is a built-in special token or given twice")
    # One character of the byte-level alphabet is always a byte symbol's token: refused now, not after the training.
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    symbol = next((t for t in extra if t in alphabet), None)
    if symbol is not None:
        raise ValueError(f"extra special token {symbol!r} is the spelling of a byte symbol of the byte-level "
                         f"vocabulary; choose a spelling that is not a word, such as '<|{symbol}|>'")
    named = len(SPECIAL_TOKEN_NAMES)
    return SPECIAL_TOKENS[:named] + tuple(extra) + SPECIAL_TOKENS[named + len(extra):]


def special_token_layout(vocab_size: int) -> dict[str, int]:
    """The ids `train_tokenizer` gives the named special tokens for a vocabulary of this size."""
    _check_vocab_size(vocab_size)
    base = vocab_size - NUM_SPECIAL_SLOTS
    return {name: base + SPECIAL_TOKENS.index(token) for name, token in SPECIAL_TOKEN_NAMES.items()}


def _check_vocab_size(vocab_size: int) -> None:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int):
        raise ValueError(f"vocab_size must be an int, got {vocab_size!r}")
    if not (MIN_VOCAB_SIZE <= vocab_size <= 2**31 - 1):
        raise ValueError(
            f"vocab_size must be in [{MIN_VOCAB_SIZE}, 2**31 - 1] (256 byte symbols + 32 special "
            f"tokens + merges), got {vocab_size}"
        )


def check_trainable_vocab_size(vocab_size: int) -> None:
    """`_check_vocab_size`, and at most `MAX_TRAINED_VOCAB_SIZE`, which the BPE trainer can hold."""
    _check_vocab_size(vocab_size)
    if vocab_size > MAX_TRAINED_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at most {MAX_TRAINED_VOCAB_SIZE} (2**24) to train a tokenizer, got "
                         f"{vocab_size}")


def _texts(docs: Iterable[Document | str], max_bytes: int | None) -> Iterator[str]:
    """Document texts in order, stopping once ``max_bytes`` UTF-8 bytes have been produced."""
    budget = max_bytes
    for doc in docs:
        text = doc.text if isinstance(doc, Document) else doc
        if budget is None:
            # In pieces cut at word boundaries: the trainer counts the same words with bounded memory.
            yield from text_pieces(text, PIECE_CHARS)
            continue
        data = text.encode("utf-8")
        if len(data) >= budget:
            # Cut on a character boundary so the trainer never sees half a code point.
            yield from text_pieces(data[:budget].decode("utf-8", errors="ignore"), PIECE_CHARS)
            return
        budget -= len(data)
        yield from text_pieces(text, PIECE_CHARS)


# Longest pre-token (in characters) the BPE trainer sees. The `tokenizers` trainer takes time
# quadratic in a word's length (1M letters without a break: hours), so longer runs are cut into
# pieces of this size while training only. Real text never comes close (stdlib's longest is 96),
# and encoding keeps the uncut pattern.
_MAX_TRAINING_WORD_CHARS = 1024


def _byte_level_pre_tokenizer(max_word_chars: int | None = None) -> pre_tokenizers.PreTokenizer:
    steps = [pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated")]
    if max_word_chars is not None:
        steps.append(pre_tokenizers.Split(Regex(rf"[\s\S]{{1,{max_word_chars}}}"), behavior="isolated"))
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _empty_byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _byte_level_pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(
    docs: Iterable[Document | str],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    max_bytes: int | None = None,
    min_frequency: int = 0,
    max_token_length: int | None = None,
    extra_special_tokens: Sequence[str] = (),
    show_progress: bool = False,
) -> Tokenizer:
    """Train a byte-level BPE with the special-token layout described in the module docstring.

    Args:
        docs: documents or plain strings, read once, in order.
        vocab_size: total size including the 256 byte symbols and the 32 special slots.
        max_bytes: train on at most this many UTF-8 bytes, taken from the start of ``docs``
            (None = all). Training speed is roughly linear in it.
        min_frequency: a merge must occur at least this often.
        max_token_length: longest merged token in characters (None = unlimited).
        extra_special_tokens: up to 26 tokens of your own (each one id, never split), in the
            reserved slots from ``vocab_size - 26`` on, in order (`slot_tokens`).
    Returns:
        a `tokenizers.Tokenizer` whose ``encode`` prepends ``<|begin_text|>`` unless called
        with ``add_special_tokens=False``.
    Raises:
        ValueError: bad arguments, or a corpus too small to yield ``vocab_size`` tokens.
    """
    if isinstance(docs, str | bytes):
        # (else each character would be one document, and the error would blame the vocabulary size)
        raise ValueError("docs must be an iterable of documents or strings, got one string; pass [text]")
    check_trainable_vocab_size(vocab_size)
    slots = slot_tokens(extra_special_tokens)
    if max_bytes is not None and (isinstance(max_bytes, bool) or max_bytes < 1):
        raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
    if min_frequency < 0:
        raise ValueError(f"min_frequency must be >= 0, got {min_frequency}")
    tok = _empty_byte_level_bpe()
    target = vocab_size - NUM_SPECIAL_SLOTS
    trainer = trainers.BpeTrainer(
        vocab_size=target,
        min_frequency=min_frequency,
        show_progress=show_progress,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=max_token_length,
    )
    tok.pre_tokenizer = _byte_level_pre_tokenizer(_MAX_TRAINING_WORD_CHARS)
    tok.train_from_iterator(_texts(docs, max_bytes), trainer=trainer)
    tok.pre_tokenizer = _byte_level_pre_tokenizer()
    learned = tok.get_vocab_size(with_added_tokens=True)
    if learned != target:
        raise ValueError(
            f"vocab_size={vocab_size}: the corpus only supports {learned - NUM_BYTE_SYMBOLS} merges "
            f"({learned + NUM_SPECIAL_SLOTS} tokens in all); use a smaller vocab_size or more data"
        )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in slots])
    # A learned token with a special token's spelling (possible for an extra one, e.g. "TOOL") keeps its id.
    base = vocab_size - NUM_SPECIAL_SLOTS
    for offset, token in enumerate(slots):
        if tok.token_to_id(token) != base + offset:
            raise ValueError(f"special token {token!r} is already a learned token (id {tok.token_to_id(token)}); "
                             f"choose a spelling that is not a word, such as '<|{token}|>'")
    expected = special_token_layout(vocab_size)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BEGIN_TEXT} $A",
        pair=f"{BEGIN_TEXT} $A {BEGIN_TEXT} $B:1",
        special_tokens=[(BEGIN_TEXT, expected["begin_text"])],
    )
    return tok


def special_token_ids(tok: Tokenizer | Any) -> dict[str, int]:
    """``{"begin_text", "end_text", "begin_header", "end_header", "end_turn", "pad"} -> id``.

    Accepts a `tokenizers.Tokenizer` or a transformers fast tokenizer (its backend is used),
    so it also reads an official Huginn-0125 tokenizer.
    """
    backend = getattr(tok, "backend_tokenizer", tok)
    if not isinstance(backend, Tokenizer):
        raise ValueError(
            f"tok must be a tokenizers.Tokenizer or a fast HF tokenizer, got {type(tok).__name__}"
        )
    ids = {name: backend.token_to_id(token) for name, token in SPECIAL_TOKEN_NAMES.items()}
    missing = [SPECIAL_TOKEN_NAMES[name] for name, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens {missing}; train one with train_tokenizer()")
    return ids  # type: ignore[return-value]


# Document tokens of other families' tokenizers (a retrofitted or continued transformers model keeps its own):
# per role, the first one the vocabulary has. Llama 3, then Llama 2 / Mistral / TinyLlama, then the
# GPT-2-style "<|endoftext|>" separator of Qwen and OLMo-2 (which begins a document here, as it ends one).
FOREIGN_DOCUMENT_TOKENS: dict[str, tuple[str, ...]] = {
    "begin_text": ("<|begin_of_text|>", "<s>", "<|endoftext|>"),
    "end_text": ("<|end_of_text|>", "</s>", "<|endoftext|>"),
    "end_turn": ("<|eot_id|>", "<|im_end|>", "<|end_of_text|>", "</s>", "<|endoftext|>"),
}


def document_token_ids(tok: Tokenizer | Any) -> dict[str, int]:
    """The ids data preparation frames documents with: `special_token_ids(tok)` for our tokenizers;
    for another family's tokenizer, its own document tokens (`FOREIGN_DOCUMENT_TOKENS`: keys
    begin_text, end_text, end_turn, and pad = end_text). One-line error if it has neither."""
    backend = getattr(tok, "backend_tokenizer", tok)
    if not isinstance(backend, Tokenizer) or all(backend.token_to_id(t) is not None
                                                 for t in SPECIAL_TOKEN_NAMES.values()):
        return special_token_ids(tok)  # ours (or its own type error)
    ids: dict[str, int] = {}
    for role, candidates in FOREIGN_DOCUMENT_TOKENS.items():
        found = next((backend.token_to_id(t) for t in candidates if backend.token_to_id(t) is not None), None)
        if found is None:
            raise ValueError(f"tokenizer lacks our special tokens {list(SPECIAL_TOKEN_NAMES.values())} and any "
                             f"known {role} token {list(candidates)}; train one with train_tokenizer()")
        ids[role] = found
    ids["pad"] = ids["end_text"]
    return ids


def eos_token_ids(specials: dict[str, int]) -> list[int]:
    """The ids that end a generation (a model config's `eos_token_id`): end of text and end of turn,
    so a chat answer stops at the end of its turn. `specials` is `special_token_ids(tok)`."""
    return [specials["end_text"], specials["end_turn"]]


def tokenizer_sha256(tok: Tokenizer) -> str:
    """Hash of the serialised tokenizer (identifies it in dataset caches and run metadata)."""
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def chat_template(assistant_name: str = DEFAULT_ASSISTANT_NAME) -> str:
    """A Jinja chat template in Huginn-0125's format.

    ``bos`` then, per message, ``<|begin_header|>ROLE<|end_header|>\\n\\nCONTENT<|end_turn|>``
    (content trimmed; a null content, an assistant turn of tool calls only, is empty, never
    ``None``); the role ``assistant`` is written as ``assistant_name``, and the
    generation prompt opens a header for it. An assistant message's ``CONTENT<|end_turn|>`` is
    inside ``{% generation %}`` markers, which render nothing: transformers'
    ``return_assistant_tokens_mask`` (trl's ``assistant_only_loss``) marks those tokens, the ones
    ``rdepth sft`` learns.
    """
    if not re.fullmatch(r"[A-Za-z0-9_\- ]{1,64}", assistant_name):
        raise ValueError(
            f"assistant_name must be 1-64 letters, digits, spaces, '_' or '-', got {assistant_name!r}"
        )
    name = assistant_name
    return (
        "{{- bos_token -}}"
        "{%- for message in messages -%}"
        f"{{%- set role = '{name}' if message['role'] == 'assistant' else message['role'] -%}}"
        f"{{{{- '{BEGIN_HEADER}' + role + '{END_HEADER}\\n\\n' -}}}}"
        "{%- if message['role'] == 'assistant' -%}"
        "{%- generation -%}"
        f"{{{{- (message['content'] or '') | trim + '{END_TURN}' -}}}}"
        "{%- endgeneration -%}"
        "{%- else -%}"
        f"{{{{- (message['content'] or '') | trim + '{END_TURN}' -}}}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}"
        f"{{{{- '{BEGIN_HEADER}{name}{END_HEADER}\\n\\n' -}}}}"
        "{%- endif -%}"
    )


def save_tokenizer(
    tok: Tokenizer,
    out_dir: str | Path,
    *,
    assistant_name: str = DEFAULT_ASSISTANT_NAME,
    model_max_length: int | None = None,
    metadata: dict | None = None,
) -> Path:
    """Write ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` and
    ``chat_template.jinja`` (+ ``tokenizer_training.json`` when ``metadata`` is given).

    The config names ``PreTrainedTokenizerFast``, which transformers 4.x and 5.x both load; the
    chat template is in the config (4.x reads it there) and in ``chat_template.jinja`` (5.x).
    Each file is written atomically. Returns the directory.
    """
    special_token_ids(tok)  # fail early on a tokenizer without our special tokens
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    template = chat_template(assistant_name)
    # The chat tokens and any extra ones in the reserved slots (`slot_tokens`): special to transformers too
    # (one id each, dropped by skip_special_tokens).
    base = tok.token_to_id(BEGIN_TEXT)
    slots = [tok.id_to_token(base + offset) for offset in range(NUM_SPECIAL_SLOTS)]
    chat_tokens = [BEGIN_HEADER, END_HEADER, END_TURN] + [
        t for t in slots[len(SPECIAL_TOKEN_NAMES):] if t is not None and t not in SPECIAL_TOKENS
    ]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BEGIN_TEXT,
        "eos_token": END_TEXT,
        "pad_token": PAD,
        "extra_special_tokens": chat_tokens,  # transformers 5 name
        "clean_up_tokenization_spaces": False,  # would change code text (" ." -> ".") on decode
        # A decoder-only model continues a prompt from its last column, so `generate(**tok(batch, padding=True))`
        # needs the padding on the left (our generation refuses right padding; transformers' only warns). Our own
        # training, SFT and scoring pad their rows themselves, and trl's collators name their side explicitly.
        "padding_side": "left",
        "model_max_length": model_max_length if model_max_length is not None else int(1e30),
        "chat_template": template,
    }
    special_map = {
        "bos_token": BEGIN_TEXT,
        "eos_token": END_TEXT,
        "pad_token": PAD,
        "additional_special_tokens": chat_tokens,  # transformers 4 name
    }
    atomic_write_text(out / "tokenizer.json", tok.to_str(pretty=True))
    atomic_write_text(out / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    atomic_write_text(out / "special_tokens_map.json", json.dumps(special_map, indent=2) + "\n")
    atomic_write_text(out / "chat_template.jinja", template)
    if metadata is not None:
        atomic_write_text(out / "tokenizer_training.json", json.dumps(metadata, indent=2) + "\n")
    return out


def tokenizer_directory(path: str) -> str:
    """The directory a `--tokenizer` value names: a `tokenizer.json` file stands for its folder (what
    transformers and the tokenizer copies read); anything else is returned as given."""
    p = Path(path)
    return str(p.parent) if p.name == "tokenizer.json" and p.is_file() else path


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A `tokenizers.Tokenizer` from a directory holding ``tokenizer.json`` (or that file)."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.exists() and p.is_dir() and (p / "tokenizer.model").exists():
        raise ValueError(f"tokenizer: {str(p)!r} holds only a sentencepiece tokenizer.model, and this library reads "
                         f"tokenizer.json: convert it (transformers with sentencepiece installed: "
                         f"AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))")
    if not file.exists():
        raise ValueError(f"tokenizer: no tokenizer.json at {str(p)!r}; expected a directory or file")
    text = read_text(file, TOKENIZER_MAX_BYTES, "tokenizer file")  # a regular file of bounded size
    try:
        tok = Tokenizer.from_str(text)
    except Exception as exc:  # the Rust side raises a bare Exception for any parse error
        # (a byte-order mark, which some Windows editors write, reads as "expected value at line 1 column 1")
        bom = "; it starts with a UTF-8 byte-order mark, which JSON readers refuse: save it without one" \
            if text.startswith("\ufeff") else ""
        raise ValueError(f"tokenizer: {str(file)!r} is not a valid tokenizers file ({exc}){bom}") from None
    # A file's own truncation or padding (some hub tokenizers carry one) would cut or pad every encoding: training
    # documents, prompts. Callers window and pad ids themselves, as transformers' default call does.
    tok.no_truncation()
    tok.no_padding()
    return tok


def vocab_span(tok: Tokenizer) -> int:
    """The vocabulary a model needs for `tok`: its largest id + 1. That is its token count, unless its tokenizer.json
    numbers a token past the count (leaving ids unused): the model's embedding still needs a row for every id."""
    return max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1


def check_fits_vocab(tok: Tokenizer, vocab_size: int, source: str | Path) -> None:
    """ValueError (one line, both sizes) where `tok` makes ids past a model's embedding (`vocab_size`
    rows), which would fail inside the model on the first text that encodes to one."""
    size = vocab_span(tok)
    if size > vocab_size:
        raise ValueError(f"the tokenizer {str(source)!r} has {size} tokens but the model's vocabulary has "
                         f"{vocab_size} (config.json vocab_size): it is not this model's tokenizer")


@contextlib.contextmanager
def tokenizer_failures_as_errors() -> Iterator[None]:
    """A panic inside the Rust tokenizer (e.g. a pre-tokenizer regex past its backtracking limit) as a
    ValueError line: that text's problem. The panic is a BaseException (pyo3's PanicException, not
    importable by name), which would end the process that tokenizes, a server's worker included."""
    try:
        yield
    except BaseException as exc:
        if type(exc).__module__ != "pyo3_runtime":
            raise
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"the tokenizer failed on this text: {reason}") from None


# transformers logs this once per tokenizer when a text encodes to more than its model_max_length tokens.
LONG_TEXT_WARNING = "Token indices sequence length is longer than the specified maximum sequence length"


class _DropLongTextWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(LONG_TEXT_WARNING)


@contextlib.contextmanager
def windowed_encoding() -> Iterator[None]:
    """Encode whole documents with a transformers tokenizer without its "Token indices sequence length is
    longer than the specified maximum sequence length" warning, for callers that cut the ids into windows
    of the model's length themselves; every other warning still shows."""
    logger = logging.getLogger("transformers.tokenization_utils_base")  # where transformers logs it
    quiet = _DropLongTextWarning()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def build_tokenizer(
    corpus: Corpus | str | Path,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    val_fraction: float = 0.0,
    seed: int = 0,
    max_bytes: int | None = None,
    out_dir: str | Path | None = None,
    assistant_name: str = DEFAULT_ASSISTANT_NAME,
    extra_special_tokens: Sequence[str] = (),
    show_progress: bool = False,
) -> tuple[Tokenizer, dict[str, Any]]:
    """Train a tokenizer on a corpus's training documents; optionally save it with metadata.

    With ``val_fraction > 0`` the documents that :func:`prepare_dataset` (same fraction and
    seed) would hold out for validation are left out, so the tokenizer never saw them.
    Returns the tokenizer and the metadata written to ``tokenizer_training.json``.
    """
    import time

    import tokenizers

    if not (0.0 <= val_fraction < 1.0):
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    # Bad sizes and names fail now, not after reading the corpus or the (maybe hour-long) training.
    check_trainable_vocab_size(vocab_size)
    chat_template(assistant_name)
    slot_tokens(extra_special_tokens)
    source = load_corpus(corpus)
    info = source.info()
    require_text(info)  # (else the BPE trainer's "supports 0 merges" suggests a smaller vocab_size)
    docs: Iterable[Document] = source
    split = None
    if val_fraction > 0:
        split = DocumentSplit.plan(source.ids(), val_fraction, seed)
        docs = split.select(iter(source), "train")
    read = [0]  # documents the trainer read: the training side of the split, up to the --max-bytes cut

    def counted(documents: Iterable[Document]) -> Iterator[Document]:
        for doc in documents:
            read[0] += 1
            yield doc

    start = time.perf_counter()
    tok = train_tokenizer(counted(docs), vocab_size, max_bytes=max_bytes, extra_special_tokens=extra_special_tokens,
                          show_progress=show_progress)
    seconds = time.perf_counter() - start
    metadata = {
        "corpus": info.to_dict(),
        "vocab_size": vocab_size,
        "max_bytes": max_bytes,
        "trained_documents": read[0],
        "split": None if split is None else split.to_dict(),
        "train_seconds": round(seconds, 3),
        "tokenizer_sha256": tokenizer_sha256(tok),
        "special_token_ids": special_token_ids(tok),
        "extra_special_tokens": {t: tok.token_to_id(t) for t in extra_special_tokens},
        "tokenizers_version": tokenizers.__version__,
    }
    if out_dir is not None:
        save_tokenizer(tok, out_dir, assistant_name=assistant_name, metadata=metadata)
    return tok, metadata
