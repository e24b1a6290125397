"""The OpenAI wire format: request validation and OpenAI-style errors.

Every field is checked by hand so that a bad request gets a 400 whose message names the field,
what was received and what is allowed (never a stack trace, never a silent clamp). Standard
fields we do not implement are ignored when they cannot change the result (`user`,
`stream_options` beyond `include_usage`, `metadata`, ...) and refused when they would
(`logit_bias`, `presence_penalty`/`frequency_penalty` other than 0, `suffix`, `best_of` other
than n, tool calls, non-text response formats; chat's `tools` pass with tool_choice "none" only, for the chat
template); any other field is a 400 naming it. Messages write values as JSON does (null, true, false). Test-time
compute knobs are extra body fields (`extra_body=` in the openai client), the options the schema
(`recurrent_depth.inference.schema`, `http=True`) offers over HTTP, with the official aliases:
`num_steps`, `exit_criterion` (`criterion`), `exit_threshold` (a number or "auto"), `min_steps`,
`max_steps`, `kv_budget`, `kv_policy` (`cache_lookup_strategy`), `warm_start`
(`continuous_compute`), `draft_steps`, `lookahead` (`lookahead_for_draft`),
`verification_threshold`, `init_scale`, `top_k`, `min_p`, `repetition_penalty`; plus the
server's `ignore_eos`, `stop_token_ids`, `add_special_tokens` and `return_steps`, and vLLM's `skip_special_tokens`,
`include_stop_str_in_output` and (chat) `chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`.
A field a request leaves out takes the model directory's generation_config.json value where `rdepth serve` read
one (`request_defaults`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from recurrent_depth.generation_config import with_generation_defaults
from recurrent_depth.inference.options import GenerationOptions, OptionError, ResolvedOptions, spelled_warnings
from recurrent_depth.inference.schema import (
    OFFICIAL_ALIASES,
    OPTIONS,
    canonical,
    check_type,
    names_for,
    negating,
    resolved_auto,
)
from recurrent_depth.serving.chat_template import RESERVED_VARIABLES, ROLES, content_text

HTTP_OPTIONS = names_for("http")  # the schema's extra body fields, official aliases included
# The standard OpenAI fields of /v1/completions and /v1/chat/completions (read, or ignored where
# they cannot change the result, or refused by `refuse_unsupported`) and this server's own extras.
OPENAI_FIELDS = frozenset({
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "stream", "stream_options", "stop",
    "seed", "temperature", "top_p", "logprobs", "top_logprobs", "echo", "best_of", "suffix", "logit_bias",
    "presence_penalty", "frequency_penalty", "user", "metadata", "store", "service_tier", "parallel_tool_calls",
    "tools", "tool_choice", "functions", "function_call", "response_format", "modalities", "reasoning_effort",
    "prediction", "audio", "web_search_options", "verbosity", "prompt_cache_key", "safety_identifier",
})
SERVER_FIELDS = frozenset({"ignore_eos", "stop_token_ids", "add_special_tokens", "return_steps", "prompt_logprobs",
                           # vLLM's extras: both routes' output text, then the chat template's
                           "skip_special_tokens", "include_stop_str_in_output",
                           "chat_template_kwargs", "add_generation_prompt", "continue_final_message"})
MAX_TEMPLATE_KWARGS = 64  # names in a chat request's `chat_template_kwargs`
# levels of arrays / objects in a request body (or an SFT record): the escaping of special-token text and the chat
# template recurse over tools, template variables and messages, and JSON the parser takes (~990 levels) overflowed
# Python's stack there (a RecursionError, a traceback in `rdepth sft`)
MAX_JSON_NESTING = 64
# max_tokens past the context is refused once the prompt's length is known (`Sampling.options`: 400
# context_length_exceeded naming the prompt's tokens, max_tokens and the context, as vLLM's); this bound only
# keeps the number printable
MAX_TOKENS_FIELD = 2**31 - 1
# distinct option warnings remembered (each logged once) before they are forgotten: a message names the client's value,
# and Python remembers each one it logged, forever (`forget_warnings_past`)
MAX_REMEMBERED_WARNINGS = 1024
_TEMPLATE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
KNOWN_FIELDS = OPENAI_FIELDS | SERVER_FIELDS | set(HTTP_OPTIONS)
# the generation options a request takes from generation_config.json where it leaves them out (our names: the
# schema's HTTP options, and do_sample, which the wire spells as temperature)
FILE_OPTIONS = frozenset({OFFICIAL_ALIASES[n].field if n in OFFICIAL_ALIASES else n for n in HTTP_OPTIONS}
                         | {"do_sample"})


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        # a lone surrogate from the request (an unknown field "\ud800" named in `param`) cannot be written as
        # UTF-8: the answer was a 500; it is shown escaped instead
        def text(value: str | None) -> str | None:
            return value if value is None else value.encode("utf-8", "backslashreplace").decode("utf-8")

        return {"error": {"message": text(self.message), "type": self.type, "param": text(self.param),
                          "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


def parse_request_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 saying why not."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        # ValueError: malformed JSON, bad UTF-8, or an integer literal over Python's digit limit;
        # RecursionError: arrays/objects nested too deeply to parse.
        raise APIError(400, f"the request body is not valid JSON: {type(exc).__name__}: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    if json_nesting(body) > MAX_JSON_NESTING:
        raise APIError(400, f"the request body nests arrays and objects over {MAX_JSON_NESTING} levels deep")
    return body


def json_nesting(value: Any) -> int:
    """How many levels of lists and dicts `value` (a parsed JSON value) nests (0: a scalar); not recursive, so any
    depth is counted."""
    if not isinstance(value, dict | list):
        return 0
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        deepest = max(deepest, level)
        # (containers only: a body of a million token ids is walked at the speed of its parse)
        todo += [(v, level + 1) for v in (item.values() if isinstance(item, dict) else item) if type(v) in (dict, list)]
    return deepest


def request_defaults(file_options: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """What a model directory's generation_config.json (`cli.common.generation_defaults`: our option names) sets
    for requests, and the names of its settings no request takes (named on stderr at start-up): the generation
    options of `FILE_OPTIONS`, max_new_tokens (max_tokens), seed (one integer), eos_token_id (added to the stop
    ids) and stop (its strings are the default 'stop', its token ids stop every request, as eos does)."""
    taken: dict[str, Any] = {}
    unused = []
    for name, value in file_options.items():
        if name == "stop":
            items = [value] if isinstance(value, str | int) else list(value)
            taken["stop"] = [t for t in items if isinstance(t, str)]
            taken["stop_token_ids"] = [t for t in items if not isinstance(t, str)]
        elif name in FILE_OPTIONS or name in ("max_new_tokens", "eos_token_id") \
                or (name == "seed" and isinstance(value, int)):
            taken[name] = value
        else:
            unused.append(name)
    return taken, sorted(unused)


@dataclass
class Limits:
    """What the server accepts: the model's context and depth, and request-size bounds."""

    max_seq_len: int
    mean_recurrence: int
    vocab_size: int
    max_num_steps: int = 128
    max_n: int = 16
    max_sequences: int = 256  # prompts x n in one request
    max_top_logprobs: int = 20
    max_stop: int = 16
    max_tools: int = 128  # a chat request's `tools` (OpenAI's limit)
    max_lookahead: int = 64
    default_num_steps: int | None = None  # depth of requests that do not say (None: mean_recurrence)
    gate_threshold: float | None = None  # the model's own q for exit_criterion "gate" (its exit_gate_threshold)
    init_scale: float = 1.0  # the model's s_0 scale (its config's init_scale): requests that leave it out draw at it
    # what the model directory's generation_config.json sets for the fields a request leaves out, by our option
    # names (`request_defaults`; rdepth serve --generation-config auto)
    defaults: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------- field readers
