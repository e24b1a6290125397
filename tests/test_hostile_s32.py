"""Hostile files and requests on this session's surfaces: a LoRA adapter's adapter_config.json fields, SFT records'
`tools` / `chat_template_kwargs`, and chat request bodies. Each is untrusted: a one-line error naming what is wrong,
no hang, nothing executed, and nothing computed otherwise than the file says."""

from __future__ import annotations

import json
import time

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.data.chat import conversation
from recurrent_depth.serving.chat_template import ChatTemplate
from recurrent_depth.serving.protocol import MAX_JSON_NESTING, APIError, parse_request_body
from recurrent_depth.train.lora import LoraSpec, add_lora, load_lora, save_adapter

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]


def nested(levels: int) -> dict:
    value: dict = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


# ------------------------------------------------------------------ SFT records and chat requests
@pytest.mark.parametrize("field, value, message", [
    # JSON strings (trl's column) nested past the parser: a RecursionError traceback in `rdepth sft`
    ("tools", "[" * 3000 + "]" * 3000, r"'tools' is a JSON string nested too deeply to parse"),
    ("chat_template_kwargs", '{"x": ' + "[" * 3000 + "]" * 3000 + "}",
     r"'chat_template_kwargs' is a JSON string nested too deeply to parse"),
    # parsed, but deeper than escaping special-token text and the template can recurse (a RecursionError in encode)
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": nested(600)}}],
     rf"'tools' nests arrays and objects over {MAX_JSON_NESTING} levels deep"),
    ("chat_template_kwargs", {"x": nested(600)},
     rf"'chat_template_kwargs' nests arrays and objects over {MAX_JSON_NESTING} levels deep"),
    ("messages", [CHAT[0], {**CHAT[1], "tool_calls": [{"function": {"name": "f", "arguments": nested(600)}}]}],
     rf"'messages' nests arrays and objects over {MAX_JSON_NESTING} levels deep"),
])
def test_an_sft_record_nested_too_deeply_is_a_one_line_error(field, value, message):
    record = {"messages": CHAT, field: value}
    with pytest.raises(ValueError, match=rf"^data.jsonl:3: {message}$"):
        conversation(record, "data.jsonl:3")
    # as deep as the server takes: accepted
    kept = conversation({"messages": CHAT, "chat_template_kwargs": {"x": nested(MAX_JSON_NESTING - 1)}}, "d:1")
    assert kept.variables is not None


def test_a_request_body_nested_too_deeply_is_a_400_naming_the_limit():
    """It was a 400 "the chat template failed on these messages: RecursionError" (param messages) for nesting in
    tools or chat_template_kwargs, after a trip through the request-preparation worker."""
    def body(levels: int) -> bytes:
        return json.dumps({"model": "m", "messages": CHAT[:1], "chat_template_kwargs": {"x": nested(levels)}}).encode()

    assert parse_request_body(body(MAX_JSON_NESTING - 2))["model"] == "m"  # (the body and kwargs: 2 levels)
    with pytest.raises(APIError, match=rf"^the request body nests arrays and objects over {MAX_JSON_NESTING} levels "
                                       r"deep$") as caught:
        parse_request_body(body(600))
    assert caught.value.status == 400


def test_template_payloads_in_tools_and_variables_render_as_plain_text():
    """Values are the template's data, never its source: sandbox-escape payloads come out as written."""
    payload = "{{ cycler.__init__.__globals__.os.popen('id').read() }}{% print(1) %}"
    template = ChatTemplate("{% for t in tools %}[{{ t.function.description }}]{% endfor %}({{ extra }})"
                            "{% for m in messages %}{{ m.content }}{% endfor %}", {}, 1 << 16)
    tools = [{"type": "function", "function": {"name": "f", "description": payload}}]
    text = template.render(CHAT, add_generation_prompt=False, tools=tools, variables={"extra": payload})
    assert text == f"[{payload}]({payload})hiok"


# ------------------------------------------------------------------ adapter_config.json fields
@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    out = tmp_path_factory.mktemp("hostile_adapter") / "adapter"
    torch.manual_seed(0)
    save_adapter(add_lora(tiny_model(), LoraSpec(rank=2, parts=("coda",))), out)
    return out


def tiny_model() -> rd.RecurrentDepthLM:
    torch.manual_seed(0)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()


def with_config(adapter, tmp_path, **fields):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(adapter, copy)
    config = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return copy


@pytest.mark.parametrize("fields, message", [
    # peft tests these by truth: use_rslora="false" scaled the adapter by alpha/sqrt(r) instead of alpha/r, silently
    ({"use_rslora": "false"}, r"adapter_config.json: use_rslora='false' is invalid: expected true or false$"),
    ({"use_dora": "false"}, r"adapter_config.json: use_dora='false' is invalid: expected true or false$"),
    ({"fan_in_fan_out": 1}, r"adapter_config.json: fan_in_fan_out=1 is invalid: expected true or false$"),
    # peft imported the module `megatron_core` names (ModuleNotFoundError here)
    ({"megatron_config": {"tensor_model_parallel_size": 1}},
     r"adapter_config.json: megatron_config=.* is invalid: expected null"),
    # wrong-typed sub-configs and an unknown task type: peft's TypeError traceback, a message naming no file
    ({"eva_config": {"rho": "x"}}, r"^cannot load the LoRA adapter .*copy onto this model: '<' not supported"),
    ({"task_type": "EVIL"}, r"^cannot load the LoRA adapter .*copy onto this model: Invalid task type: 'EVIL'"),
])
def test_hostile_adapter_config_fields_are_refused_in_one_line(adapter, tmp_path, fields, message):
    model = tiny_model()
    with pytest.raises(ValueError, match=message) as caught:
        load_lora(model, with_config(adapter, tmp_path, **fields))
    assert "\n" not in str(caught.value)
    assert not any("lora_" in name for name, _ in model.named_parameters())  # the model as it was given


@pytest.mark.parametrize("fields, field", [
    ({"exclude_modules": r"([\w.]+)+Z"}, "exclude_modules"),
    ({"rank_pattern": {r"([\w.]+)+Z": 2}}, "rank_pattern"),
    ({"alpha_pattern": {r"([\w.]+)+Z": 4}}, "alpha_pattern"),
])
def test_a_pattern_regex_that_backtracks_exponentially_is_refused_in_time(adapter, tmp_path, monkeypatch, fields,
                                                                         field):
    """peft matches exclude_modules and each rank_pattern / alpha_pattern key against every module name as it
    matches target_modules, which was timed: these hung `rdepth generate --lora` and the server's --lora-modules
    start-up for hours on one module name."""
    from recurrent_depth.train import lora

    monkeypatch.setattr(lora, "TARGET_REGEX_SECONDS", 0.2)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=rf"its adapter_config.json's {field}='\(\[.*takes over 0.2 s to match "
                                         r"this model's \d+ module names") as caught:
        load_lora(tiny_model(), with_config(adapter, tmp_path, **fields))
    assert "\n" not in str(caught.value) and time.perf_counter() - start < 5
    # an ordinary one still loads
    assert load_lora(tiny_model(), with_config(adapter, tmp_path / "ok", rank_pattern={"proj": 2}))
