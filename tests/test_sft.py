"""SFT: the assistant-only loss mask, packing without attention across examples, data errors, exact resume."""

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

import recurrent_depth as rd
from recurrent_depth.data.chat import ExampleEncoder, conversation, load_examples
from recurrent_depth.data.tokenizer import eos_token_ids, load_tokenizer, special_token_ids
from recurrent_depth.train.sft import IGNORE, pack_examples, sft_trainer
from tests.train_support import VOCAB, OneThread, prepare_root

SYSTEM_AND_USER = ("<|begin_text|><|begin_header|>system<|end_header|>\n\nBe brief.<|end_turn|>"
                   "<|begin_header|>user<|end_header|>\n\n2+2?<|end_turn|>")
OPEN_ANSWER = "<|begin_header|>Huginn<|end_header|>\n\n"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return prepare_root(tmp_path_factory.mktemp("sft_root"))


@pytest.fixture(scope="module")
def model_dir(root):
    """A tiny model directory with the synthetic corpus's tokenizer and chat template."""
    specials = special_token_ids(load_tokenizer(root / "tokenizer"))
    config = rd.ModelConfig.from_preset("tiny", vocab_size=VOCAB, max_seq_len=64, bos_token_id=specials["begin_text"],
                                        eos_token_id=eos_token_ids(specials), pad_token_id=specials["pad"])
    torch.manual_seed(3)
    rd.RecurrentDepthLM(config).save_pretrained(root / "model", tokenizer=root / "tokenizer")
    return root / "model"


@pytest.fixture(autouse=True)
def one_thread():
    with OneThread():
        yield


def encoder_for(model_dir):
    return ExampleEncoder(model_dir, rd.ModelConfig.from_json(model_dir / "config.json"))


def scored_runs(example, tokenizer):
    """(text, scored) of each run of consecutive tokens that do / do not carry loss."""
    runs, start = [], 0
    for i in range(1, len(example.ids) + 1):
        if i == len(example.ids) or example.scored[i] != example.scored[start]:
            runs.append((tokenizer.decode(example.ids[start:i], skip_special_tokens=False), example.scored[start]))
            start = i
    return runs


def test_only_the_assistant_answers_and_their_end_of_turn_carry_loss(model_dir):
    chat = {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+6?"},
        {"role": "assistant", "content": "9"}]}
    example = encoder_for(model_dir).encode(conversation(chat, "chat:1"), "chat:1")
    tokenizer = load_tokenizer(model_dir)
    assert scored_runs(example, tokenizer) == [
        (SYSTEM_AND_USER + OPEN_ANSWER, False),
        ("4<|end_turn|>", True),
        ("<|begin_header|>user<|end_header|>\n\n3+6?<|end_turn|>" + OPEN_ANSWER, False),
        ("9<|end_turn|>", True),
    ]
    # As rows: position t is scored when token t + 1 is, and predicts it.
    row = pack_examples([example], len(example.ids) - 1, pad_id=0)
    wanted = [t if s else IGNORE for t, s in zip(example.ids[1:], example.scored[1:], strict=True)]
    assert row.targets[0].tolist() == wanted and row.input_ids[0].tolist() == example.ids[:-1]