# A Python string literal ('x', "it's": the client's text, kept whole) or one of Python's constants; an
# apostrophe inside a word (the model's) opens no literal
_LITERAL_OR_CONSTANT = re.compile(r"""(?<!\w)('(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")(?!\w)|\b(None|True|False)\b""")
_JSON_CONSTANTS = {"None": "null", "True": "true", "False": "false"}


def json_words(message: str) -> str:
    """`message` with Python's None / True / False written as JSON's null / true / false, outside quoted
    values: what a JSON client sends and reads (inference/options.py rightly speaks Python to Python callers)."""
    return _LITERAL_OR_CONSTANT.sub(lambda m: m.group(1) or _JSON_CONSTANTS[m.group(2)], message)


def _describe(value: Any) -> str:
    text = json_words(repr(value))
    return text if len(text) <= 60 else text[:57] + "..."


def get_int(body: dict, name: str, default: Any, low: int | None = None, high: int | None = None,
            nullable: bool = True) -> Any:
    value = body.get(name, default)
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(name, f"'{name}' must be an integer, got {_describe(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        hi = "" if high is None else f" and <= {high}"
        raise bad(name, f"'{name}'={value} is out of range: expected an integer >= {low}{hi}")
    return value


def get_bool(body: dict, name: str, default: bool | None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"'{name}' must be true or false, got {_describe(value)}")
    return value


def check_text(value: str, param: str, where: str) -> None:
    """400 for a string that is not valid Unicode text (JSON allows lone surrogates like "\\ud800",
    which no tokenizer can encode)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad(param, f"{where} is not valid Unicode text: {exc.reason} at character {exc.start}") from None


def refuse_unsupported(body: dict, n: int) -> None:
    """400 for standard fields that would change the result and that we do not implement."""
    if body.get("logit_bias") not in (None, {}):
        raise bad("logit_bias", "'logit_bias' is not supported by this server")
    for name in ("presence_penalty", "frequency_penalty"):
        value = body.get(name)
        if value not in (None, 0, 0.0):
            raise bad(name, f"'{name}'={_describe(value)} is not supported (only 0); "
                            "use the extra field 'repetition_penalty' instead")
    if body.get("suffix") not in (None, ""):
        raise bad("suffix", "'suffix' (insertion) is not supported by this server")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise bad("best_of", f"'best_of'={_describe(best_of)} is not supported (only equal to n={n})")
    if body.get("functions") not in (None, []):
        raise bad("functions", "'functions' (tool calling) is not supported by this server; chat takes 'tools' "
                               "with tool_choice \"none\" (shown to the chat template only)")
    # (`tools` and `tool_choice`: `template_tools`)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad("response_format", "'response_format' other than {\"type\": \"text\"} is not supported")
    # audio output: the answer would lack the `message.audio` the client asked for (it was silently text only)
    if body.get("modalities") not in (None, ["text"]):
        raise bad("modalities", f"'modalities'={_describe(body['modalities'])} is not supported (only [\"text\"]: "
                                "the model writes text only)")
    if body.get("audio") is not None:
        raise bad("audio", "'audio' (audio output) is not supported by this server: the model writes text only")
    if body.get("prompt_logprobs") is not None:
        raise bad("prompt_logprobs", "'prompt_logprobs' is not supported; use echo=true with logprobs")


# ---------------------------------------------------------------------------------------- common fields
@dataclass
class Sampling:
    """Fields shared by completions and chat, validated (the prompt is known later)."""

    model: str | None
    max_tokens: int | None
    n: int
    stream: bool
    include_usage: bool
    stop: list[str]
    stop_token_ids: list[int]
    ignore_eos: bool
    seed: int | None
    return_steps: bool
    generation: dict[str, Any] = field(default_factory=dict)  # `generate` keyword arguments
    given_as: dict[str, str] = field(default_factory=dict)  # option -> the JSON field the client sent
    skip_special_tokens: bool = True  # the answer's text leaves special tokens out (vLLM's default)
    include_stop_str_in_output: bool = False  # a matched stop string stays at the end of the text

    @property
    def speculative(self) -> bool:
        return self.generation.get("draft_steps") is not None


    def options(self, prompt_len: int, max_tokens: int, limits: Limits) -> ResolvedOptions:
        """Validated `GenerationOptions` for a prompt of this length (400 on a bad combination)."""
        if prompt_len + max_tokens > limits.max_seq_len:
            name = self.given_as.get("max_new_tokens", "max_tokens")  # (chat: max_completion_tokens if sent)
            raise APIError(
                400,
                f"the prompt has {prompt_len} tokens and {name} is {max_tokens}: {prompt_len + max_tokens} "
                f"exceeds the model's context of {limits.max_seq_len} tokens; shorten the prompt or lower {name}",
                param=name if prompt_len < limits.max_seq_len else self.given_as.get("prompt", "prompt"),
                code="context_length_exceeded",
            )
        return validated(self.generation, self.given_as, max_tokens, limits)


def validated(generation: dict[str, Any], given_as: dict[str, str], max_tokens: int,
              limits: Limits) -> ResolvedOptions:
    """`GenerationOptions.validate`, its errors as 400s naming the JSON field."""
    try:
        options = GenerationOptions(max_new_tokens=max_tokens, **generation)
        with spelled_warnings(http_spelling(given_as)):  # (logged once per message; the request goes on)
            return options.validate(limits.mean_recurrence, limits.gate_threshold, limits.init_scale,
                                    limits.max_num_steps)  # (itself within the server's depth ceiling)
    except OptionError as exc:
        raise option_error(exc, given_as) from None
    finally:
        forget_warnings_past(MAX_REMEMBERED_WARNINGS)


def forget_warnings_past(limit: int) -> None:
    """Start this module's record of logged warnings over once it holds more than `limit` messages. Python logs a
    warning once per distinct message by keeping each in the calling module's `__warningregistry__`; the option
    warnings `validated` raises name the client's value (`top_p=0.123 has no effect in greedy decoding`), so a client
    sending ever new values grew it by one entry per request, for the server's life. (Forgotten messages may be logged
    once more.)"""
    registry = globals().get("__warningregistry__")
    if registry is not None and len(registry) > limit:
        registry.clear()


def option_error(exc: OptionError, given_as: dict[str, str], note: str = "") -> APIError:
    """A bad option as the request's 400 naming the field at fault: option names as the client sent them
    (`http_spelling`), None / True / False as JSON writes them (`json_words`), then `note`."""
    spelling = http_spelling(given_as)
    param = "temperature" if exc.field == "do_sample" else spelling(exc.field)
    return bad(param, json_words(str(exc.spelled(spelling))) + note)


def unknown_model(model: str, served_names: set[str] | frozenset[str]) -> APIError:
    """The 404 of a request (or /v1/models/{id}) naming a model this server does not serve. The name is clipped:
    a client's megabytes of `model` came back whole in the answer."""
    from recurrent_depth.files import clipped, clipped_names

    return APIError(404, f"the model {clipped(model)} does not exist; this server serves "
                         f"{clipped_names(sorted(served_names), 20)}", param="model", code="model_not_found")


