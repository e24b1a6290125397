"""Found by differential fuzzing of SFT data against transformers' `apply_chat_template(return_assistant_tokens_mask)`,
trl's SFTTrainer preprocessing and `rdepth serve`'s chat encoding (/tmp/hunt_sftfuzz)."""

import json

import pytest

import recurrent_depth as rd
from recurrent_depth.data.chat import ExampleEncoder, conversation, load_examples
from recurrent_depth.serving.text import TextCodec
from tests.test_sft import with_template
from tests.test_sft_chat_data import model_dir  # noqa: F401  (the module's tiny model directory fixture)
from tests.train_support import VOCAB

# a template that shows the tools, as Llama-3 / Qwen / Hermes templates do, and marks answers for the loss
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|begin_header|>system<|end_header|>Tools: {{ tools | tojson }}<|end_turn|>"
    "{% endif %}"
    "{% for m in messages %}<|begin_header|>{{ m.role }}<|end_header|>{% if m.role == 'assistant' %}"
    "{% generation %}{{ m.content }}<|end_turn|>{% endgeneration %}{% else %}{{ m.content }}<|end_turn|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|begin_header|>assistant<|end_header|>{% endif %}")
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "the weather in a city", "parameters": CITY}}]
CHAT = [{"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "rain"}, {"role": "assistant", "content": "It rains."}]


def test_a_records_tools_reach_the_chat_template_as_trl_and_the_server_pass_them(model_dir, tmp_path):  # noqa: F811
    """OpenAI's fine-tuning format (and trl's `tools` column) gives a chat's tool definitions in the record's `tools`;
    SFT ignored the field, so a function-calling set was trained on prompts without the tools that `rdepth serve`
    (and transformers' `apply_chat_template(tools=...)`, which trl calls) renders: the model never saw them in
    training. Now they are the template's `tools` variable, a list or its JSON text (as trl reads a column)."""
    from transformers import AutoTokenizer

    directory = with_template(model_dir, tmp_path / "tools", TOOLS_TEMPLATE)
    encoder = ExampleEncoder(directory, rd.ModelConfig.from_json(directory / "config.json"))
    theirs = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        CHAT, tools=TOOLS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    served = TextCodec(directory, VOCAB).encode_chat(CHAT, TOOLS, add_generation_prompt=False)
    assert list(theirs["input_ids"]) == served
    for tools in (TOOLS, json.dumps(TOOLS)):
        example = encoder.encode(conversation({"messages": CHAT, "tools": tools}, "x:1"), "x:1")
        assert example.ids == served
        assert example.scored == [bool(m) for m in theirs["assistant_masks"]]
    # the conversational prompt/completion form: the prompt, tools included, is context
    record = {"prompt": CHAT[:3], "completion": CHAT[3:], "tools": TOOLS}
    example = encoder.encode(conversation(record, "x:2"), "x:2")
    answer = encoder.tokenizer.encode("It rains.<|end_turn|>", add_special_tokens=False).ids
    assert example.ids == served and example.ids[-len(answer):] == answer and sum(example.scored) == len(answer)
    # no tools (absent, null, empty) renders as before; bad tools are one line naming the record
    plain = encoder.encode(conversation({"messages": CHAT}, "x:3"), "x:3").ids
    assert plain == TextCodec(directory, VOCAB).encode_chat(CHAT, None, add_generation_prompt=False) != served
    for empty in (None, []):
        assert encoder.encode(conversation({"messages": CHAT, "tools": empty}, "x:4"), "x:4").ids == plain
    bad = {"{not json": r"^x:5: 'tools' is a string that is not JSON", "get_weather": "not JSON",
           json.dumps({"a": 1}): r"^x:5: 'tools' must be a list of tool objects .*got dict", 3: "got int"}
    for tools, message in bad.items():
        with pytest.raises(ValueError, match=message):
            conversation({"messages": CHAT, "tools": tools}, "x:5")
    # text prompt/completion is not templated: tools there would be dropped, so they are refused
    with pytest.raises(ValueError, match=r"^x:6: 'tools' needs a chat"):
        conversation({"prompt": "a", "completion": "b", "tools": TOOLS}, "x:6")


def test_a_number_too_long_for_python_is_a_one_line_error_naming_the_record(model_dir, tmp_path):  # noqa: F811
    """Python refuses to read an integer of over 4300 digits with a plain ValueError, not a JSONDecodeError, so a
    JSONL line holding one failed `rdepth sft` (and `rdepth prepare`'s JSONL reader) without its file and line, and a
    .json array without its file name."""
    encoder = ExampleEncoder(model_dir, rd.ModelConfig.from_json(model_dir / "config.json"))
    good = json.dumps({"prompt": "a", "completion": "b"})
    huge = '{"prompt": "a", "completion": "b", "id": 1' + "0" * 5000 + "}"
    lines = tmp_path / "data.jsonl"
    lines.write_text(f"{good}\n{huge}\n")
    with pytest.raises(ValueError, match=rf"^{lines}:2: JSON the parser cannot read \(Exceeds the limit"):
        load_examples(lines, encoder)
    array = tmp_path / "data.json"
    array.write_text(f"[{good}, {huge}]")
    with pytest.raises(ValueError, match=rf"^SFT data {array} is JSON the parser cannot read"):
        load_examples(array, encoder)
