"""SFT data follow-ups of the SFT data fuzzer (/tmp/hunt_sftfuzz): a record's `chat_template_kwargs` (trl's column)
reaches the chat template, and a long row is tokenized only as far as `seq_len + 1` tokens reach."""

from __future__ import annotations

import json
import random

import pytest

import recurrent_depth as rd
from recurrent_depth.data.chat import ExampleEncoder, conversation, load_examples
from recurrent_depth.serving.text import TextCodec
from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.sft import SFTOptions, cut_examples, pack_examples, sft_rows
from tests.test_literal_specials_sp import SPECIALS, build, write
from tests.test_sft import with_template
from tests.test_sft_chat_data import model_dir  # noqa: F401  (the module's tiny model directory fixture)
from tests.train_support import VOCAB

# Qwen3's switch: with enable_thinking false the generation prompt and every answer carry an empty think block
THINKING = (
    "{{ bos_token }}{% for m in messages %}<|begin_header|>{{ m.role }}<|end_header|>"
    "{% if m.role == 'assistant' %}{% generation %}{% if enable_thinking is defined and enable_thinking is false %}"
    "<think></think>{% endif %}{{ m.content }}<|end_turn|>{% endgeneration %}{% else %}{{ m.content }}<|end_turn|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|begin_header|>assistant<|end_header|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% endif %}")
CHAT = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6"}]


def encoder_for(directory) -> ExampleEncoder:
    return ExampleEncoder(directory, rd.ModelConfig.from_json(directory / "config.json"))


@pytest.mark.parametrize("blocks", [True, False], ids=["generation_blocks", "prefix_cuts"])
def test_a_records_chat_template_kwargs_reach_every_render_as_transformers_passes_them(model_dir, tmp_path,  # noqa: F811
                                                                                       blocks):
    """trl's `chat_template_kwargs` column (Qwen3's `{"enable_thinking": false}`) goes to every
    `apply_chat_template(**kwargs)` of the record, and `rdepth serve` takes the request field of that name; SFT
    ignored it, so the examples were rendered without the variable: other text than trl trains on and the server
    sends. Now it is the template's variables, an object or its JSON text, checked as the server checks them."""
    from transformers import AutoTokenizer

    template = THINKING if blocks else THINKING.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    directory = with_template(model_dir, tmp_path / "thinking", template)
    encoder = encoder_for(directory)
    kwargs = {"enable_thinking": False}
    theirs = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        CHAT, tokenize=True, return_dict=True, return_assistant_tokens_mask=blocks, **kwargs)
    served = TextCodec(directory, VOCAB).encode_chat(CHAT, add_generation_prompt=False, variables=kwargs)
    assert list(theirs["input_ids"]) == served
    # (blocks learn what they mark, the think block too; without them an answer starts after the generation prompt,
    # which writes the think block)
    think = "<think></think>" if blocks else ""
    answers = [encoder.tokenizer.encode(f"{think}{a}<|end_turn|>", add_special_tokens=False).ids for a in ("4", "6")]
    for value in (kwargs, json.dumps(kwargs), {**kwargs, "unset": None}):
        example = encoder.encode(conversation({"messages": CHAT, "chat_template_kwargs": value}, "x:1"), "x:1")
        assert example.ids == served
        if blocks:
            assert example.scored == [bool(m) for m in theirs["assistant_masks"]]
        assert sum(example.scored) == sum(map(len, answers))
    # the conversational prompt/completion form: the prompt's render takes them too, so its open turn holds the
    # empty think block (the prompt's, as trl splits prompt from completion) and the completion learns the rest
    record = {"prompt": CHAT[:3], "completion": CHAT[3:], "chat_template_kwargs": kwargs}
    example = encoder.encode(conversation(record, "x:2"), "x:2")
    rest = encoder.tokenizer.encode("6<|end_turn|>", add_special_tokens=False).ids
    assert example.ids == served and example.ids[-len(rest):] == rest and sum(example.scored) == len(rest)
    # none (absent, null, {}, only nulls) renders as before
    plain = encoder.encode(conversation({"messages": CHAT}, "x:3"), "x:3").ids
    assert plain == TextCodec(directory, VOCAB).encode_chat(CHAT, add_generation_prompt=False) != served
    for empty in (None, {}, "{}", {"enable_thinking": None}):
        record = {"messages": CHAT, "chat_template_kwargs": empty}
        assert encoder.encode(conversation(record, "x:4"), "x:4").ids == plain


def test_bad_chat_template_kwargs_are_one_line_naming_the_record():
    bad = {json.dumps({"messages": []}): r"^x:5: 'chat_template_kwargs' cannot set 'messages'",
           json.dumps({"tools": []}): "cannot set 'tools'", json.dumps({"add_generation_prompt": True}):
           "cannot set 'add_generation_prompt'", json.dumps({"bos_token": "x"}): "cannot set 'bos_token'",
           "{not json": r"^x:5: 'chat_template_kwargs' is a string that is not JSON",
           json.dumps([1]): r"^x:5: 'chat_template_kwargs' must be an object", 3: "must be an object",
           json.dumps({"a-b": 1}): "is not an identifier", json.dumps({"a": "\ud800"}): "not valid Unicode"}
    for value, message in bad.items():
        value = json.loads(value) if isinstance(value, str) and value.startswith(("{\"", "[")) else value
        with pytest.raises(ValueError, match=message):
            conversation({"messages": CHAT, "chat_template_kwargs": value}, "x:5")
    with pytest.raises(ValueError, match=r"^x:6: 'chat_template_kwargs' needs a chat"):  # (untemplated: dropped)
        conversation({"prompt": "a", "completion": "b", "chat_template_kwargs": {"a": 1}}, "x:6")