def stop_strings(value: Any, limits: Limits) -> list[str]:
    """A request's 'stop' as a list of strings, checked (400s naming 'stop'); `build_app` checks
    generation_config.json's stop strings, a request's default, here too."""
    stop = [] if value is None else [value] if isinstance(value, str) else value
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("stop", f"'stop' must be a string or a list of strings, got {_describe(value)}")
    if len(stop) > limits.max_stop:
        raise bad("stop", f"'stop' has {len(stop)} strings; at most {limits.max_stop} are allowed")
    if any(s == "" for s in stop):
        raise bad("stop", "'stop' strings must not be empty")
    for i, s in enumerate(stop):
        check_text(s, "stop", f"'stop'[{i}]")
    return stop


def requested_model(body: dict, served_names: set[str] | None) -> str | None:
    """A request's `model` (None when left out), checked: a string, and one this server serves (404) unless
    `served_names` is None (the caller checks it)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"'model' must be a string, got {_describe(model)}")
    if model is not None and served_names is not None and model not in served_names:
        raise unknown_model(model, served_names)
    return model


def parse_sampling(body: dict, limits: Limits, served_names: set[str] | None) -> Sampling:
    """The fields both routes share, checked; `served_names` None leaves the check of `model`'s value to the
    caller (the server's handlers: runtime LoRA loading changes the names while preparation workers run)."""
    model = requested_model(body, served_names)
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        from recurrent_depth.files import MESSAGE_NAME_CHARS, clipped

        # (clipped: a client's megabyte-long field name came back whole, twice)
        raise bad(unknown[0][:MESSAGE_NAME_CHARS], f"{clipped(unknown[0])} is not a field of this server; the "
                  f"generation options are {sorted(HTTP_OPTIONS)} (see docs/inference.md)")
    n = get_int(body, "n", 1, 1, limits.max_n, nullable=True) or 1
    refuse_unsupported(body, n)
    stream = get_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", f"'stream_options' must be an object, got {_describe(options)}")
    if options and not stream:  # (an empty object asks nothing: it passes, as in vLLM)
        raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true (as OpenAI and vLLM "
                                    "answer): send \"stream\": true, or leave stream_options out")
    include_usage = bool(stream and options and options.get("include_usage") is True)

    stop = stop_strings(body.get("stop"), limits)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limits.vocab_size for t in stop_ids
    ):
        raise bad("stop_token_ids", f"'stop_token_ids' must be a list of token ids in [0, {limits.vocab_size}), "
                                    f"got {_describe(body.get('stop_token_ids'))}")

    if body.get("stop") is None and limits.defaults.get("stop"):  # the file's stop strings, unless the request's
        stop = list(limits.defaults["stop"])
    seed = get_int(body, "seed", limits.defaults.get("seed"), -(2**63), 2**63 - 1)
    ignore_eos = get_bool(body, "ignore_eos", False)
    generation, given_as = generation_fields(body, limits)
    validated(generation, given_as, 1, limits)  # bad options are a 400 before the prompt is read
    return Sampling(
        model=model, max_tokens=None, n=n, stream=stream, include_usage=include_usage, stop=stop,
        stop_token_ids=list(stop_ids), ignore_eos=ignore_eos, seed=seed,
        return_steps=get_bool(body, "return_steps", False), generation=generation, given_as=given_as,
        skip_special_tokens=get_bool(body, "skip_special_tokens", True),
        include_stop_str_in_output=get_bool(body, "include_stop_str_in_output", False),
    )


