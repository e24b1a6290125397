"""Regressions from a hunt through the chat-template sandbox: values that grew past the caps by `~`, `join` or
integer squaring, loops with no deadline, lazy filters, and a message's reasoning that transformers shows the
template and rdepth did not."""

import time

import pytest

from recurrent_depth.serving.chat_template import ChatTemplate, TemplateLimit

CHAT = [{"role": "user", "content": "hi"}]


def render(source: str, **kwargs) -> str:
    return ChatTemplate(source, {}, max_output_chars=10_000, **kwargs).render(CHAT)


@pytest.mark.parametrize("source", [
    # doubling by `~` (jinja's string concatenation, which the cap on `+` missed): 2**40 characters
    "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    # doubling by the join filter and by str.join
    "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = [ns.s, ns.s] | join %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ''.join([ns.s, ns.s]) %}{% endfor %}",
    # squaring an integer: 10**(2**40), which ran for ever
    "{% set ns = namespace(n=10) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}",
    "{% set ns = namespace(n=10) %}{% for i in range(40) %}{% set ns.n = ns.n ** 2 %}{% endfor %}",
    # one filter or method asked for a wide value, then the template keeps it (was a gigabyte string)
    "{% set s = 'x' | center(100000000) %}{{ s | length }}",
    "{% set s = 'x'.ljust(100000000) %}{{ s | length }}",
    "{% set s = '%100000000d' % 1 %}{{ s | length }}",
    # lazy filters read by `list`, and lipsum: no range() to cap
    "{{ [1] | slice(100000000, 'x') | list | length }}",
    "{{ lipsum(100000000) | length }}",
], ids=["tilde", "join-filter", "str-join", "int-square", "int-power", "center", "ljust", "percent", "slice",
        "lipsum"])
def test_values_built_step_by_step_stop_at_the_cap(source):
    t = time.monotonic()
    with pytest.raises(TemplateLimit):
        render(source)
    assert time.monotonic() - t < 5


def test_loops_without_range_stop_at_the_deadline():
    # cubic in a 1000-character string: 10**9 steps, none of them a range() (was hours; in the server's start-up
    # probe of the template and in `rdepth sft` nothing else stops it)
    source = ("{% set s = 'x' * 1000 %}{% for a in s %}{% for b in s %}{% for c in s %}{% endfor %}{% endfor %}"
              "{% endfor %}")
    t = time.monotonic()
    with pytest.raises(TemplateLimit, match="deadline"):
        render(source, max_seconds=0.3)
    assert time.monotonic() - t < 3
    # recursion through a recursive loop's `loop()` is a call, so it stops too
    with pytest.raises(TemplateLimit, match="deadline"):
        render("{% for m in [1, 2] recursive %}{% if loop.depth < 60 %}{{ loop([1, 2]) }}{% endif %}{% endfor %}",
               max_seconds=0.3)


def test_the_bounds_leave_ordinary_templates_as_they_were():
    source = ("{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ '<|' ~ m.role ~ '|>' }}"
              "{{ m.content | center(6) }}{{ [m.content, m.role] | join('+') }}{{ (2 ** 10) * 3 }}"
              "{% for c in m.content | list | unique %}{{ c }}{% endfor %}{% endfor %}")
    assert render(source) == "1/1<|user|>  hi  hi+user3072hi"


def test_a_messages_reasoning_reaches_the_template_as_transformers_gives_it():
    from transformers.utils.chat_template_utils import render_jinja_template

    source = ("{% for m in messages %}{{ m.role }}:{% if m.reasoning_content is string %}<think>"
              "{{ m.reasoning_content }}</think>{% endif %}{{ m.thinking }}|{{ m.content }}\n{% endfor %}")
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning": "r1"},
                {"role": "assistant", "content": "b", "thinking": "r2"},
                {"role": "assistant", "content": "c", "reasoning_content": "r3", "reasoning": "other"}]
    want = render_jinja_template([messages], chat_template=source)[0][0]
    assert "<think>r1</think>r1|a" in want  # (what the template reads)
    assert ChatTemplate(source, {}, 10_000).render(messages, add_generation_prompt=False) == want
    assert "reasoning_content" not in messages[1]  # the caller's messages are left as they were


def test_tool_call_arguments_sent_as_json_strings_reach_the_template_as_objects():
    """OpenAI clients send `function.arguments` as a JSON string; templates write `arguments | tojson` (Qwen's), so the
    string was encoded twice ("{\\"city\\": ...}"). As vLLM, the template gets the object: the render equals
    transformers' for the same call given as a dict (what transformers' docs ask for). Not JSON: one line."""
    from transformers.utils.chat_template_utils import render_jinja_template

    source = ("{% for m in messages %}{{ m.role }}:{{ m.content }}{% for c in m.tool_calls or [] %}"
              "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
              "{% endfor %}\n{% endfor %}")
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    as_object = [messages[0], {**messages[1], "tool_calls": [
        {**call, "function": {"name": "weather", "arguments": {"city": "Paris"}}}]}]
    want = render_jinja_template([as_object], chat_template=source)[0][0]
    assert '"arguments": {"city": "Paris"}' in want
    assert ChatTemplate(source, {}, 10_000).render(messages, add_generation_prompt=False) == want
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # (left as it was)
    bad = [messages[0], {**messages[1], "tool_calls": [{**call, "function": {"name": "w", "arguments": "{city"}}]}]
    with pytest.raises(ValueError, match=r"^tool_calls\[0\]\.function\.arguments is not valid JSON: '\{city'$"):
        ChatTemplate(source, {}, 10_000).render(bad, add_generation_prompt=False)