# characters of every width (é 2 bytes, 日 3, 🙂 4, a combining accent), runs of spaces and newlines, the tokenizers'
# special-token texts (plain text in a message), words, digits
ALPHABET = [*"abc xyz  \n\t.,!?0123", "é", "日本", "🙂", "ü", "\u0301", "ß", "   ", "\n\n", "hi", "'s", "</s>", "<s>",
            "<|user|>", "<|end_turn|>", "<|begin_header|>"]


def random_text(rng: random.Random, size: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(size))


def random_record(rng: random.Random) -> dict:
    size = rng.choice([3, 40, 600])
    if rng.random() < 0.2:
        return {"prompt": random_text(rng, size), "completion": random_text(rng, rng.choice([1, 300])) + "x"}
    messages = [{"role": "system", "content": random_text(rng, size)}] if rng.random() < 0.3 else []
    for _ in range(rng.randint(1, 3)):
        messages += [{"role": "user", "content": random_text(rng, rng.choice([1, size]))},
                     {"role": "assistant", "content": random_text(rng, rng.choice([1, 10, size])) + "a"}]
    return {"messages": messages}


@pytest.fixture(scope="module")
def encoders(model_dir, tmp_path_factory):  # noqa: F811
    """Ours (byte-level BPE, generation blocks) and sentencepiece-style tokenizers whose special tokens lstrip or
    rstrip (Metaspace "first", the legacy '▁' normalizer), with a Zephyr-shaped template cut at each answer."""
    out = {"ours": encoder_for(model_dir)}
    for style, flags in (("metaspace_first", {}), ("legacy_prepend", {"lstrip": True}),
                         ("metaspace_always", {"rstrip": True}), ("byte_level", {"lstrip": True})):
        directory = tmp_path_factory.mktemp(style)
        tok = build(style, SPECIALS, flags)
        write(tok, directory)
        config = rd.ModelConfig.from_preset("tiny", vocab_size=tok.get_vocab_size(with_added_tokens=True),
                                            bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"))
        out[style] = ExampleEncoder(directory, config)
    return out


def test_a_prefix_of_a_text_tokenizes_as_the_whole_text_begins(encoders):
    """`_prefix` tokenizes only as much of a text as its first `want` tokens need: those are the whole text's."""
    rng = random.Random(0)
    for name, encoder in encoders.items():
        for _ in range(60):
            text = random_text(rng, rng.choice([50, 400, 1500]))
            whole = encoder._encode(text)
            want = rng.choice([1, 5, 40, 200])
            ids = encoder._prefix(text, want)
            assert ids == whole[: len(ids)] and len(ids) >= min(want, len(whole)), (name, text, want)


def test_an_example_wanted_to_most_tokens_begins_as_the_whole_one(encoders):
    """Ids and masks with `most` are the whole example's first tokens (more than `most` where it is longer, so the
    cut is seen), and without it exactly what the record gives whole: on random chats and prompt/completion
    records holding multi-byte characters and special-token texts, with every kind of tokenizer."""
    rng = random.Random(1)
    for name, encoder in encoders.items():
        for i in range(25):
            record = random_record(rng)
            chat = conversation(record, f"x:{i}")
            whole = encoder.encode(chat, f"x:{i}")
            for most in (1, 8, 50, 300):
                part = encoder.encode(chat, f"x:{i}", most)
                n = len(part.ids)
                assert part.ids == whole.ids[:n] and part.scored == whole.scored[:n], (name, record, most)
                assert n > most if len(whole.ids) > most else n == len(whole.ids)


class CountingTokenizer:
    """A tokenizer that counts the characters it is given to encode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.chars = tokenizer, 0

    def encode(self, text: str, **kwargs):
        self.chars += len(text)
        return self.tokenizer.encode(text, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)


def test_a_long_row_is_tokenized_only_as_far_as_seq_len_reaches(model_dir, tmp_path):  # noqa: F811
    """A row of 1 MB of text took ~10 s and 400 MB (10 MB: 4-5 GB) to tokenize whole, for the seq_len + 1 tokens
    SFT keeps, and the earlier context was tokenized again for the next piece. `rdepth sft` asks for `seq_len + 1`
    tokens now: the rows, their fingerprint and the cut counts are those of the whole examples cut."""
    big = "the cat sat on a mat. " * 5_000  # (110 kB)
    records = [{"messages": [{"role": "user", "content": big}, {"role": "assistant", "content": "ok"}]},
               {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": big}]},
               {"prompt": big, "completion": "ok"}, {"prompt": "a", "completion": "b"},
               *({"messages": [{"role": "user", "content": f"{n}+{n}?"}, {"role": "assistant", "content": f"{2 * n}"}]}
                 for n in range(4))]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    encoder = encoder_for(model_dir)
    counting = CountingTokenizer(encoder.tokenizer)
    encoder.tokenizer = counting
    cfg = TrainConfig(init_from=str(model_dir), data=str(data), seq_len=32, val_fraction=0.3, seed=3)
    train, held_out, stats = sft_rows(cfg, SFTOptions(), encoder, pad_id=0)
    assert counting.chars < 20_000  # (each long row: a few prefixes of ~400 characters, not 3 × 110 kB)
    assert stats["train"]["truncated"] + stats["validation"]["truncated"] == 3
    # the same rows as the whole examples cut to seq_len + 1 (the seed's shuffle, the held-out share)
    examples = load_examples(data, encoder)
    rng = random.Random(cfg.seed)
    rng.shuffle(examples)
    for rows, part in ((held_out, examples[:2]), (train, examples[2:])):
        assert rows.sha256() == pack_examples(cut_examples(part, cfg.seq_len)[0], cfg.seq_len, 0).sha256()