def generation_fields(body: dict, limits: Limits) -> tuple[dict[str, Any], dict[str, str]]:
    """The schema's HTTP options (and official aliases) in `body`, type-checked and bounded by the
    server's limits, as `generate` keyword arguments (+ the JSON names they came from).

    OpenAI conventions on top: temperature defaults to 1 and 0 means greedy (do_sample is not a
    wire field); top_k -1 or 0 means no top-k (vLLM's spelling). The fields the body leaves out take
    `limits.defaults` (generation_config.json), whose do_sample decides as in transformers."""
    values: dict[str, Any] = {}
    cleared = set()  # fields the request turned off (top_k -1): the file's value does not come back for them
    for name in HTTP_OPTIONS:
        value = body.get(name)
        if name == "top_k" and value in (-1, 0) and not isinstance(value, bool):
            value = None
            cleared.add(name)
        if value is None:
            continue
        try:
            check_type(name, value)
        except OptionError as exc:
            raise bad(name, json_words(str(exc))) from None
        check_cap(name, OFFICIAL_ALIASES[name].field if name in OFFICIAL_ALIASES else name, value, limits)
        values[name] = value
    temperature = values.pop("temperature", None)
    if temperature is not None:
        if temperature < 0:
            raise bad("temperature", f"'temperature'={temperature} is out of range: expected a number >= 0 "
                                     "(0 = greedy)")
        values["do_sample"] = temperature > 0
        if temperature > 0:
            values["temperature"] = temperature
    if "num_steps" not in values and limits.default_num_steps is not None:
        values["num_steps"] = limits.default_num_steps
    try:  # (exit_threshold "auto" is resolved below, once the file's exit_criterion has joined, as rdepth generate)
        options, given_as = canonical(values, resolve_auto=False)
    except OptionError as exc:
        raise bad(exc.field, json_words(str(exc))) from None
    # the file's values where the request left a field out; its temperature, top_k, top_p and min_p only where the
    # request samples (transformers' do_sample rule, as our transformers classes and rdepth generate read the file)
    file_options = {k: v for k, v in limits.defaults.items() if k in FILE_OPTIONS and k not in cleared}
    merged = with_generation_defaults(options, file_options)
    for name in merged.keys() - options.keys():  # the file's values obey the server's bounds too
        check_cap(name, name, merged[name], limits)
    try:
        options = resolved_auto(merged)
    except OptionError as exc:
        raise bad(given_as.get(exc.field, exc.field), json_words(str(exc))) from None
    if "do_sample" not in options:  # neither the request nor the file says: OpenAI's temperature 1
        options.update(do_sample=True, temperature=1.0)
    return options, given_as


