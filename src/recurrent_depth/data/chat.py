"""SFT examples: chat and prompt/completion records from local files, tokenized with their loss mask.

Records (one per JSONL line, or one per row of a local `datasets` file):

- chat, the OpenAI / Hugging Face format: `{"messages": [{"role": "user", "content": "..."}, ...]}`;
  every assistant message is learned, the rest is context; a message's other fields (`name`, `tool_calls`)
  go to the chat template as they are (a null field as if absent); a null `content` (OpenAI's assistant turn
  of tool calls only) is empty text, and a list of text parts (`[{"type": "text", "text": ...}, ...]`) their
  texts joined by a newline, as the server reads them (`serving.chat_template.content_text`); an assistant
  message of OpenAI's fine-tuning `"weight": 0` is context, not learned (`weight` is 0 or 1, never rendered);
  a learned answer of empty text and no tool calls is refused (only its end of turn would be learned);
  a record's `tools` (a list of tool objects, or its JSON text as trl reads it) is the template's `tools`
  variable, as the server and transformers' `apply_chat_template(tools=...)` pass it, and its `chat_template_kwargs`
  (trl's column: an object of extra template variables such as Qwen3's `enable_thinking`, or its JSON text) reach
  every render of the record, as transformers' `apply_chat_template(**kwargs)` and the server's request field of
  that name pass them (checked as the server checks them: a name the renderer sets, such as `messages`, is refused;
  a null variable is left out, as if absent: datasets fills a name some rows lack with null);
- prompt/completion: `{"prompt": "...", "completion": "..."}`, the completion is learned. Both may also be
  lists of messages (the conversational form): the conversation is `prompt + completion`, and only the
  completion's assistant messages are learned. An empty completion is refused.

Chats are rendered with the tokenizer directory's chat template (`serving/chat_template.py`, sandboxed).
The assistant-only rule: a template with `{% generation %}` blocks (Huginn-0125's, ours) decides itself: the
text its blocks render is learned, as transformers' `return_assistant_tokens_mask` marks it (in a
conversational prompt/completion record, only blocks after the prompt). Without blocks, the conversation is
cut where each learned assistant message starts (the render of the messages before it, with the generation
prompt: what the model sees when it answers) and where it ends (the render up to and with it); a template
whose renders are not prefixes of each other cannot be cut this way and is refused. Either way each piece is
tokenized on its own, so no token straddles a cut (as the continuation of the piece before it: no
sentencepiece '▁' of a text's start inside the text), and the tokens of the learned pieces carry the loss:
the answer and the end-of-turn marker the template writes after it, never the header that opens the turn.
A special token's text inside a message (`<|end_text|>` in an answer) is plain text, tokenized as the server's
`TextCodec.encode_chat` does it (a message cannot forge a turn there, so training must not teach one).
Prompt/completion text is not templated: `bos + prompt + completion + eos`, with the loss on the completion
and the eos.

Files: `.jsonl` is read here, a line at a time with a size cap, and a bad record is a one-line error naming
`file:line`; `.parquet`, `.json`, `.csv`, `.arrow` and a `save_to_disk` directory go through `datasets`
(local builders only, offline: nothing is downloaded), a bad row named `file:row N`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from recurrent_depth.config import ModelConfig
from recurrent_depth.data.corpus import json_line
from recurrent_depth.data.shards import check_token_ids
from recurrent_depth.files import clipped, read_json

if TYPE_CHECKING:
    from recurrent_depth.serving.chat_template import ChatTemplate  # (imported when used: the serving package is heavy)

MAX_RECORD_BYTES = 16 << 20  # one JSONL line
MAX_JSON_BYTES = 1 << 30  # a .json array, read whole
MAX_RENDERED_CHARS = 1 << 24  # one rendered conversation
# Tokens dropped from the end of a prefix of a text tokenized alone (`ExampleEncoder._prefix`): the cut can change
# the last ones (a word cut in two, a character's combining marks), never tokens this far before it.
PREFIX_MARGIN = 64
DATASETS_BUILDERS = {".parquet": "parquet", ".json": "json", ".csv": "csv", ".arrow": "arrow"}  # -> Dataset.from_*
SUFFIXES = (".jsonl", *DATASETS_BUILDERS)


@dataclass
class Conversation:
    """A record, normalised: messages, and which of them carry the loss (assistant messages only)."""

    messages: list[dict[str, Any]]
    learned: list[bool]
    templated: bool = True  # False: prompt/completion text, concatenated without the chat template
    prompt_messages: int = 0  # a conversational prompt/completion record: its prompt's messages, context only
    tools: list[dict[str, Any]] | None = None  # the record's `tools`, the template's `tools` variable (None: none)
    variables: dict[str, Any] | None = None  # the record's `chat_template_kwargs`: extra template variables


@dataclass
class Example:
    """Token ids of one example and, per token, whether it is a target (predicting it carries loss)."""

    ids: list[int]
    scored: list[bool]


def check_records_path(path: str | Path, what: str = "SFT data") -> Path:
    """`path` if `read_records` can read it (a directory, or a file with one of the `SUFFIXES`), else a one-line
    ValueError naming it as `what`: for a command to check its files before it loads a model."""
    p = Path(path)
    if not p.is_dir() and not p.is_file():
        raise ValueError(f"{what} {str(p)!r} does not exist")
    if p.is_file() and p.suffix not in SUFFIXES:
        raise ValueError(f"{what} {str(p)!r}: expected a file ending in one of {', '.join(SUFFIXES)} "
                         f"or a datasets directory (save_to_disk)")
    return p


def read_records(path: str | Path) -> Iterator[tuple[str, Any]]:
    """(where, record) for each record of a local file; `where` is `file:line` or `file:row N`."""
    p = check_records_path(path)
    if p.is_dir():
        yield from _datasets_rows(p, None)
    elif p.suffix == ".jsonl":
        yield from _jsonl_records(p)
    elif p.suffix == ".json":
        yield from _json_records(p)
    else:
        yield from _datasets_rows(p, DATASETS_BUILDERS[p.suffix])


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    with open(path, "rb") as handle:
        number = 0
        while True:
            line = handle.readline(MAX_RECORD_BYTES + 1)
            if not line:
                return
            number += 1
            where = f"{path}:{number}"
            if len(line) > MAX_RECORD_BYTES:
                raise ValueError(f"{where}: the line is longer than {MAX_RECORD_BYTES} bytes")
            if not line.strip():
                continue
            yield where, json_line(line, where, first=number == 1)


def _datasets_rows(path: Path, builder: str | None) -> Iterator[tuple[str, Any]]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only
    import datasets

    readers = {"parquet": datasets.Dataset.from_parquet, "json": datasets.Dataset.from_json,
               "csv": datasets.Dataset.from_csv, "arrow": datasets.Dataset.from_file}
    try:
        if builder is None:
            table = datasets.load_from_disk(str(path))
            if isinstance(table, datasets.DatasetDict):
                if "train" not in table:
                    raise ValueError(f"it has splits {sorted(table)} and no 'train'")
                table = table["train"]
        elif builder == "csv":
            table = readers[builder](str(path), features=_csv_text_columns(path), keep_default_na=False)
        else:
            table = readers[builder](str(path))
    except Exception as exc:  # datasets raises many kinds; the message is what the user needs
        raise ValueError(f"SFT data {str(path)!r} cannot be read with datasets: {exc}") from None
    for i, row in enumerate(table):
        yield f"{path}:row {i + 1}", row


def _csv_text_columns(path: Path) -> Any:
    """Every column of a CSV file read as text: a completion `28` or `0.50` is the text, not a number
    (datasets would infer int64 / float64), and an empty cell or `NA` stays the text it is."""
    import datasets

    with open(path, newline="", encoding="utf-8") as handle:
        header = next(csv.reader([handle.readline(MAX_RECORD_BYTES)]), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


def _json_records(path: Path) -> Iterator[tuple[str, Any]]:
    """A `.json` file's records: a top-level array read as JSON (its strings stay strings; datasets'
    reader infers column types, so `"28"` among other records came back as the number 28); anything
    else (JSON lines, a `{"data": [...]}` table) through datasets."""
    with open(path, "rb") as handle:
        start = handle.read(4096).lstrip()
    if not start.startswith(b"["):
        yield from _datasets_rows(path, "json")
        return
    records = read_json(path, MAX_JSON_BYTES, "SFT data")
    for i, record in enumerate(records):
        yield f"{path}:record {i + 1}", record


def conversation(record: Any, where: str) -> Conversation:
    """A record as a `Conversation`, or a ValueError naming `where` and what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object with 'messages' or 'prompt' and 'completion', "
                         f"got {type(record).__name__}")
    for key in ("messages", "prompt", "completion"):
        _check_nesting(record.get(key), where, key)
    if record.get("messages") is not None:
        result = Conversation(*_messages(record["messages"], where, "messages", learn=True))
    elif record.get("prompt") is not None and record.get("completion") is not None:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion.strip():  # (only the eos would be learned: every prompt answered with nothing)
                raise ValueError(f"{where}: 'completion' is empty, so only the end of the text would be learned; "
                                 "give it the answer's text or leave the record out")
            result = Conversation([{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}],
                                  [False, True], templated=False)
        elif isinstance(prompt, list) and isinstance(completion, list):
            (before, _), (after, learned) = (_messages(prompt, where, "prompt", learn=False),
                                             _messages(completion, where, "completion", learn=True))
            result = Conversation(before + after, [False] * len(before) + learned, prompt_messages=len(before))
        else:
            raise ValueError(f"{where}: 'prompt' and 'completion' must both be strings or both lists of messages")
    else:
        raise ValueError(f"{where}: expected 'messages' (a chat) or 'prompt' and 'completion', got keys "
                         f"{sorted(record)}")
    if not any(result.learned):
        raise ValueError(f"{where}: no assistant message to learn")
    tools = _tools(record.get("tools"), where)
    variables = _template_variables(record.get("chat_template_kwargs"), where)
    for name, value in (("tools", tools), ("chat_template_kwargs", variables)):
        _check_nesting(value, where, name)
        if value is not None and not result.templated:  # (text is not templated: it would be dropped, silently)
            raise ValueError(f"{where}: '{name}' needs a chat (the chat template reads it); a text prompt/completion "
                             "record has none")
    return dataclasses.replace(result, tools=tools, variables=variables)


