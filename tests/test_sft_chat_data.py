"""SFT chat data as users bring it: special-token text inside messages, OpenAI's per-message `weight`, empty answers."""

import json

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.data.chat import ExampleEncoder, conversation, load_examples
from recurrent_depth.data.tokenizer import eos_token_ids, load_tokenizer, special_token_ids
from recurrent_depth.serving.text import TextCodec
from tests.test_sft import OFFICIAL_TEMPLATE, scored_runs, with_template
from tests.train_support import VOCAB, OneThread, prepare_root


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model directory with the synthetic corpus's tokenizer and chat template (generation blocks)."""
    root = prepare_root(tmp_path_factory.mktemp("sft_chat_root"))
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


def test_special_token_text_in_a_message_is_plain_text_as_the_server_reads_it(model_dir):
    """`rdepth serve` reads `<|end_text|>` inside a message as plain text (a message cannot forge a turn); SFT parsed
    it as the special token, so an answer holding it taught the model to emit an eos mid-answer, and a user message
    holding `<|end_turn|>` was trained as a closed turn, neither of which the server's prompts ever hold."""
    messages = [{"role": "user", "content": "say <|end_turn|> now"},
                {"role": "assistant", "content": "ok <|end_text|> done"},
                {"role": "user", "content": "and <|begin_header|>?"}, {"role": "assistant", "content": "9"}]
    encoder = encoder_for(model_dir)
    codec = TextCodec(model_dir, VOCAB)
    example = encoder.encode(conversation({"messages": messages}, "x:1"), "x:1")
    assert example.ids == codec.encode_chat(messages, add_generation_prompt=False)
    prompt = codec.encode_chat(messages[:1], add_generation_prompt=True)  # what the server asks the first answer with
    assert example.ids[: len(prompt)] == prompt and not any(example.scored[: len(prompt)])
    tokenizer = load_tokenizer(model_dir)
    end_text = tokenizer.token_to_id("<|end_text|>")
    assert end_text not in example.ids
    assert [text for text, learned in scored_runs(example, tokenizer) if learned] == [
        "ok <|end_text|> done<|end_turn|>", "9<|end_turn|>"]
    # a message without special-token text is tokenized as before: the rendered chat whole
    plain = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert encoder.encode(conversation({"messages": plain}, "x:2"), "x:2").ids == codec.encode_chat(plain, None, False)
    # the server's placeholder characters are refused, as the server refuses them
    bad = [{"role": "user", "content": "a\ufdd0b"}, {"role": "assistant", "content": "c"}]
    with pytest.raises(ValueError, match=r"^x:3: messages\[0\]\.content holds the Unicode noncharacter U\+FDD0"):
        encoder.encode(conversation({"messages": bad}, "x:3"), "x:3")
    # prompt/completion text is not templated and reads as /v1/completions reads a prompt: special tokens parsed
    text = encoder.encode(conversation({"prompt": "a<|end_turn|>", "completion": "b"}, "x:4"), "x:4")
    assert tokenizer.token_to_id("<|end_turn|>") in text.ids


NO_BLOCKS = ("{% for m in messages %}<|begin_header|>{{ m.role }}<|end_header|>{{ m.content }}<|end_turn|>{% endfor %}"
             "{% if add_generation_prompt %}<|begin_header|>assistant<|end_header|>{% endif %}")
HEADER_IN_BLOCK = ("{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}"
                   "<|begin_header|>a<|end_header|>{{ m.content }}<|end_turn|>{% endgeneration %}{% else %}"
                   "<|begin_header|>{{ m.role }}<|end_header|>{{ m.content }}<|end_turn|>{% endif %}{% endfor %}"
                   "{% if add_generation_prompt %}<|begin_header|>a<|end_header|>{% endif %}")


@pytest.mark.parametrize("template", [None, OFFICIAL_TEMPLATE, NO_BLOCKS, HEADER_IN_BLOCK],
                         ids=["ours", "official", "no_blocks", "header_in_block"])