def check_cap(name: str, option_name: str, value: Any, limits: Limits) -> None:
    """400 for a value above the server's bound on this option (its schema `http_max`)."""
    option = OPTIONS[option_name]
    cap = getattr(limits, option.http_max) if isinstance(option.http_max, str) else option.http_max
    if cap is not None and isinstance(value, int | float) and value > cap:
        flag = " (set by rdepth serve --max-num-steps)" if option.http_max == "max_num_steps" else ""
        raise bad(name, f"'{name}'={value} is out of range: this server allows at most {cap}{flag}")


def http_spelling(given_as: dict[str, str]) -> Any:
    """Fields by their JSON names: the name the client sent, max_tokens for max_new_tokens, and
    the temperature rule for do_sample (not a wire field)."""
    wire = {"max_new_tokens": "max_tokens", "do_sample": "temperature > 0 (send temperature: 0)"}
    return negating(lambda name: given_as.get(name, wire.get(name, name)), given_as)


# ---------------------------------------------------------------------------------------- endpoints
@dataclass
class CompletionRequest:
    sampling: Sampling
    prompts: list[str | list[int]]
    echo: bool
    logprobs: int | None
    add_special_tokens: bool


# Fields of one generation route sent to the other: each would change the answer there, so a 400 names
# it rather than the route ignoring it (OpenAI refuses them too).
OTHER_ROUTE_FIELDS = {
    "completions": {"messages": "'messages' belongs to /v1/chat/completions; /v1/completions takes 'prompt'",
                    "max_completion_tokens": "'max_completion_tokens' belongs to /v1/chat/completions; "
                                             "/v1/completions takes 'max_tokens'",
                    "top_logprobs": "'top_logprobs' belongs to /v1/chat/completions; /v1/completions takes "
                                    "'logprobs': N (the N most likely tokens)",
                    **{name: f"'{name}' belongs to /v1/chat/completions (it shapes the chat template's prompt); "
                             "/v1/completions takes the prompt as it is"
                       for name in ("chat_template_kwargs", "add_generation_prompt", "continue_final_message")}},
    "chat": {"prompt": "'prompt' belongs to /v1/completions; /v1/chat/completions takes 'messages'",
             "echo": "'echo' belongs to /v1/completions (it echoes the prompt there); /v1/chat/completions has "
                     "no echo",
             # (vLLM's chat adds a BOS on top of the template's for true: it was ignored here, silently)
             "add_special_tokens": "'add_special_tokens': true is not supported on /v1/chat/completions: the chat "
                                   "template writes the special tokens (send false, or leave it out)"},
}