def test_prompt_completion_records_learn_the_completion_and_eos(model_dir):
    tokenizer, encoder = load_tokenizer(model_dir), encoder_for(model_dir)
    plain = encoder.encode(conversation({"prompt": "2+2=", "completion": "4"}, "x:1"), "x:1")
    assert scored_runs(plain, tokenizer) == [("<|begin_text|>2+2=", False), ("4<|end_text|>", True)]
    record = {"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]}
    chat = encoder.encode(conversation(record, "x:2"), "x:2")
    assert scored_runs(chat, tokenizer) == [
        ("<|begin_text|><|begin_header|>user<|end_header|>\n\n2+2?<|end_turn|>" + OPEN_ANSWER, False),
        ("4<|end_turn|>", True)]


def test_a_sentencepiece_style_tokenizer_starts_no_piece_but_the_first_with_its_space(tmp_path):
    """A Metaspace tokenizer (Llama-2, Mistral, TinyLlama) writes '▁' at the start of a text. Each piece tokenized
    alone got one: the answer `4` after `<|assistant|>\\n` was learned as `▁4`, the second user turn and a
    completion gained a space, none of which the server's tokens of the whole conversation hold."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    chars = ["<unk>", "<s>", "</s>", "▁", "\n", *"<|>abcdefghijklmnopqrstuvwxyz0123456789+=?"]
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(chars)}, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m.role + '|>\\n' + m.content + eos_token + '\\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")  # Zephyr's shape
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                                 "chat_template": template}))
    encoder = ExampleEncoder(tmp_path, rd.ModelConfig.from_preset("tiny", vocab_size=64, bos_token_id=1,
                                                                  eos_token_id=2))
    chat = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                         {"role": "user", "content": "3+6?"}, {"role": "assistant", "content": "9"}]}
    example = encoder.encode(conversation(chat, "x:1"), "x:1")
    whole = "<s><|user|>\n2+2?</s>\n<|assistant|>\n4</s>\n<|user|>\n3+6?</s>\n<|assistant|>\n9</s>\n"
    assert example.ids == tok.encode(whole, add_special_tokens=False).ids  # what the server would encode
    assert [tok.decode([i], skip_special_tokens=False) for i, s in zip(example.ids, example.scored) if s] == \
        ["4", "</s>", "\n", "9", "</s>", "\n"]
    plain = encoder.encode(conversation({"prompt": "2+2=", "completion": "4"}, "x:2"), "x:2")
    assert plain.ids == [1, *tok.encode("2+2=4", add_special_tokens=False).ids, 2]
    assert plain.scored == [False] * 6 + [True, True]  # bos ▁ 2 + 2 =, then 4 and eos

def test_prompt_completion_without_an_eos_token_is_refused_not_trained_without_an_end(model_dir):
    config = rd.ModelConfig.from_json(model_dir / "config.json")
    encoder = ExampleEncoder(model_dir, dataclasses.replace(config, eos_token_id=None))
    with pytest.raises(ValueError, match=r"^x:3: a prompt/completion record needs the model's eos_token_id"):
        encoder.encode(conversation({"prompt": "2+2=", "completion": "4"}, "x:3"), "x:3")
    chat = encoder.encode(conversation({"messages": [{"role": "user", "content": "2+2?"},
                                                     {"role": "assistant", "content": "4"}]}, "x:4"), "x:4")
    assert any(chat.scored)  # a chat's end of turn comes from its template


# The chat template of tomg-group-umd/huginn-0125 (its tokenizer_config.json): each answer inside {% generation %},
# and `<|end_text|>` after the last message when no generation prompt is asked.
OFFICIAL_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set start_content = '<|begin_header|>' %}"
    "{% set end_content = message['content'] | trim  + '<|end_turn|>' %}{% if loop.index0 == 0 %}"
    "{% set start_content = bos_token + start_content %}{% endif %}"
    "{% if message['role'] == 'Huginn' or message['role'] == 'assistant' %}"
    "{% set start_content = start_content + 'Huginn<|end_header|>\\n\\n' %}{{ start_content }}"
    "{% generation %}{{ end_content }}{% endgeneration %}{% else %}"
    "{% set start_content = start_content + message['role'] + '<|end_header|>\\n\\n' %}{{ start_content }}"
    "{{ end_content }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|begin_header|>Huginn<|end_header|>\\n\\n' }}{% else %}{{ '<|end_text|>' }}{% endif %}")
TWO_ANSWERS = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": " 4 "},
               {"role": "user", "content": "3+6?"}, {"role": "assistant", "content": "9"}]


def with_template(model_dir, directory, template):
    """A copy of `model_dir` whose tokenizer_config.json holds `template` (as the official checkpoint's does)."""
    import shutil

    shutil.copytree(model_dir, directory)
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return directory


def test_the_official_huginn_template_learns_what_its_generation_blocks_mark(model_dir, tmp_path):
    """Its closing `<|end_text|>` makes no render a prefix of the next, and `rdepth sft` refused the template
    ("does not render a conversation as a prefix of its continuation"). Its {% generation %} blocks decide now:
    the learned tokens are transformers' assistant mask, each answer with its `<|end_turn|>` and nothing else."""
    from transformers import AutoTokenizer

    only_last = OFFICIAL_TEMPLATE.replace("{% generation %}{{ end_content }}{% endgeneration %}",
                                          "{% if loop.last %}{% generation %}{{ end_content }}{% endgeneration %}"
                                          "{% else %}{{ end_content }}{% endif %}")  # (the first answer unmarked)
    cases = {OFFICIAL_TEMPLATE: "4<|end_turn|>9<|end_turn|>", only_last: "9<|end_turn|>"}
    tokenizer = load_tokenizer(model_dir)
    for i, (template, learned) in enumerate(cases.items()):
        directory = with_template(model_dir, tmp_path / str(i), template)
        example = encoder_for(directory).encode(conversation({"messages": TWO_ANSWERS}, "x:1"), "x:1")
        assert tokenizer.decode([t for t, s in zip(example.ids, example.scored) if s], skip_special_tokens=False) \
            == learned
        theirs = AutoTokenizer.from_pretrained(directory).apply_chat_template(
            TWO_ANSWERS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert example.ids == theirs["input_ids"] and example.scored == [bool(m) for m in theirs["assistant_masks"]]
    # a conversational prompt/completion record: only the blocks of the completion are learned
    record = {"prompt": TWO_ANSWERS[:3], "completion": TWO_ANSWERS[3:]}
    example = encoder_for(tmp_path / "0").encode(conversation(record, "x:2"), "x:2")
    assert [run for run in scored_runs(example, tokenizer) if run[1]] == [("9<|end_turn|>", True)]


def test_generation_blocks_that_mark_nothing_or_cannot_be_placed_are_one_line_errors(model_dir, tmp_path):
    """An empty block marks nothing (transformers' empty span); blocks that mark no text at all are refused, as trl
    refuses an example without assistant tokens, not trained on silently. A block whose text is rendered away from
    where it lands (inside a macro or another block) is refused: transformers marks other characters there. A
    template that does not compile (an unterminated block) was a jinja TemplateSyntaxError: a traceback from
    `rdepth sft`, not its one-line error."""
    tokenizer = load_tokenizer(model_dir)
    answer = "{% generation %}{{ m.content }}{% endgeneration %}"

    def loop(assistant: str) -> str:  # a template that renders each assistant message with `assistant`
        return ("{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}" + assistant
                + "{% else %}{{ m.content }}{% endif %}\n{% endfor %}")

    empty_first = loop("{% if loop.index0 == 1 %}{% generation %}{% endgeneration %}{{ m.content }}"
                       "{% else %}" + answer + "{% endif %}")
    example = encoder_for(with_template(model_dir, tmp_path / "empty", empty_first)).encode(
        conversation({"messages": TWO_ANSWERS}, "x:1"), "x:1")
    assert [run for run in scored_runs(example, tokenizer) if run[1]] == [("9", True)]
    refused = {
        "all_empty": (loop("{% generation %}{% endgeneration %}{{ m.content }}"),
                      r"^x:1: the chat template's \{% generation %\} blocks mark no text of this record's assistant"),
        "macro": ("{% macro say(m) %}<{% generation %}{{ m.content }}{% endgeneration %}>{% endmacro %}"
                  + loop("{{ say(m) }}"), r"^x:1: the chat template failed on this record: a \{% generation "
                                          r"%\} block renders inside a macro"),
        "nested": (loop("{% generation %}[{% generation %}{{ m.content }}{% endgeneration %}]{% endgeneration %}"),
                   r"^x:1: .* block renders inside .*another generation block"),
    }
    for name, (template, message) in refused.items():
        encoder = encoder_for(with_template(model_dir, tmp_path / name, template))
        with pytest.raises(ValueError, match=message) as error:
            encoder.encode(conversation({"messages": TWO_ANSWERS}, "x:1"), "x:1")
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"^the chat template of .* does not compile: .*looking for "
                                         r"'endgeneration'.* \(line 1\)$") as error:
        encoder_for(with_template(model_dir, tmp_path / "open", loop("{% generation %}{{ m.content }}")))
    assert "\n" not in str(error.value)


def test_bad_records_are_one_line_errors_naming_file_and_line(model_dir, tmp_path):
    encoder = encoder_for(model_dir)
    good = json.dumps({"prompt": "a", "completion": "b"})
    cases = {
        "{not json": "not valid JSON",
        '{"prompt": "a"': r"not valid JSON \(Expecting ',' delimiter at column 15\)",  # (not "line 2 column 1")
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}): "no assistant message",
        json.dumps({"messages": [{"role": "user"}]}): r"messages\[0\] must be an object with string 'role'",
        # a typo'd role was trained on as a turn of its own (or left its answer unlearned), silently
        json.dumps({"messages": [{"role": "usr", "content": "hi"}, {"role": "assistant", "content": "b"}]}):
            r"messages\[0\]\.role='usr' is not a chat role: expected one of \['system', 'developer', 'user', ",
        json.dumps({"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "Assistant",
                                                                                  "content": "b"}]}):
            r"completion\[0\]\.role='Assistant' is not a chat role",
        json.dumps({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]},
                                 {"role": "assistant", "content": "b"}]}):
            r"messages\[0\]\.content\[0\] is a part of type 'input_audio', but the model reads text only",
        json.dumps({"text": "x"}): "expected 'messages'",
        json.dumps({"prompt": "a", "completion": ["b"]}): "'prompt' and 'completion' must both be strings",
    }
    for line, message in cases.items():
        path = tmp_path / "data.jsonl"
        path.write_text(f"{good}\n\n{line}\n")
        with pytest.raises(ValueError, match=f"^{path}:3: {message}"):
            load_examples(path, encoder)
    path.write_bytes(b"\xff\xfe{}\n")  # json.loads(bytes) guessed UTF-16 and named that codec
    with pytest.raises(ValueError, match=f"^{path}:1: not valid UTF-8 \\(byte 0xff at byte 1 of the line\\)$"):
        load_examples(path, encoder)