def prompt_conversation(record: Any, where: str) -> Conversation:
    """An RL chat prompt (`rdepth rl --prompts FILE.jsonl`) as a `Conversation` that learns nothing: `{"messages":
    [...]}`, or trl's conversational prompt `{"prompt": [...]}`, with the record's optional `tools` and
    `chat_template_kwargs`, each checked as `conversation` checks an SFT record's. The messages end before the
    model's answer (the last is not the assistant's). Its other fields are `prompt_fields`."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected an object with 'messages' (or trl's 'prompt'), "
                         f"got {type(record).__name__}")
    given = [key for key in ("messages", "prompt") if record.get(key) is not None]
    if len(given) != 1:
        raise ValueError(f"{where}: expected one of 'messages' or 'prompt' (a list of messages ending before the "
                         f"answer), got keys {sorted(record)[:8]}")
    key = given[0]
    _check_nesting(record[key], where, key)
    messages, _ = _messages(record[key], where, key, learn=False)
    if messages[-1]["role"] == "assistant":
        raise ValueError(f"{where}: the last message of '{key}' is the assistant's; a prompt ends where the model's "
                         "answer starts")
    tools = _tools(record.get("tools"), where)
    variables = _template_variables(record.get("chat_template_kwargs"), where)
    for name, value in (("tools", tools), ("chat_template_kwargs", variables)):
        _check_nesting(value, where, name)
    return Conversation(messages, [False] * len(messages), tools=tools, variables=variables)


PROMPT_KEYS = ("messages", "prompt")  # an RL prompt record's conversation (`prompt_conversation`)


def prompt_fields(record: dict[str, Any], where: str) -> dict[str, Any]:
    """An RL prompt record's fields other than its conversation (an `answer`, its `tools`...): what a reward function
    that takes keyword arguments gets with each of the prompt's completions, as trl's GRPOTrainer passes a row's
    other columns. Each must be a JSON value (a JSONL line's are; a record built in Python is checked here) nested at
    most as deep as the server takes; else a one-line ValueError naming `where`."""
    fields = {key: value for key, value in record.items() if key not in PROMPT_KEYS}
    for key, value in fields.items():
        if not isinstance(key, str):
            raise ValueError(f"{where}: field name {clipped(key)} is not a string (a JSON object's keys are)")
        _check_nesting(value, where, key[:80])  # (cut: a name read from a file goes into a one-line error)
        odd = _not_json(value)
        if odd is not None:
            raise ValueError(f"{where}: field {clipped(key)} is not a JSON value: it holds {odd}")
    return fields


def _not_json(value: Any) -> str | None:
    """What in `value` is not what json.loads gives (None: nothing): a tuple, a set, an object, a key not a string.
    Walked without recursion, as `json_nesting` walks (the nesting is checked before)."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            key = next((k for k in item if not isinstance(k, str)), None)
            if key is not None:
                return f"the object key {clipped(key)}, not a string"
            todo += item.values()
        elif isinstance(item, list):
            todo += item
        elif item is not None and not isinstance(item, str | int | float):  # (bool is an int)
            return f"a {type(item).__name__}"
    return None


def _check_nesting(value: Any, where: str, key: str) -> None:
    """A one-line error for a field nested deeper than the server takes (`protocol.MAX_JSON_NESTING`): escaping its
    special-token text and the chat template recurse over it, and overflowed Python's stack (a RecursionError)."""
    from recurrent_depth.serving.protocol import MAX_JSON_NESTING, json_nesting  # (here: serving is heavy)

    if json_nesting(value) > MAX_JSON_NESTING:
        raise ValueError(f"{where}: '{key}' nests arrays and objects over {MAX_JSON_NESTING} levels deep")


def _json_column(value: Any, where: str, key: str, expected: str) -> Any:
    """A record's `key` value, decoded where it is a JSON string (as trl reads a column of values of differing
    shapes, which datasets stores as JSON text); other values as they are."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:  # (JSONDecodeError, and Python's int limit)
        raise ValueError(f"{where}: '{key}' is a string that is not JSON ({expected})") from None
    except RecursionError:
        raise ValueError(f"{where}: '{key}' is a JSON string nested too deeply to parse") from None


def _tools(value: Any, where: str) -> list[dict[str, Any]] | None:
    """A record's `tools` (OpenAI's fine-tuning format, trl's column; a JSON string as trl reads one, which is how
    datasets stores tools of differing shapes): a list of tool objects, or None for none."""
    value = _json_column(value, where, "tools", "a list of tools")
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise ValueError(f"{where}: 'tools' must be a list of tool objects ({{\"type\": \"function\", "
                         f"\"function\": {{...}}}}), got {type(value).__name__}")
    return value


def _template_variables(value: Any, where: str) -> dict[str, Any] | None:
    """A record's `chat_template_kwargs` (trl's column; a JSON string as trl reads a column), checked as the server
    checks a request's (`protocol.template_kwargs`): an object of template variables, None for none. A null variable
    is left out, as if absent (datasets fills a name some rows lack with null)."""
    from recurrent_depth.serving.protocol import APIError, template_kwargs  # (here: the serving package is heavy)

    value = _json_column(value, where, "chat_template_kwargs", "an object of template variables")
    try:
        variables = template_kwargs(value)
    except APIError as exc:
        raise ValueError(f"{where}: {exc.message}") from None
    return {k: v for k, v in variables.items() if v is not None} or None


def _messages(value: Any, where: str, key: str, learn: bool) -> tuple[list[dict[str, Any]], list[bool]]:
    """The messages, checked and normalised, and which are learned: with `learn`, each assistant message
    whose OpenAI fine-tuning `weight` is not 0 (the `weight` field is read here, not rendered)."""
    from recurrent_depth.serving.chat_template import ROLES, content_text  # (here: the serving package is heavy)

    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: '{key}' must be a non-empty list of messages")
    out, learned = [], []
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str) and "content" in message):
            raise ValueError(f"{where}: {key}[{i}] must be an object with string 'role' and 'content' (or a null "
                             "'content': an assistant turn of tool calls only)")
        # the server's roles: a typo ('usr', 'Assistant') was rendered as a turn of its own and trained on, or
        # left an answer unlearned, silently, and the model would be served prompts in which it never occurs
        if message["role"] not in ROLES:
            raise ValueError(f"{where}: {key}[{i}].role={message['role'][:40]!r} is not a chat role: expected one "
                             f"of {list(ROLES)}")
        # a list of text parts is their texts joined, a null content empty text (never the text 'None' a template
        # would write for it), both as the server takes them (`content_text`)
        content = content_text(message["content"], f"{where}: {key}[{i}].content")
        # OpenAI's fine-tuning format: an assistant message of `weight` 0 is context, not learned (it was learned,
        # silently); a training setting, so the template never sees it (the server's prompts have no weight)
        weight = message.get("weight")
        if weight is not None and (message["role"] != "assistant" or isinstance(weight, bool) or weight not in (0, 1)):
            raise ValueError(f"{where}: {key}[{i}].weight={weight!r}: a weight is 0 (not learned) or 1 (learned), "
                             "on assistant messages only")
        learns = learn and message["role"] == "assistant" and weight != 0
        # every other field goes to the template (a tool call, a tool's name); a null one (datasets fills a field
        # some messages lack with None) is left out, as if absent
        fields = {k: v for k, v in message.items() if v is not None and k != "weight"} | {"content": content}
        if learns and not content.strip() and not fields.keys() - {"role", "content", "name"}:
            # (only the end of the turn would be learned: the model taught to answer with nothing)
            raise ValueError(f"{where}: {key}[{i}] is an assistant answer with empty content and no tool_calls, "
                             "so only the end of its turn would be learned; give it text, or weight 0 to keep it "
                             "as context")
        out.append(fields)
        learned.append(learns)
    return out, learned


class ExampleEncoder:
    """Tokenizes conversations with a model directory's tokenizer and chat template (see the module docstring)."""

    def __init__(self, tokenizer_dir: str | Path, config: ModelConfig) -> None:
        from recurrent_depth.data.tokenizer import load_tokenizer
        from recurrent_depth.serving.chat_template import load_template

        self.tokenizer_dir = Path(tokenizer_dir)
        self.tokenizer = load_tokenizer(self.tokenizer_dir)
        source, variables = load_template(self.tokenizer_dir)
        self.template = self._compile(source, variables) if source is not None else None
        self.vocab_size = config.vocab_size
        self.bos = config.bos_token_id
        eos = config.eos_token_id
        self.eos = eos[0] if isinstance(eos, list) else eos
        # the special tokens' texts: in a message they are plain text, as the server reads them
        from recurrent_depth.serving.text import LiteralSpecials, special_pattern  # (here: serving is heavy)

        self.specials = special_pattern(self.tokenizer)
        self.literal = LiteralSpecials(None)  # the special-token texts of the record being encoded
        # where a piece's context may start (`_context`): a special token the tokenizer splits off in the raw text
        # (not normalized, not single_word, no leading space), provided no added token's text straddles its start
        added = [t for t in self.tokenizer.get_added_tokens_decoder().values() if t.content]
        starts = {t.content for t in added if t.special and not t.normalized and not t.single_word
                  and not t.content[0].isspace()}
        self.context_starts = _alternatives(starts)
        every = _alternatives({t.content for t in added})
        self.added_texts = None if every is None else re.compile(f"(?=({every.pattern}))")  # (overlapping ones too)
        self.longest_added = max((len(t.content) for t in added), default=0)

    def _compile(self, source: str, variables: dict[str, str]) -> ChatTemplate:
        import jinja2

        from recurrent_depth.serving.chat_template import ChatTemplate

        try:
            return ChatTemplate(source, variables, MAX_RENDERED_CHARS)
        except Exception as exc:  # a jinja TemplateSyntaxError is no ValueError: rdepth sft printed a traceback
            detail = f"{exc.message} (line {exc.lineno})" if isinstance(exc, jinja2.TemplateSyntaxError) else exc
            raise ValueError(f"the chat template of {self.tokenizer_dir} does not compile: {detail}") from None

    def encode(self, chat: Conversation, where: str, most: int | None = None) -> Example:
        """The example's ids and loss mask. `most`: only its first `most` tokens are wanted (`rdepth sft` keeps
        `seq_len + 1`): the result is then the whole example's first tokens, more than `most` of them where the
        example is longer (so the cut is still seen), and the text past them is never tokenized."""
        if not chat.templated and self.eos is None:  # (the completion's end would be learned by nothing, silently)
            raise ValueError(f"{where}: a prompt/completion record needs the model's eos_token_id (config.json) to "
                             f"learn where a completion ends, and it has none: set eos_token_id, or use chat records")
        # a special token's text in a message is plain text, tokenized as the server's `TextCodec.encode_chat` does
        # it (parsed as a token here, an answer's `<|end_text|>` taught the model an eos mid-answer that the server's
        # prompts never hold)
        from recurrent_depth.serving.text import LiteralSpecials

        self.literal = LiteralSpecials(self.specials if chat.templated else None)
        if chat.templated:
            chat = dataclasses.replace(chat, messages=[
                {k: self.literal.escape(v, f"{where}: messages[{i}].{k}") for k, v in m.items()}
                for i, m in enumerate(chat.messages)],
                tools=None if chat.tools is None else [self.literal.escape(t, f"{where}: tools[{i}]")
                                                       for i, t in enumerate(chat.tools)],
                variables=None if chat.variables is None else {
                    k: self.literal.escape(v, f"{where}: chat_template_kwargs.{k}") for k, v in chat.variables.items()})
        pieces = self._chat_pieces(chat, where) if chat.templated else self._plain_pieces(chat)
        for text, _ in pieces:  # (JSON allows a lone surrogate like "\ud800": the tokenizer raised a TypeError on it)
            if isinstance(text, str):
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError(f"{where}: the record holds text that is not valid Unicode (an unpaired "
                                     "surrogate escape such as \\ud800)") from None
        ids: list[int] = []
        scored: list[bool] = []
        before: str | int | None = None  # the last non-empty piece (None: the start of the text)
        for text, learned in pieces:
            if most is not None and len(ids) > most:
                break
            want = None if most is None else most + 1 - len(ids)
            piece = [text] if isinstance(text, int) else self._tokens(text, before, want)
            ids += piece
            scored += [learned] * len(piece)
            before = text if text != "" else before
        # (an encoder given another model's config: the record named here, not by the model's check of a packed
        # batch row that no one can trace back to it)
        check_token_ids(np.asarray([ids], dtype=np.int64), self.vocab_size, lambda _: where,
                        f"the tokenizer of {self.tokenizer_dir} makes ids past the model's vocabulary: it is not "
                        "this model's tokenizer (or its tokenizer.json numbers a token past its count)")
        return Example(ids, scored)

    def _tokens(self, text: str, before: str | int | None, want: int | None = None) -> list[int]:
        """`text`'s tokens as they follow the text piece `before` (with `want`: their first `want` at least, see
        `_prefix`). Alone, a sentencepiece-style tokenizer (Metaspace, Llama-2 / Mistral) starts `text` with '▁' as
        the start of a text: an answer `4` after `<|assistant|>\n` became `▁4`, a second user turn gained a space,
        unlike the conversation tokenized whole (what the server encodes). Where a token would straddle the cut,
        `text` is tokenized alone."""
        if not text:
            return []
        if not isinstance(before, str):  # (the start of the text, or after a bos / eos id)
            return self._prefix(text, want)
        before = self._context(before, text)
        context = self._encode(before)
        both = self._prefix(before + text, None if want is None else len(context) + want)
        if both[: len(context)] == context:
            return both[len(context):]
        return self._prefix(text, want)

    def _context(self, before: str, text: str) -> str:
        """The end of `before` that `text` follows as it follows all of `before`: from `before`'s last special
        token on, where the tokenizer splits there whatever precedes it (it splits special tokens off first and
        tokenizes the text between them alone), else all of `before`. (A long earlier piece is not tokenized
        again for each piece after it.) Not with a record's literal special-token texts: their placeholders are
        tokenized by `LiteralSpecials.encode`'s copy of the tokenizer."""
        if self.context_starts is None or self.added_texts is None or self.literal.literals:
            return before
        last = next(iter(deque(self.context_starts.finditer(before), maxlen=1)), None)
        if last is None or last.start() == 0:
            return before
        # no added token's text may start before the special token and reach into it (then the tokenizer's split
        # is elsewhere): the texts around its start, `text`'s beginning included
        start, reach = max(0, last.start() - self.longest_added + 1), last.start() + self.longest_added
        around = before[start:reach] + text[: max(0, reach - len(before))]
        at = last.start() - start
        if any(m.start() < at < m.start() + len(m.group(1)) for m in self.added_texts.finditer(around)):
            return before
        return before[last.start():]

    def _prefix(self, text: str, want: int | None) -> list[int]:
        """`_encode(text)`, or with `want` its first tokens, at least `want` of them where it has that many,
        tokenizing only a prefix of `text` (a 1 MB message is not tokenized whole for the seq_len it is cut to): one
        that yields `PREFIX_MARGIN` more, whose last `PREFIX_MARGIN` are dropped (the cut may change them)."""
        size = len(text) if want is None else 4 * (want + PREFIX_MARGIN)
        while size < len(text):
            ids = self._encode(text[: self._cut(text, size)])
            if len(ids) >= want + PREFIX_MARGIN:
                return ids[: len(ids) - PREFIX_MARGIN]
            size *= 2
        return self._encode(text)

    def _cut(self, text: str, size: int) -> int:
        """Where to cut `text` near `size` (at most `size`) for `_prefix`: never inside a literal's placeholder
        (`LiteralSpecials.escape`) or an added token's text, nor in or just after a run of whitespace (a special
        token's lstrip may take it in, and pre-tokenizers split a run by what follows it)."""
        from recurrent_depth.serving.text import PLACEHOLDER_CLOSE, PLACEHOLDER_OPEN

        while True:
            cut = len(text[:size].rstrip())
            opened = text.rfind(PLACEHOLDER_OPEN, 0, cut)
            if opened >= 0 and text.rfind(PLACEHOLDER_CLOSE, opened, cut) < 0:
                cut = opened
            if self.added_texts is not None:  # (the start of an added token's text that the cut runs through)
                found = self.added_texts.finditer(text, max(0, cut - self.longest_added + 1), cut + self.longest_added)
                cut = min([m.start() for m in found if m.start() < cut < m.start() + len(m.group(1))] + [cut])
            if cut == size:
                return cut
            size = cut

    def _encode(self, text: str) -> list[int]:
        """`text`'s ids as the server's `TextCodec.encode_chat` tokenizes a rendered chat (`LiteralSpecials`)."""
        if not self.literal.literals:
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        return self.literal.encode(self.tokenizer, text)

    def _plain_pieces(self, chat: Conversation) -> list[tuple[str | int, bool]]:
        prompt, completion = chat.messages[0]["content"], chat.messages[1]["content"]
        pieces: list[tuple[str | int, bool]] = [(self.bos, False)] if self.bos is not None else []
        pieces += [(prompt, False), (completion, True)]
        return pieces + ([(self.eos, True)] if self.eos is not None else [])

    def _chat_pieces(self, chat: Conversation, where: str) -> list[tuple[str | int, bool]]:
        if self.template is None:
            raise ValueError(f"{where}: a chat record, but {self.tokenizer_dir} has no chat template "
                             f"(tokenizer_config.json chat_template or chat_template.jinja)")
        if self.template.has_generation_blocks:
            return self._block_pieces(chat, where)
        messages = chat.messages
        full = self._render(messages, False, where, chat)
        pieces: list[tuple[str | int, bool]] = []
        cursor = 0
        for i, learned in enumerate(chat.learned):
            if not learned:
                continue
            start = self._render(messages[:i], True, where, chat)
            end = self._render(messages[: i + 1], False, where, chat)
            if not (end.startswith(start) and full.startswith(end) and len(start) >= cursor):
                raise ValueError(f"{where}: the chat template does not render a conversation as a prefix of its "
                                 f"continuation, so the assistant's tokens cannot be told apart")
            pieces += [(full[cursor:len(start)], False), (full[len(start):len(end)], True)]
            cursor = len(end)
        return [*pieces, (full[cursor:], False)]

    def _block_pieces(self, chat: Conversation, where: str) -> list[tuple[str | int, bool]]:
        """The learned text is what the template's `{% generation %}` blocks render, as transformers'
        `return_assistant_tokens_mask` marks it (a message outside every block is not learned). In a
        conversational prompt/completion record, only blocks after the prompt count: the prompt ends where its
        render with the generation prompt parts from the whole conversation (trl's `common_prefix_length`).
        An assistant message of weight 0 teaches nothing: its text runs from where the render of the messages
        before it parts from the whole conversation to where the render with it does."""
        with template_errors(where):
            full, spans = self.template.generation_spans(chat.messages, tools=chat.tools, variables=chat.variables)
        messages = chat.messages

        def shared(count: int, open_turn: bool) -> int:  # where the render of `count` messages parts from full
            return len(os.path.commonprefix([self._render(messages[:count], open_turn, where, chat), full]))

        skipped = []  # text no block may teach: the prompt, and each assistant message of weight 0
        if chat.prompt_messages:
            skipped.append((0, shared(chat.prompt_messages, True)))
        for i in range(chat.prompt_messages, len(messages)):
            if messages[i]["role"] == "assistant" and not chat.learned[i]:  # (from the end of the message before)
                skipped.append((shared(i, False) if i else 0, shared(i + 1, False)))
        pieces: list[tuple[str | int, bool]] = []
        cursor = 0
        for start, end in sorted(spans):  # (sorted: a nested block is noted before the block around it)
            for a, b in _without(max(start, cursor), end, skipped):
                pieces += [(full[cursor:a], False), (full[a:b], True)]
                cursor = b
        if not any(learned for _, learned in pieces):
            raise ValueError(f"{where}: the chat template's {{% generation %}} blocks mark no text of this record's "
                             f"assistant answers, so nothing would be learned")
        return [*pieces, (full[cursor:], False)]

    def _render(self, messages: list[dict[str, str]], open_turn: bool, where: str, chat: Conversation) -> str:
        """`messages` rendered with `chat`'s tools and template variables."""
        with template_errors(where):
            return self.template.render(messages, add_generation_prompt=open_turn, tools=chat.tools,
                                        variables=chat.variables)


def _alternatives(texts: set[str]) -> re.Pattern[str] | None:
    """One pattern matching any of `texts`, the longest first (None: no text)."""
    return re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True))) if texts else None


def _without(start: int, end: int, skipped: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The non-empty parts of [start, end) outside every interval of `skipped`, in order."""
    parts = [(start, end)] if end > start else []
    for lo, hi in skipped:
        parts = [part for a, b in parts for part in ((a, min(b, lo)), (max(a, hi), b)) if part[1] > part[0]]
    return sorted(parts)


@contextmanager
def template_errors(where: str) -> Iterator[None]:
    """Jinja's and the sandbox's errors as one line naming `where`: the template or the record is at fault."""
    try:
        yield
    except Exception as exc:
        raise ValueError(f"{where}: the chat template failed on this record: {exc}") from None


def load_examples(path: str | Path, encoder: ExampleEncoder, most: int | None = None) -> list[Example]:
    """Every record of `path`, checked and tokenized, in file order (`most`: see `ExampleEncoder.encode`)."""
    examples = [encoder.encode(conversation(record, where), where, most) for where, record in read_records(path)]
    if not examples:
        raise ValueError(f"SFT data {str(path)!r} holds no records")
    return examples