def refuse_other_route_fields(body: dict, route: str) -> None:
    for name, message in OTHER_ROUTE_FIELDS[route].items():
        if body.get(name) not in (None, False):
            raise bad(name, message)


def parse_completion(body: dict, limits: Limits, served_names: set[str] | None) -> CompletionRequest:
    sampling = parse_sampling(body, limits, served_names)
    refuse_other_route_fields(body, "completions")
    template_tools(body, limits, "completions")  # (tools are a 400 here: no chat template)
    if "prompt" not in body:
        raise bad("prompt", "'prompt' is required")
    prompt = body["prompt"]

    def token_ids(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)

    if isinstance(prompt, str) or (token_ids(prompt) and prompt):
        prompts: list[Any] = [prompt]  # one text or one token-id prompt
    elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                  or all(token_ids(p) for p in prompt)):
        prompts = list(prompt)  # a batch of texts or of token-id prompts
    else:
        raise bad("prompt", "'prompt' must be a string, a list of strings, a list of token ids or a list of lists "
                            f"of token ids (non-empty), got {_describe(prompt)}")
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            check_text(p, "prompt", "'prompt'" if len(prompts) == 1 else f"'prompt'[{i}]")
        if isinstance(p, list):
            if not p:
                raise bad("prompt", "a token-id prompt must not be empty")
            bad_ids = [t for t in p if not 0 <= t < limits.vocab_size]
            if bad_ids:
                raise bad("prompt", f"token id {bad_ids[0]} in 'prompt' is outside the vocabulary [0, "
                                    f"{limits.vocab_size})")
    if len(prompts) * sampling.n > limits.max_sequences:
        raise bad("prompt", f"{len(prompts)} prompts x n={sampling.n} is more than the {limits.max_sequences} "
                            "sequences one request may ask for")
    # not sent: generation_config.json's max_new_tokens (make_jobs: within the context left), else 16 (OpenAI's)
    default = None if "max_new_tokens" in limits.defaults else 16
    sampling.max_tokens = get_int(body, "max_tokens", default, 0, MAX_TOKENS_FIELD)
    logprobs = get_int(body, "logprobs", None, 0, limits.max_top_logprobs)
    echo = get_bool(body, "echo", False)
    return CompletionRequest(sampling, prompts, echo, logprobs, get_bool(body, "add_special_tokens", True))


@dataclass
class ChatRequest:
    sampling: Sampling
    messages: list[dict[str, str]]
    logprobs: bool
    top_logprobs: int | None
    tools: list[dict[str, Any]] | None = None  # for the chat template's `tools` (tool_choice "none")
    add_generation_prompt: bool = True  # the prompt opens the assistant's turn
    continue_final_message: bool = False  # the prompt ends inside the final (assistant's) message, to continue it
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra chat template variables


def _strings(value: Any) -> list[str]:
    """Every string in a JSON value, keys included."""
    out, todo = [], [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, list):
            todo += item
        elif isinstance(item, dict):
            todo += [*item.keys(), *item.values()]
    return out


def parse_chat(body: dict, limits: Limits, served_names: set[str] | None) -> ChatRequest:
    sampling = parse_sampling(body, limits, served_names)
    refuse_other_route_fields(body, "chat")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"'messages' must be a non-empty list of messages, got {_describe(messages)}")
    clean = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad("messages", f"{where} must be an object with 'role' and 'content', got {_describe(message)}")
        role = message.get("role")
        if role not in ROLES:
            raise bad("messages", f"{where}.role={_describe(role)} is invalid: expected one of {list(ROLES)}")
        try:  # text parts joined as `rdepth sft` joins them; a non-text part is a 400 naming its type
            content = content_text(message.get("content"), f"{where}.content")
        except ValueError as exc:
            raise bad("messages", str(exc)) from None
        check_text(content, "messages", f"{where}.content")
        # its other fields (a tool's name, an assistant's tool_calls) reach the chat template as they are, as in
        # `rdepth sft` (a null one as if absent): they were dropped, so a template reading them rendered another prompt
        fields = {k: v for k, v in message.items() if v is not None and k not in ("role", "content")}
        for key, value in fields.items():
            for text in _strings(value):
                check_text(text, "messages", f"{where}.{key}")
        clean.append({**{k: v for k, v in message.items() if v is not None}, "role": role, "content": content})
    # max_completion_tokens wins when set; null means "not set" for either name
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(name)
    sampling.max_tokens = get_int({name: max_tokens}, name, None, 1, MAX_TOKENS_FIELD)
    if name == "max_completion_tokens":  # errors about the answer's length name the field the client sent
        sampling.given_as["max_new_tokens"] = name
    sampling.given_as["prompt"] = "messages"  # (and a prompt that fills the context names the messages)
    logprobs = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", None, 0, limits.max_top_logprobs)
    if top is not None and not logprobs:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    add_prompt, continue_final = chat_turn_fields(body, clean)
    return ChatRequest(sampling, clean, logprobs, top, template_tools(body, limits, "chat"), add_prompt,
                       continue_final, template_kwargs(body.get("chat_template_kwargs")))