@pytest.mark.parametrize("content,words", [
    ([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], None),
    ([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 99}}],
     "messages[0].content[1] is a part of type 'image_url', but the model reads text only"),
    ([{"text": "a"}], "messages[0].content[0] has no string 'type'"),
    ({"type": "text", "text": "a"}, "messages[0].content must be a string, null or a list of text parts, got dict"),
])
def test_content_parts_read_the_same_in_sft_and_the_server(content, words):
    """A list of text parts was joined with no separator by the server ("a" + "b" -> "ab") and refused by
    `rdepth sft`; both now read it as the texts joined by a newline (vLLM's and llama.cpp's reading), and
    refuse a non-text part with the same one-line error naming its type (the server's is a 400)."""
    from recurrent_depth.serving.protocol import APIError, Limits, parse_chat

    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": "c"}]
    if words is None:
        served = parse_chat({"messages": messages}, Limits(4096, 4, 300), {"m"}).messages
        assert served == conversation({"messages": messages}, "x:1").messages
        assert served[0]["content"] == "a\nb"
        return
    with pytest.raises(APIError) as info:
        parse_chat({"messages": messages}, Limits(4096, 4, 300), {"m"})
    assert (info.value.status, info.value.param) == (400, "messages")
    assert str(info.value).startswith(words) and "\n" not in str(info.value) and "AAAA" not in str(info.value)
    with pytest.raises(ValueError) as sft:
        conversation({"messages": messages}, "x:1")
    assert str(sft.value) == f"x:1: {info.value}"