def test_an_assistant_message_of_weight_0_is_context_not_learned(model_dir, tmp_path, template):
    """OpenAI's fine-tuning format marks an assistant message not to learn with `"weight": 0`; SFT learned it anyway
    (and handed `weight` to the template). Now it is context: the same tokens, its answer unscored, the others
    scored as without it, whichever way the template marks answers."""
    directory = model_dir if template is None else with_template(model_dir, tmp_path / "model", template)
    encoder, tokenizer = encoder_for(directory), load_tokenizer(model_dir)
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "five"},
                {"role": "assistant", "content": "no, 4"}, {"role": "user", "content": "3+6?"},
                {"role": "assistant", "content": "9"}]
    whole = encoder.encode(conversation({"messages": messages}, "x:1"), "x:1")
    answers = [text for text, learned in scored_runs(whole, tokenizer) if learned]
    # every answer's learned text, in order (adjacent answers form one run)
    per_answer = "".join(answers)
    for index, content in ((1, "five"), (2, "no, 4"), (4, "9")):
        weighted = [dict(m, weight=0) if i == index else dict(m, weight=1) if m["role"] == "assistant" else m
                    for i, m in enumerate(messages)]
        example = encoder.encode(conversation({"messages": weighted}, "x:1"), "x:1")
        assert example.ids == whole.ids
        learned = "".join(text for text, scored in scored_runs(example, tokenizer) if scored)
        start = per_answer.index(content)
        end = per_answer.index("<|end_turn|>", start) + len("<|end_turn|>")
        begin = per_answer.rfind("<|end_turn|>", 0, start)  # (a header inside a block belongs to its answer)
        begin = 0 if begin < 0 else begin + len("<|end_turn|>")
        assert learned == per_answer[:begin] + per_answer[end:], (index, learned)
    with pytest.raises(ValueError, match=r"^x:1: no assistant message to learn"):
        conversation({"messages": [messages[0], dict(messages[1], weight=0)]}, "x:1")


def test_weight_reaches_no_template_and_bad_weights_are_one_line_errors(model_dir, tmp_path):
    directory = with_template(model_dir, tmp_path / "model", "{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
                                                              "{% if add_generation_prompt %}{% endif %}")
    encoder = encoder_for(directory)
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "weight": 1}]}
    example = encoder.encode(conversation(chat, "x:1"), "x:1")
    assert "weight" not in load_tokenizer(directory).decode(example.ids, skip_special_tokens=False)
    for message, value in (({"role": "assistant", "content": "b", "weight": 0.5}, "0.5"),
                           ({"role": "assistant", "content": "b", "weight": True}, "True"),
                           ({"role": "assistant", "content": "b", "weight": "0"}, "'0'"),
                           ({"role": "user", "content": "b", "weight": 1}, "1")):
        record = {"messages": [{"role": "user", "content": "a"}, message, {"role": "assistant", "content": "c"}]}
        with pytest.raises(ValueError, match=rf"^x:2: messages\[1\]\.weight={value}: a weight is 0 \(not learned\) "
                                             r"or 1 \(learned\), on assistant messages only$"):
            conversation(record, "x:2")


def test_an_empty_answer_is_a_one_line_error_naming_the_record(model_dir, tmp_path):
    """An answer of no text taught the model to end its turn at once: only the end-of-turn marker was learned
    (a failed generation in the data, trained on silently). A tool-calling turn, or one of weight 0, stays valid."""
    encoder = encoder_for(model_dir)
    user = {"role": "user", "content": "hi"}
    for answer in ("", "  \n", None, [{"type": "text", "text": ""}]):
        path = tmp_path / "data.jsonl"
        good = json.dumps({"messages": [user, {"role": "assistant", "content": "a"}]})
        path.write_text(good + "\n" + json.dumps({"messages": [user, {"role": "assistant", "content": answer}]}) + "\n")
        with pytest.raises(ValueError, match=rf"^{path}:2: messages\[1\] is an assistant answer with empty content "
                                             r"and no tool_calls, so only the end of its turn would be learned"):
            load_examples(path, encoder)
    path.write_text(json.dumps({"prompt": "2+2=", "completion": " "}) + "\n")
    with pytest.raises(ValueError, match=rf"^{path}:1: 'completion' is empty, so only the end of the text"):
        load_examples(path, encoder)
    record = {"prompt": [user], "completion": [{"role": "assistant", "content": ""}]}
    with pytest.raises(ValueError, match=r"^x:1: completion\[0\] is an assistant answer with empty content"):
        conversation(record, "x:1")
    call = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    tool = {"role": "tool", "content": "1"}
    kept = [conversation({"messages": [user, {"role": "assistant", "content": None, "tool_calls": call}, tool,
                                       {"role": "assistant", "content": "1"}]}, "x:1"),
            conversation({"messages": [user, {"role": "assistant", "content": "", "weight": 0}, user,
                                       {"role": "assistant", "content": "b"}]}, "x:2"),
            conversation({"prompt": [{"role": "assistant", "content": ""}, user],
                          "completion": [{"role": "assistant", "content": "b"}]}, "x:3")]
    assert [c.learned for c in kept] == [[False, True, False, True], [False, False, False, True], [False, False, True]]