def chat_turn_fields(body: dict, messages: list[dict[str, Any]]) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message), checked as vLLM checks them: not both true, and only an
    assistant's final message can be continued. add_generation_prompt left out is true, or false with
    continue_final_message (which would otherwise need it sent as false)."""
    continue_final = get_bool(body, "continue_final_message", False)
    add_prompt = get_bool(body, "add_generation_prompt", not continue_final)
    if add_prompt and continue_final:
        raise bad("continue_final_message", "'continue_final_message' and 'add_generation_prompt' cannot both be "
                                            "true: continue the final message, or open a new assistant turn")
    if continue_final and messages[-1]["role"] != "assistant":
        raise bad("continue_final_message", "'continue_final_message' continues the final message, which must be "
                                            f"the assistant's; messages[{len(messages) - 1}].role is "
                                            f"{_describe(messages[-1]['role'])}")
    return add_prompt, continue_final


def template_kwargs(value: Any) -> dict[str, Any]:
    """A chat request's `chat_template_kwargs` (extra chat template variables, e.g. Qwen3's enable_thinking),
    checked: an object of at most `MAX_TEMPLATE_KWARGS` JSON values named by identifiers, none a variable the
    server sets (`RESERVED_VARIABLES`: the messages, tools, add_generation_prompt, special-token variables)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("chat_template_kwargs", f"'chat_template_kwargs' must be an object, got {_describe(value)}")
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise bad("chat_template_kwargs", f"'chat_template_kwargs' has {len(value)} names; at most "
                                          f"{MAX_TEMPLATE_KWARGS} are allowed")
    for name, item in value.items():
        if not _TEMPLATE_NAME.fullmatch(name):
            raise bad("chat_template_kwargs", f"'chat_template_kwargs' name {_describe(name)} is not an identifier "
                                              "(letters, digits and _, not starting with a digit)")
        if name in RESERVED_VARIABLES:
            raise bad("chat_template_kwargs", f"'chat_template_kwargs' cannot set {name!r}: the server sets it "
                                              "(send it as its own field, if it is one)")
        for text in _strings(item):
            check_text(text, "chat_template_kwargs", f"'chat_template_kwargs'.{name}")
    return value


TOOL_KEYS = frozenset({"type", "function"})
FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})