def test_a_local_parquet_file_reads_as_jsonl_does(model_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "data.parquet")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    encoder = encoder_for(model_dir)
    assert load_examples(tmp_path / "data.parquet", encoder) == load_examples(tmp_path / "data.jsonl", encoder)


def test_csv_and_json_arrays_keep_numeric_looking_text_as_text(model_dir, tmp_path):
    """`28`, `0.50` and `NA` are answers, not numbers or missing values; a .json array may mix record kinds."""
    records = [{"prompt": "26+2=", "completion": "28"}, {"prompt": "half=", "completion": "0.50"},
               {"prompt": "n/a?", "completion": "NA"}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "data.csv").write_text("prompt,completion\n26+2=,28\nhalf=,0.50\nn/a?,NA\n")
    encoder = encoder_for(model_dir)
    expected = load_examples(tmp_path / "data.jsonl", encoder)
    assert load_examples(tmp_path / "data.csv", encoder) == expected
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "1"}]}
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [chat, *records]))
    (tmp_path / "mixed.json").write_text(json.dumps([chat, *records]))
    assert load_examples(tmp_path / "mixed.json", encoder) == load_examples(tmp_path / "mixed.jsonl", encoder)
    (tmp_path / "bad.json").write_text(json.dumps([chat, {"prompt": "a"}]))
    with pytest.raises(ValueError, match="bad.json:record 2: "):
        load_examples(tmp_path / "bad.json", encoder)


