"""A model directory's chat template, rendered in a bounded Jinja sandbox.

The template is a file someone handed us, so it runs in jinja2's `ImmutableSandboxedEnvironment`
(no attribute access to internals, no mutation of the inputs) with resource caps on top: every
`range()` draws from one iteration budget per render, `*`, `+`, `**` and `~` may not build values
beyond the output cap (nor numbers past `MAX_INT_BITS`), no filter or method call may return one,
loops and calls stop at a wall-clock deadline, and rendering stops as soon as the output passes
its cap. So a value cannot keep growing from step to step, and a render that is not in a worker
(`rdepth sft`, exports reading the end-of-turn ids) ends too. What one step can still build from
capped values (a filter asked for a huge width, a replace of every character by a long string) is
stopped by the worker process that renders it in the server (memory limit, wall-clock kill; the
start-up probe of the template included; see `prep.py`).

The environment matches transformers' `apply_chat_template` (trim_blocks, lstrip_blocks,
loopcontrols, `{% generation %}` blocks, `raise_exception`, `strftime_now`, `tojson`, the
special-token variables), so templates written for it render the same text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Generator
from datetime import datetime
from pathlib import Path
from typing import Any

from recurrent_depth.files import read_json, read_text

# the roles a chat message may have: what the server takes and what `rdepth sft` trains on (data/chat.py)
ROLES = ("system", "developer", "user", "assistant", "tool")

MAX_TEMPLATE_BYTES = 1 << 20
MAX_ITERATIONS = 100_000  # range() iterations per render, all ranges together
MAX_INT_BITS = 4096  # the largest number `*` and `**` may build (squaring in a loop otherwise runs for ever)
MAX_SECONDS = 30.0  # a render's deadline, checked at each loop step, call, filter and operator
# Names a message's reasoning comes under, the first the one templates read: transformers' `render_jinja_template`
# gives each message that has one all three (`_alias_reasoning_fields`), so a template reading either sees it.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
SPECIAL_VARIABLES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
# The names a request's extra template variables (`chat_template_kwargs`) may not take: the variables `render` sets,
# the functions it gives the template, Jinja's own globals and the names Jinja gives a meaning inside templates.
RESERVED_VARIABLES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", *SPECIAL_VARIABLES,
    "range", "raise_exception", "strftime_now", "dict", "lipsum", "cycler", "joiner", "namespace",
    "loop", "self", "caller", "varargs", "kwargs",
})
# What `render(continue_final_message=True)` appends to the final message to find where its text ends: the tag
# transformers' `apply_chat_template` uses, so both cut the same text at the same place.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TemplateLimit(ValueError):
    """The template went past a resource cap."""


class RenderedTooLong(ValueError):
    """The rendered prompt is longer than the output cap (it cannot fit the model's context)."""


def load_template(model_dir: Path) -> tuple[str | None, dict[str, str]]:
    """(template source or None, special-token variables) from `chat_template.jinja` or
    `tokenizer_config.json` (where transformers looks)."""
    config: dict[str, Any] = {}
    config_path = model_dir / "tokenizer_config.json"
    if config_path.exists():
        config = read_json(config_path, 16 * MAX_TEMPLATE_BYTES, "tokenizer config")
        if not isinstance(config, dict):  # (was read as no template: chat off, SFT untemplated, without a word)
            raise ValueError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    variables = {}
    for name in SPECIAL_VARIABLES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            variables[name] = value
    file = model_dir / "chat_template.jinja"
    if file.exists():
        return read_text(file, MAX_TEMPLATE_BYTES, "chat template"), variables
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: the default one, as transformers' apply_chat_template takes
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        if "default" not in named:
            raise ValueError(f"{config_path}: chat_template names templates {sorted(map(str, named))[:8]} but none "
                             "'default', the one a chat renders (transformers refuses it too)")
        source = named["default"]
    if source is not None and not isinstance(source, str):  # (a number or object was read as no template)
        raise ValueError(f"{config_path}: chat_template must be a string (or a list of named templates), got "
                         f"{type(source).__name__}")
    return source or None, variables


# What joins a message's text parts into the one string a template renders: vLLM, llama.cpp's server and
# TensorRT-LLM join them with a newline for templates that take string content ("a" + "b" is not "ab").
PART_SEPARATOR = "\n"


def content_text(content: Any, where: str) -> str:
    """A message's `content` as the text its chat template renders (the server and `rdepth sft` both read
    content through this): a string as it is, null as empty text (OpenAI's assistant turn of tool calls
    only), and a list of OpenAI content parts (`[{"type": "text", "text": ...}, ...]`) as their texts
    joined by `PART_SEPARATOR`. Anything else is a one-line ValueError naming `where`; a non-text part
    (`image_url`, `input_audio`, `file`, ...) is named by its type: these models read text only."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string, null or a list of text parts, got {type(content).__name__}")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise ValueError(f"{where}[{i}] must be a content part ({{'type': 'text', 'text': ...}}), got "
                             f"{type(part).__name__}")
        kind = part.get("type")
        if not isinstance(kind, str):
            raise ValueError(f"{where}[{i}] has no string 'type' (a text part is {{'type': 'text', 'text': ...}})")
        if kind != "text":
            raise ValueError(f"{where}[{i}] is a part of type {kind[:40]!r}, but the model reads text only: "
                             "send {'type': 'text', 'text': ...} parts")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{i}].text must be a string, got {type(part.get('text')).__name__}")
        texts.append(part["text"])
    return PART_SEPARATOR.join(texts)


class ChatTemplate:
    """A compiled chat template; `render(messages)` opens the assistant's turn."""

    def __init__(self, source: str, variables: dict[str, str], max_output_chars: int,
                 max_iterations: int = MAX_ITERATIONS, max_seconds: float = MAX_SECONDS) -> None:
        import functools

        import jinja2
        import jinja2.ext
        from jinja2 import nodes
        from jinja2.compiler import CodeGenerator
        from jinja2.nodes import Impossible
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = source
        self.variables = dict(variables)
        self.max_output_chars = max_output_chars
        self.max_iterations = max_iterations
        self.iterations = 0
        self.max_seconds = max_seconds
        self.deadline = float("inf")  # time.monotonic() past which the render under way stops
        self.has_generation_blocks = False  # set while compiling: the source has a `{% generation %}` block
        self.blocks: list[tuple[int, str]] | None = None  # while `generation_spans` renders: (start, text) per block
        self.rendered = 0  # characters yielded so far by the render under way
        cap = max_output_chars
        owner = self

        def check_time() -> None:
            if time.monotonic() > owner.deadline:
                raise TemplateLimit(f"the chat template ran past its {owner.max_seconds:g} s deadline")

        def capped(value: Any) -> Any:
            """`value`, unless it is a string, list, tuple or dict over the cap (values built step by step)."""
            if isinstance(value, (str, list, tuple, dict)) and len(value) > cap:
                raise TemplateLimit(f"the chat template built a value of {len(value)} items (at most {cap})")
            return value

        class NoConstantOutput(CodeGenerator):
            """Never evaluate output expressions while compiling (jinja would, even unoptimized), and join
            `a ~ b` through `BoundedSandbox.concat` (jinja joins it in place, past the caps on `+`)."""

            def _output_child_to_const(self, node: Any, frame: Any, finalize: Any) -> str:
                raise Impossible()

            def visit_Concat(self, node: Any, frame: Any) -> None:
                self.write("environment.concat((")
                for arg in node.nodes:
                    self.visit(arg, frame)
                    self.write(", ")
                self.write("))")

        class BoundedSandbox(ImmutableSandboxedEnvironment):
            intercepted_binops = frozenset(["*", "+", "**", "-", "/", "//", "%"])
            code_generator_class = NoConstantOutput

            def _parse(self, source: str, name: str | None, filename: str | None) -> Any:
                # every {% for %} loop's steps pass `check_time` (a loop over a string's characters has no range())
                tree = super()._parse(source, name, filename)
                for loop in tree.find_all(nodes.For):
                    loop.iter = nodes.Filter(loop.iter, "rdepth_steps", [], [], None, None, lineno=loop.lineno)
                return tree

            def concat(self, values: tuple) -> str:
                check_time()
                texts = [str(v) for v in values]
                if sum(map(len, texts)) > cap:  # (checked before the join: the join is what would build it)
                    raise TemplateLimit(f"the chat template built a value of {sum(map(len, texts))} items "
                                        f"(at most {cap})")
                return "".join(texts)

            def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
                check_time()
                return capped(super().call(__context, __obj, *args, **kwargs))

            def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
                check_time()
                sized = (str, list, tuple)
                if operator == "**" and isinstance(right, int) and abs(right) > 64:
                    raise TemplateLimit(f"the chat template raised a number to the power {right} (at most 64)")
                if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 \
                        and left.bit_length() * right > MAX_INT_BITS:
                    raise TemplateLimit(f"the chat template built a number over {MAX_INT_BITS} bits")
                if operator == "*":
                    seq, count = (left, right) if isinstance(left, sized) else (right, left)
                    if isinstance(seq, sized) and isinstance(count, int) and len(seq) * count > cap:
                        raise TemplateLimit(f"the chat template built a value of {len(seq) * count} items "
                                            f"(at most {cap})")
                    if isinstance(left, int) and isinstance(right, int) \
                            and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                        raise TemplateLimit(f"the chat template built a number over {MAX_INT_BITS} bits")
                if operator == "+" and isinstance(left, sized) and isinstance(right, sized) \
                        and len(left) + len(right) > cap:
                    raise TemplateLimit(f"the chat template built a value of {len(left) + len(right)} items "
                                        f"(at most {cap})")
                return capped(super().call_binop(context, operator, left, right))

        class GenerationBlocks(jinja2.ext.Extension):
            """`{% generation %}...{% endgeneration %}`, transformers' marks of the assistant's tokens
            (`return_assistant_tokens_mask`, trl's `assistant_only_loss`): the body renders unchanged, as a
            call block the way transformers' `AssistantTracker` renders it, and `generation_spans` notes
            where each block's text starts (the length of the text yielded before it)."""

            tags = {"generation"}

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                owner.has_generation_blocks = True
                return jinja2.nodes.CallBlock(self.call_method("_block"), [], [], body).set_lineno(lineno)

            def _block(self, caller: Any) -> str:
                text = caller()
                if owner.blocks is not None:
                    owner.blocks.append((owner.rendered, text))
                return text

        def steps(iterable: Any, most: float = float("inf")) -> Any:
            for count, item in enumerate(iterable):
                check_time()
                if count >= most:
                    raise TemplateLimit(f"the chat template built a sequence of over {cap} items")
                yield item

        def bounded_filter(function: Any) -> Any:
            @functools.wraps(function)  # (keeps jinja's pass_context marks)
            def bounded(*args: Any, **kwargs: Any) -> Any:
                check_time()
                value = capped(function(*args, **kwargs))
                # a lazy result (`slice`, `map`, `unique`) is built by whatever reads it (`| list`): capped there
                return steps(value, cap) if isinstance(value, Generator) else value
            return bounded

        def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
            if not isinstance(n, int) or not isinstance(max, int) or n * max > cap:
                raise TemplateLimit(f"the chat template asked lipsum() for {n} paragraphs of up to {max} words "
                                    f"(at most {cap} words in all)")
            return jinja2.utils.generate_lorem_ipsum(n, html, min, max)

        def bounded_range(*args: int) -> Any:
            steps = range(*args)
            if owner.iterations + len(steps) > owner.max_iterations:
                raise TemplateLimit(f"the chat template's loops went past {owner.max_iterations} range() iterations")
            owner.iterations += len(steps)
            return steps

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
                   sort_keys: bool = False) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        # optimized=False and NoConstantOutput: jinja folds constant expressions while compiling, so
        # `{{ 'x' | center(10**10) }}` would run, outside every cap, at start-up.
        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                             extensions=[jinja2.ext.loopcontrols, GenerationBlocks], optimized=False)
        env.filters["tojson"] = tojson
        env.filters.update({name: bounded_filter(f) for name, f in env.filters.items()}, rdepth_steps=steps)
        env.globals.update(range=bounded_range, lipsum=lipsum, raise_exception=raise_exception,
                           strftime_now=lambda fmt: datetime.now().strftime(fmt))
        self.template = env.from_string(source)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, continue_final_message: bool = False,
               variables: dict[str, Any] | None = None) -> str:
        """The prompt text; `tools`: OpenAI tool objects for the template's `tools` variable (transformers'
        `apply_chat_template(tools=...)` passes JSON-schema dicts the same way; None: no tools).
        `continue_final_message`: the text ends where the final message's content ends (no end of its turn), so
        the model continues it, cut as transformers cuts it. `variables`: extra template variables (a request's
        `chat_template_kwargs`), none of them `RESERVED_VARIABLES` (a ValueError). A message's reasoning reaches the
        template under all of `REASONING_FIELDS`, as transformers passes it. A cap or the deadline: `TemplateLimit`."""
        extra = dict(variables or {})
        taken = sorted(extra.keys() & (RESERVED_VARIABLES | self.template.environment.globals.keys()))
        if taken:
            raise ValueError(f"the chat template variable {taken[0]!r} is set by the server and cannot be overridden")
        final = ""
        if continue_final_message:
            if not messages:
                raise ValueError("continue_final_message needs a final message to continue")
            final = messages[-1]["content"]
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + CONTINUE_TAG}]
        messages = [tool_arguments_parsed(alias_reasoning(m)) for m in messages]
        self.iterations = 0
        self.rendered = 0
        self.deadline = time.monotonic() + self.max_seconds
        out: list[str] = []
        for piece in self.template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                            tools=tools, documents=None, **self.variables, **extra):
            self.rendered += len(piece)
            if self.rendered > self.max_output_chars:
                raise RenderedTooLong(f"the rendered chat prompt is over {self.max_output_chars} characters")
            out.append(piece)
        text = "".join(out)
        return cut_at_continue_tag(text, final) if continue_final_message else text

    def generation_spans(self, messages: list[dict[str, str]], add_generation_prompt: bool = False,
                         tools: list[dict[str, Any]] | None = None,
                         variables: dict[str, Any] | None = None) -> tuple[str, list[tuple[int, int]]]:
        """The text (`render`'s, `variables` included) and the (start, end) character span of each
        `{% generation %}` block in it, in the order the blocks close (transformers' `generation_indices`: an empty
        block is an empty span). A block rendered where its place in the text cannot be told (inside a macro, a
        `{% set %}` or `{% filter %}` block, or another block whose text is not yet written) is a one-line ValueError,
        where transformers would mark other characters."""
        self.blocks = []
        try:
            text = self.render(messages, add_generation_prompt, tools, variables=variables)
            blocks = self.blocks
        finally:
            self.blocks = None
        for start, body in blocks:
            if text[start:start + len(body)] != body:
                raise ValueError("a {% generation %} block renders inside a macro, a {% set %} or {% filter %} "
                                 "block or another generation block, so where its text lies cannot be told")
        return text, [(start, start + len(body)) for start, body in blocks]


def alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with its reasoning (under any of `REASONING_FIELDS`, the first set one) under all three names,
    as transformers gives it to the template (`thinking` for gpt-oss templates, `reasoning_content` for Qwen's)."""
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def tool_arguments_parsed(message: dict[str, Any]) -> dict[str, Any]:
    """`message` with each tool call's `function.arguments` JSON string (what OpenAI clients send) as the object it
    encodes, as vLLM gives it to the template: templates write `arguments | tojson` (Qwen's, Llama's), which encoded
    the string a second time. An empty or null one is `{}`; a string that is not JSON is a one-line ValueError."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not any(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              and not isinstance(c["function"].get("arguments"), dict | list)
                                              for c in calls):
        return message
    parsed = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if not isinstance(function, dict) or isinstance(arguments, dict | list):
            parsed.append(call)
            continue
        if not arguments:
            value: Any = {}
        elif not isinstance(arguments, str):
            raise ValueError(f"tool_calls[{i}].function.arguments must be a JSON string or an object, "
                             f"got {type(arguments).__name__}")
        else:
            try:
                value = json.loads(arguments)
            except (ValueError, RecursionError):  # (nesting too deep to parse is not JSON the template can take)
                raise ValueError(f"tool_calls[{i}].function.arguments is not valid JSON: "
                                 f"{arguments[:60]!r}") from None
        parsed.append({**call, "function": {**function, "arguments": value}})
    return {**message, "tool_calls": parsed}


def cut_at_continue_tag(text: str, final: str) -> str:
    """`text` up to the end of the final message's content `final`, marked by `CONTINUE_TAG` (transformers'
    `render_jinja_template`): just before the tag, or with trailing space stripped where the template trimmed
    the tag's own space (it strips the content, so the message's trailing space went too)."""
    at = text.rfind(CONTINUE_TAG.strip())
    if at < 0 or final.strip() not in text:
        raise ValueError("continue_final_message: the chat template does not render the final message's content, "
                         "so it cannot be continued")
    return text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