def template_tools(body: dict, limits: Limits, route: str) -> list[dict[str, Any]] | None:
    """A request's `tools` for the chat template (None: no tools), checked. This server has no tool calling
    (nothing parses a model's calls), so tools can only be shown to the model, with tool_choice "none": as vLLM
    renders them without --enable-auto-tool-choice. Any other tool_choice with tools is a 400, and so are tools
    with tool_choice left out (then OpenAI's default is "auto", and vLLM refuses it likewise)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice", f"'tool_choice'={_describe(choice)} needs 'tools' and tool calling; this "
                                     "server has no tool calling")
        return None
    if route != "chat":
        raise bad("tools", "'tools' belongs to /v1/chat/completions (shown to the chat template with tool_choice "
                           "\"none\"); /v1/completions has no tools")
    if choice != "none":
        given = "'tool_choice' left out (OpenAI's default with tools is \"auto\")" if choice is None \
            else f"'tool_choice'={_describe(choice)}"
        raise bad("tool_choice", f"{given} asks for tool calls, which this server cannot make (no "
                                 "tool calling); send tool_choice \"none\" to show the tools to the chat template "
                                 "only")
    if not isinstance(tools, list):
        raise bad("tools", f"'tools' must be a list of tools, got {_describe(tools)}")
    if len(tools) > limits.max_tools:
        raise bad("tools", f"'tools' has {len(tools)} tools; at most {limits.max_tools} are allowed")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        shape = '{"type": "function", "function": {"name": ..., "parameters": {...}}}'
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad("tools", f"{where} must be {shape}, got {_describe(tool)}")
        function = tool["function"]
        extra = sorted(set(tool) - TOOL_KEYS) or sorted(set(function) - FUNCTION_KEYS)
        if extra:
            from recurrent_depth.files import clipped

            raise bad("tools", f"{where} has the field {clipped(extra[0])}, which a tool does not take (a tool is "
                               f"{shape}; a function has {sorted(FUNCTION_KEYS)})")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad("tools", f"{where}.function.name must be a non-empty string, got {_describe(name)}")
        for key, kind, types in (("description", "a string", str), ("parameters", "an object (a JSON Schema)", dict),
                                 ("strict", "true or false", bool)):
            if function.get(key) is not None and not isinstance(function[key], types):
                raise bad("tools", f"{where}.function.{key} must be {kind}, got {_describe(function[key])}")
        for text in _strings(tool):
            check_text(text, "tools", where)
    return tools


# ---------------------------------------------------------------------------------------- vLLM's tokenizer routes
TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "return_token_strs",
                             "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools"})


@dataclass
class TokenizeRequest:
    """`POST /tokenize` (vLLM's): a text `prompt`, or `messages` rendered as a chat completion renders them."""

    model: str | None
    prompt: str | None
    chat: ChatRequest | None  # messages, tools and template fields as /v1/chat/completions takes them
    add_special_tokens: bool
    return_token_strs: bool
    token_strs: list[str] | None = None  # filled by the preparation worker, which has the tokenizer


@dataclass
class DetokenizeRequest:
    """`POST /detokenize` (vLLM's): token ids back to text."""

    model: str | None
    tokens: list[int]
    prompt: str = ""  # the text, filled by the preparation worker


def _tokenizer_route_model(body: dict, served_names: set[str] | None, fields: frozenset[str], route: str) -> Any:
    """`model` checked (404 unless served; `served_names` None: the caller checks it) after the fields: a field
    the route does not take is a 400 naming it."""
    unknown = sorted(set(body) - fields)
    if unknown:
        from recurrent_depth.files import MESSAGE_NAME_CHARS, clipped

        raise bad(unknown[0][:MESSAGE_NAME_CHARS], f"{clipped(unknown[0])} is not a field of {route}; it takes "
                                                   f"{sorted(fields)}")
    return requested_model(body, served_names)


def parse_tokenize(body: dict, limits: Limits, served_names: set[str] | None) -> TokenizeRequest:
    model = _tokenizer_route_model(body, served_names, TOKENIZE_FIELDS, "/tokenize")
    return_strs = get_bool(body, "return_token_strs", False)
    if ("prompt" in body) == ("messages" in body):
        raise bad("prompt", "/tokenize takes either 'prompt' (a string) or 'messages' (a chat), not both or neither")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise bad("prompt", f"'prompt' must be a string, got {_describe(prompt)}")
        check_text(prompt, "prompt", "'prompt'")
        for name in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools"):
            if body.get(name) is not None:
                raise bad(name, f"'{name}' shapes a chat prompt: send it with 'messages', not 'prompt'")
        return TokenizeRequest(model, prompt, None, get_bool(body, "add_special_tokens", True), return_strs)
    if get_bool(body, "add_special_tokens", False):  # the template writes its own (a chat completion adds none)
        raise bad("add_special_tokens", "'add_special_tokens': true is not supported with 'messages': the chat "
                                        "template writes the special tokens, as for a chat completion")
    # the chat completion's own checks, so the ids are those a chat completion of these messages runs on; tools are
    # shown to the template as a chat completion shows them with tool_choice "none"
    chat_body = {name: body[name] for name in ("messages", "add_generation_prompt", "continue_final_message",
                                               "chat_template_kwargs", "tools") if name in body}
    if chat_body.get("tools") not in (None, []):
        chat_body["tool_choice"] = "none"
    chat = parse_chat(chat_body, limits, None)
    return TokenizeRequest(model, None, chat, False, return_strs)


def parse_detokenize(body: dict, limits: Limits, served_names: set[str] | None) -> DetokenizeRequest:
    model = _tokenizer_route_model(body, served_names, frozenset({"model", "tokens"}), "/detokenize")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad("tokens", f"'tokens' must be a list of token ids, got {_describe(tokens)}")
    outside = [t for t in tokens if not 0 <= t < limits.vocab_size]
    if outside:
        raise bad("tokens", f"token id {outside[0]} in 'tokens' is outside the vocabulary [0, {limits.vocab_size})")
    return DetokenizeRequest(model, tokens)