def test_message_fields_other_than_role_and_content_reach_the_chat_template(model_dir, tmp_path):
    """A template that renders a tool message's `name` (or an assistant's `tool_calls`) got messages cut down to
    role and content: the tool call and the tool's name were left out of the text trained on, silently. A field
    that is null (a datasets table fills missing fields with None) is left out, as if absent."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    shutil.copytree(model_dir, tmp_path / "model")
    (tmp_path / "model" / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.role }}{% if 'name' in m %}({{ m.name }}){% endif %}: {{ m.content }}"
        "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}")
    chat = {"messages": [{"role": "user", "content": "6*7?"},
                         {"role": "assistant", "content": "", "tool_calls": [{"name": "mul", "arguments": [6, 7]}]},
                         {"role": "tool", "name": "mul", "content": "42"}, {"role": "assistant", "content": "42"}]}
    encoder, tokenizer = encoder_for(tmp_path / "model"), load_tokenizer(model_dir)
    runs = scored_runs(encoder.encode(conversation(chat, "x:1"), "x:1"), tokenizer)
    assert runs == [("user: 6*7?\nassistant: ", False), ('[{"name": "mul", "arguments": [6, 7]}]\n', True),
                    ("tool(mul): 42\nassistant: ", False), ("42\n", True)]
    pq.write_table(pa.Table.from_pylist([chat]), tmp_path / "chat.parquet")  # (user: name None, tool_calls None)
    assert load_examples(tmp_path / "chat.parquet", encoder) == [encoder.encode(conversation(chat, "x:1"), "x:1")]


def test_a_null_content_is_empty_text_as_the_server_takes_it(model_dir):
    """OpenAI's assistant turn of tool calls only has `content: null`: SFT refused the record (a template would
    have rendered the text 'None'); it is empty text now, as /v1/chat/completions reads it."""
    from recurrent_depth.serving.protocol import Limits, parse_chat

    call = [{"id": "c1", "type": "function", "function": {"name": "mul", "arguments": "[6, 7]"}}]
    null, empty = ({"messages": [{"role": "user", "content": "6*7?"},
                                 {"role": "assistant", "content": content, "tool_calls": call},
                                 {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}]}
                   for content in (None, ""))
    encoder, tokenizer = encoder_for(model_dir), load_tokenizer(model_dir)
    example = encoder.encode(conversation(null, "x:1"), "x:1")
    assert example == encoder.encode(conversation(empty, "x:1"), "x:1")
    assert "None" not in tokenizer.decode(example.ids, skip_special_tokens=False)
    assert scored_runs(example, tokenizer)[1] == ("<|end_turn|>", True)  # (the empty turn's end is learned)
    served = parse_chat(null, Limits(4096, 4, 300), {"m"}).messages
    assert served[1] == {"role": "assistant", "content": "", "tool_calls": call}  # (the fields reach the template)
    with pytest.raises(ValueError, match=r"x:1: messages\[0\]\.content must be a string, null or a list of text parts"):
        conversation({"messages": [{"role": "user", "content": 7}]}, "x:1")


def test_a_packed_row_gives_each_example_its_loss_and_gradient_alone(tiny_model):
    """Three examples and padding in one row: per-example losses and the gradient of their sum equal those
    of each example run alone from the same initial state (truncated backprop included)."""
    from recurrent_depth.data.chat import Example

    model = tiny_model.train()
    gen = torch.Generator().manual_seed(0)
    examples = []
    for n in (5, 9, 7):
        ids = torch.randint(0, 256, (n,), generator=gen).tolist()
        examples.append(Example(ids, [i >= 2 for i in range(n)]))
    rows = pack_examples(examples, 20, pad_id=0)
    assert len(rows) == 1 and rows.document_ids[0].tolist() == [0] * 4 + [1] * 8 + [2] * 6 + [-1] * 2
    assert rows.position_ids[0].tolist() == [*range(4), *range(8), *range(6), 0, 1]
    s0 = torch.randn(1, 20, model.config.hidden_size, generator=gen)

    out = model(rows.input_ids, (1, 2), position_ids=rows.position_ids, document_ids=rows.document_ids,
                input_states=s0)
    token_loss = F.cross_entropy(out.logits[0], rows.targets[0], reduction="none")
    packed = [token_loss[rows.document_ids[0] == d].sum() / (rows.targets[0][rows.document_ids[0] == d] != IGNORE).sum()
              for d in range(3)]
    sum(packed).backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    alone, start = [], 0
    for d in range(3):
        span = rows.document_ids[0] == d
        inputs, targets = rows.input_ids[:, span], rows.targets[:, span]
        end = start + inputs.shape[1]
        logits = model(inputs, (1, 2), input_states=s0[:, start:end]).logits
        alone.append(F.cross_entropy(logits[0], targets[0]))
        start = end
    sum(alone).backward()
    torch.testing.assert_close(torch.stack(packed), torch.stack(alone), rtol=1e-5, atol=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_one_example_per_row_needs_no_mask_and_other_mixers_are_told_to_use_it(tiny_config):
    from recurrent_depth.data.chat import Example

    rows = pack_examples([Example([1, 2, 3], [False, True, True]), Example([4, 5], [False, True])], 4, 0,
                         packing=False)
    assert set(rows.batch(torch.arange(2))) == {"input_ids", "targets"}
    assert rows.targets.tolist() == [[2, 3, IGNORE, IGNORE], [5, IGNORE, IGNORE, IGNORE]]
    linear = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", mixer={"core": "gated_deltanet"}))
    with pytest.raises(ValueError, match="the core uses mixer 'gated_deltanet'.*--no-packing"):
        linear(rows.input_ids, 1, document_ids=torch.zeros_like(rows.input_ids))


def write_chats(path, count=48, seed=0):
    """Sums as chats and products as prompt/completion pairs, alternately."""
    rng = random.Random(seed)
    pairs = [(rng.randint(0, 99), rng.randint(0, 99)) for _ in range(count)]
    records = [{"messages": [{"role": "user", "content": f"{a}+{b}?"}, {"role": "assistant", "content": str(a + b)}]}
               if i % 2 else {"prompt": f"{a}*{b}=", "completion": str(a * b)} for i, (a, b) in enumerate(pairs)]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def test_val_fraction_beside_a_val_data_file_is_refused_not_ignored(model_dir, tmp_path, capsys):
    """--val-data replaces the held-out share of --data: a --val-fraction given with it was accepted and ignored."""
    from recurrent_depth.cli import main

    write_chats(tmp_path / "chats.jsonl", count=4)
    argv = ["sft", "--init-from", str(model_dir), "--data", str(tmp_path / "chats.jsonl"), "--out", str(tmp_path / "r"),
            "--val-data", str(tmp_path / "chats.jsonl"), "--val-fraction", "0.5"]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "rdepth sft: error: --val-fraction and --val-data: the held-out examples are --val-data's, so no share of "
        "--data is held out; drop one of them")
    assert not (tmp_path / "r").exists()
    (tmp_path / "run.yaml").write_text("val_fraction: 0.5\n")  # the same in a --config file was ignored
    assert main([*argv[:-2], "--config", str(tmp_path / "run.yaml")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"rdepth sft: error: val_fraction in --config {tmp_path / 'run.yaml'} and --val-data: the held-out examples "
        "are --val-data's, so no share of --data is held out; drop one of them")
    assert not (tmp_path / "r").exists()
    (tmp_path / "run.yaml").write_text("baseline: true\nvocab_size: 512\n")  # (no flags: silently ignored)
    assert main([*argv[:-4], "--config", str(tmp_path / "run.yaml")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"rdepth sft: error: vocab_size, baseline in --config {tmp_path / 'run.yaml'}: pretraining settings that "
        "rdepth sft does not use (it reads --data's examples with the --init-from model's tokenizer); remove them")
    assert not (tmp_path / "r").exists()


def test_a_model_directory_without_a_tokenizer_is_not_told_to_pass_a_flag_sft_lacks(model_dir, tmp_path, capsys):
    """The error named --tokenizer, which `rdepth sft` refuses as an unrecognized argument."""
    import shutil

    from recurrent_depth.cli import main

    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, bare / name)
    write_chats(tmp_path / "chats.jsonl", count=4)
    assert main(["sft", "--init-from", str(bare), "--data", str(tmp_path / "chats.jsonl"),
                 "--out", str(tmp_path / "r")]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"rdepth sft: error: {bare} holds no tokenizer.json: copy the model's tokenizer files")
    assert "`rdepth sft` and `rdepth rl` read it from" in line


def read_metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sft_trains_evaluates_by_depth_and_refuses_to_resume_on_other_rows(model_dir, tmp_path):
    from recurrent_depth.cli import build_parser
    from recurrent_depth.cli.train import config_from_args

    data = write_chats(tmp_path / "chats.jsonl")
    flags = ["sft", "--init-from", str(model_dir), "--data", str(data), "--seq-len", "32", "--batch-size", "4",
             "--max-steps", "3", "--save-every", "3", "--eval-depths", "1,4", "--eval-batches", "1",
             "--no-tensorboard", "--no-progress", "--out", str(tmp_path / "run")]
    result = sft_trainer(config_from_args(build_parser("sft").parse_args(flags))).run()
    assert len(result.losses) == 3 and set(result.final_eval.loss) == {1, 4}
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["data"]["source"] == "sft" and run["data"]["packing"] and run["data"]["train"]["examples"] == 47
    # the start recorded for --resume (`check_same_start`), as `train --init-from` and `rl` record it
    assert run["start"]["directory"] == str(model_dir.resolve()) and len(run["start"]["identity"]) == 64
    assert all(m["scored_tokens"] > 0 for m in read_metrics(tmp_path / "run"))
    assert rd.RecurrentDepthLM.from_pretrained(tmp_path / "run" / "model").config.vocab_size == VOCAB
    resume = build_parser("sft").parse_args([*flags, "--resume", "--max-steps", "4", "--no-packing"])
    with pytest.raises(ValueError, match="cannot resume: the SFT rows differ"):
        sft_trainer(config_from_args(resume), sft_options(resume))


def sft_options(args):
    from recurrent_depth.train.sft import SFTOptions

    return SFTOptions(val_data=args.val_data, packing=args.packing)


@pytest.mark.slow
def test_resume_after_kill_9_continues_the_same_sft_trajectory(model_dir, tmp_path):
    """A real `rdepth sft` killed with SIGKILL mid-run and resumed ends with the losses of the same command
    run straight through (in-process, from the same parsed flags)."""
    from recurrent_depth.cli import build_parser
    from recurrent_depth.cli.train import config_from_args

    data = write_chats(tmp_path / "chats.jsonl")

    def flags(out, *extra):
        return ["sft", "--init-from", str(model_dir), "--data", str(data), "--seq-len", "32", "--batch-size", "4",
                "--max-steps", "12", "--save-every", "3", "--eval-depths", "1", "--eval-batches", "1",
                "--no-tensorboard", "--no-progress", "--out", str(out), *extra]

    args = build_parser("sft").parse_args(flags(tmp_path / "straight"))
    straight = sft_trainer(config_from_args(args), sft_options(args)).run()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "recurrent_depth.cli", *flags(tmp_path / "killed"), "--threads", "1"]
    victim = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and victim.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            break
        time.sleep(0.01)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert len(metrics.read_text().splitlines()) < 12, "the run finished before it could be killed"
    subprocess.run([*command, "--resume"], check=True, env=env, capture_output=True)
    killed = read_metrics(tmp_path / "killed")
    assert [m["loss"] for m in killed] == straight.losses and len(straight.losses) == 12
    assert [m["epoch"] for m in killed] == [m["epoch"] for m in read_metrics(tmp_path / "straight")]



def test_heldout_loss_on_packed_rows_is_the_token_mean_of_each_example_alone():
    """With s0 = 0 (init_scale 0) the held-out loss of packed rows is exactly the loss of the examples run
    one by one, at every depth: the evaluation keeps the training masks."""
    from recurrent_depth.data.chat import Example
    from recurrent_depth.train.sft import heldout_loss_by_depth

    torch.manual_seed(5)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", init_scale=0.0))
    gen = torch.Generator().manual_seed(1)
    examples = [Example(torch.randint(0, 256, (n,), generator=gen).tolist(), [i % 3 != 0 for i in range(n)])
                for n in (6, 11, 4, 9, 7)]
    rows = pack_examples(examples, 16, pad_id=0)
    assert len(rows) == 3
    result = heldout_loss_by_depth(model, rows, [1, 3], batch_size=2, max_batches=8)
    for depth in (1, 3):
        total, count = 0.0, 0
        for ex in examples:
            targets = torch.tensor([t if s else IGNORE for t, s in zip(ex.ids[1:], ex.scored[1:], strict=True)])
            with torch.no_grad():
                logits = model.eval()(torch.tensor([ex.ids[:-1]]), depth).logits[0]
            total += float(F.cross_entropy(logits, targets, reduction="sum"))
            count += int((targets != IGNORE).sum())
        assert result.tokens == count
        assert result.loss[depth] == pytest.approx(total / count, rel=1e-5)
    # a final evaluation past the run's --max-minutes budget is cut to its first batch (it was never cut)
    first = heldout_loss_by_depth(model, rows, [1, 3], batch_size=2, max_batches=1)
    cut = heldout_loss_by_depth(model, rows, [1, 3], batch_size=2, max_batches=8, deadline=0.0)
    assert cut.tokens == first.tokens < result.tokens and cut.loss == first.loss


def test_heldout_loss_does_not_depend_on_how_the_rows_are_batched():
    """One s0 draw per batch gave the same packed rows (same model, same seed) another loss at each batch size."""
    from recurrent_depth.data.chat import Example
    from recurrent_depth.train.sft import heldout_loss_by_depth

    torch.manual_seed(5)
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny"))
    gen = torch.Generator().manual_seed(1)
    examples = [Example(torch.randint(0, 256, (n,), generator=gen).tolist(), [i % 3 != 0 for i in range(n)])
                for n in (14, 11, 13, 9, 15, 12)]
    rows = pack_examples(examples, 16, pad_id=0)
    runs = [heldout_loss_by_depth(model, rows, [1, 3], batch_size=size, max_batches=8, seed=3) for size in (1, 2, 6)]
    for run in runs[1:]:
        assert run.tokens == runs[0].tokens
        for d in (1, 3):
            assert run.loss[d] == pytest.approx(runs[0].loss[d], rel=1e-6, abs=0)
    other = heldout_loss_by_depth(model, rows, [1], batch_size=2, max_batches=8, seed=4)
    assert other.loss[1] != pytest.approx(runs[0].loss[1], rel=1e-6, abs=0)  # the seed still draws the starts


def test_sft_with_lora_trains_only_an_adapter_that_loads_onto_its_start(model_dir, tmp_path):
    """`rdepth sft --lora`: the base weights stay as DIR's, `model/` is a peft adapter of DIR."""
    from recurrent_depth.cli import main
    from recurrent_depth.train.lora import load_adapter_model

    data = write_chats(tmp_path / "chats.jsonl")
    assert main(["sft", "--init-from", str(model_dir), "--data", str(data), "--seq-len", "32", "--batch-size", "4",
                 "--max-steps", "2", "--eval-depths", "1", "--eval-batches", "1", "--no-tensorboard", "--no-progress",
                 "--threads", "1", "--lora", "--lora-rank", "2", "--lora-parts", "core",
                 "--out", str(tmp_path / "run")]) == 0
    adapter = tmp_path / "run" / "model"
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 2
    base = rd.RecurrentDepthLM.from_pretrained(model_dir)
    merged = load_adapter_model(adapter, merge=True)
    changed = [k for k, v in merged.state_dict().items() if not torch.equal(v, base.state_dict()[k])]
    assert changed and all(".core_block." in k for k in changed)


def test_a_resume_under_a_token_budget_keeps_the_cool_down_of_the_straight_run(model_dir, tmp_path):
    """The rows' tokens per step are measured per step for SFT; a resumed run knows them from its checkpoint,
    so its first step is already on the cool-down a token budget plans (it ran at the full lr)."""
    from recurrent_depth.train.config import TrainConfig
    from recurrent_depth.train.optim import OptimConfig

    data = write_chats(tmp_path / "chats.jsonl", count=24)

    def config(out, **extra):
        return TrainConfig(init_from=str(model_dir), data=str(data), seq_len=32, batch_size=2, max_tokens=6 * 64,
                           save_every=2, eval_depths=[1], eval_batches=1, progress=False, tensorboard=False,
                           out=str(out), optim=OptimConfig(name="adamw", lr=1e-3, cooldown_fraction=0.5), **extra)

    straight = sft_trainer(config(tmp_path / "straight")).run()
    sft_trainer(config(tmp_path / "cut"), stop_when=lambda t: "cut" if t.state.step >= 4 else None).run()
    resumed = sft_trainer(config(tmp_path / "cut", resume=True)).run()
    assert resumed.steps == straight.steps == 6
    lrs = [m["lr"] for m in read_metrics(tmp_path / "straight")]
    assert [m["lr"] for m in read_metrics(tmp_path / "cut")] == lrs and lrs[4] < lrs[0]
    assert [m["loss"] for m in read_metrics(tmp_path / "cut")] == straight.losses


def test_scored_tokens_count_every_micro_batch_of_a_step(model_dir, tmp_path):
    """With --grad-accum 2 a step's record held the last micro-batch's scored_tokens only (half the step's)."""
    from recurrent_depth.cli import build_parser
    from recurrent_depth.cli.train import config_from_args

    data = write_chats(tmp_path / "chats.jsonl")
    counts = []
    for batch, accum in ((8, 1), (4, 2)):
        flags = ["sft", "--init-from", str(model_dir), "--data", str(data), "--seq-len", "32", "--batch-size",
                 str(batch), "--grad-accum", str(accum), "--max-steps", "1", "--eval-depths", "1", "--eval-batches",
                 "1", "--no-tensorboard", "--no-progress", "--out", str(tmp_path / f"run{accum}")]
        sft_trainer(config_from_args(build_parser("sft").parse_args(flags))).run()
        counts.append(read_metrics(tmp_path / f"run{accum}")[0]["scored_tokens"])
    assert counts[0] == counts[1] > 0  # the same 8 rows, in one micro-batch or two
