"""Byte-level BPE training, special-token layout, saving, and loading through transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from recurrent_depth.cli import main as cli_main
from recurrent_depth.data.corpus import Document, DocumentListCorpus, StdlibCorpus
from recurrent_depth.data.tokenizer import (
    MIN_VOCAB_SIZE,
    SPECIAL_TOKENS,
    build_tokenizer,
    chat_template,
    load_tokenizer,
    save_tokenizer,
    special_token_ids,
    special_token_layout,
    tokenizer_sha256,
    train_tokenizer,
)

SAMPLE_FILES = ["json/encoder.py", "textwrap.py", "keyword.py", "colorsys.py"]
ROUND_TRIP_TEXTS = [
    "def f(x):\n\treturn x ** 2  # squared\r\n",
    "    if a != b:\n        raise ValueError(f'{a!r} != {b!r}')\n\n\n",
    "naïve café, Grüße, 日本語, emoji 😀🐍, zero-width \u200b, nbsp \u00a0!",
    "literal specials <|begin_text|> <|pad|> stay text",
    "",
    " leading and trailing spaces   ",
]


@pytest.fixture(scope="module")
def docs() -> list[Document]:
    corpus = StdlibCorpus()
    return [Document(f, (corpus.path / f).read_text(encoding="utf-8")) for f in SAMPLE_FILES]


@pytest.fixture(scope="module")
def tok(docs: list[Document]) -> Tokenizer:
    return train_tokenizer(docs, vocab_size=320)


@pytest.fixture(scope="module")
def saved(tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tokenizer(tok, tmp_path_factory.mktemp("tok"), model_max_length=512)


def test_vocab_size_and_special_layout(tok: Tokenizer) -> None:
    assert tok.get_vocab_size(with_added_tokens=True) == 320
    ids = special_token_ids(tok)
    assert ids == special_token_layout(320)
    assert ids == {"begin_text": 288, "end_text": 289, "begin_header": 290, "end_header": 291,
                   "end_turn": 292, "pad": 293}
    assert [tok.id_to_token(320 - 32 + i) for i in range(32)] == list(SPECIAL_TOKENS)


def test_layout_matches_huginn_at_paper_vocab_size() -> None:
    ids = special_token_layout(65536)
    assert (ids["begin_text"], ids["end_text"], ids["end_turn"], ids["pad"]) == (65504, 65505, 65508, 65509)


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS, ids=["code", "fstring", "unicode", "specials", "empty", "spaces"])
def test_round_trip(tok: Tokenizer, text: str) -> None:
    enc = tok.encode(text, add_special_tokens=False)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    assert tok.encode(text).ids[:1] == [special_token_ids(tok)["begin_text"]]  # bos by default


def test_literal_special_strings_become_special_ids(tok: Tokenizer) -> None:
    # Chat templates rely on this; data preparation encodes them as text instead (see packing).
    ids = tok.encode("a<|end_turn|>b", add_special_tokens=False).ids
    assert special_token_ids(tok)["end_turn"] in ids


def test_round_trip_whole_files(tok: Tokenizer, docs: list[Document]) -> None:
    for doc in docs:
        ids = tok.encode(doc.text, add_special_tokens=False).ids
        assert tok.decode(ids) == doc.text
        assert len(ids) < len(doc.text.encode())  # merges were learned and used


def test_training_is_deterministic(docs: list[Document], tok: Tokenizer) -> None:
    again = train_tokenizer(list(reversed(docs))[::-1], vocab_size=320)
    assert tokenizer_sha256(again) == tokenizer_sha256(tok)


def test_max_bytes_limits_training_data(docs: list[Document]) -> None:
    cut = train_tokenizer(docs, vocab_size=300, max_bytes=2000)
    first = docs[0].text.encode()[:2000].decode("utf-8", errors="ignore")
    same = train_tokenizer([first], vocab_size=300)
    assert tokenizer_sha256(cut) == tokenizer_sha256(same)


@pytest.mark.parametrize(
    "vocab_size, message",
    [(MIN_VOCAB_SIZE - 1, r"vocab_size must be in \[288"), (300.0, "must be an int"), (True, "must be an int")],
    ids=["too-small", "float", "bool"],
)
def test_bad_vocab_size(vocab_size, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        train_tokenizer(["abc"], vocab_size=vocab_size)


def test_corpus_too_small_for_vocab_is_an_error() -> None:
    with pytest.raises(ValueError, match="only supports .* merges"):
        train_tokenizer(["tiny text"], vocab_size=2000)


def test_save_and_load_round_trip(tok: Tokenizer, saved: Path) -> None:
    assert sorted(p.name for p in saved.iterdir()) == [
        "chat_template.jinja", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"
    ]
    assert not list(saved.glob("*.tmp"))
    loaded = load_tokenizer(saved)
    assert tokenizer_sha256(loaded) == tokenizer_sha256(tok)
    assert loaded.encode("x = 1").ids == tok.encode("x = 1").ids
    config = json.loads((saved / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["model_max_length"] == 512
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(saved / "missing")


def test_special_token_ids_rejects_foreign_tokenizer(tok: Tokenizer) -> None:
    plain = Tokenizer.from_str(tok.to_str())
    with pytest.raises(ValueError, match="must be a tokenizers.Tokenizer"):
        special_token_ids("not a tokenizer")
    from tokenizers import models

    with pytest.raises(ValueError, match="lacks special tokens"):
        special_token_ids(Tokenizer(models.BPE()))
    assert special_token_ids(plain) == special_token_layout(320)


def test_auto_tokenizer_loads_with_specials_and_chat_template(saved: Path, tok: Tokenizer) -> None:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    hf = AutoTokenizer.from_pretrained(saved)
    assert isinstance(hf, PreTrainedTokenizerFast)
    ids = special_token_ids(tok)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (ids["begin_text"], ids["end_text"], ids["pad"])
    assert {"<|begin_header|>", "<|end_header|>", "<|end_turn|>"} <= set(hf.all_special_tokens)
    assert special_token_ids(hf) == ids  # works on the transformers object too
    text = ROUND_TRIP_TEXTS[2]
    encoded = hf(text)["input_ids"]
    assert encoded == tok.encode(text).ids
    assert hf.decode(encoded, skip_special_tokens=True) == text
    messages = [
        {"role": "system", "content": "Be brief. "},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "3+3?"},
    ]
    rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|begin_text|>"
        "<|begin_header|>system<|end_header|>\n\nBe brief.<|end_turn|>"
        "<|begin_header|>user<|end_header|>\n\n2+2?<|end_turn|>"
        "<|begin_header|>Huginn<|end_header|>\n\n4<|end_turn|>"
        "<|begin_header|>user<|end_header|>\n\n3+3?<|end_turn|>"
        "<|begin_header|>Huginn<|end_header|>\n\n"
    )
    chat_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    chat_ids = chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids
    assert chat_ids[0] == ids["begin_text"] and chat_ids.count(ids["begin_text"]) == 1
    assert chat_ids.count(ids["end_turn"]) == 4 and chat_ids.count(ids["begin_header"]) == 5


def test_chat_template_marks_the_assistants_tokens_for_transformers_and_renders_the_same(saved: Path) -> None:
    """transformers' `return_assistant_tokens_mask` (trl's `assistant_only_loss`) needs `{% generation %}`
    around the assistant's tokens: without it the mask was all zeros (and trl refused the template)."""
    from transformers import AutoTokenizer

    from recurrent_depth.serving.chat_template import ChatTemplate, load_template

    hf = AutoTokenizer.from_pretrained(saved)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": " 4 "}, {"role": "user", "content": "ünï?"},
                {"role": "assistant", "content": "é"}]
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    marked = [hf.decode([i for i, m in zip(ids, mask, strict=True) if m == bit]) for bit in (1, 0)]
    assert marked[0] == "4<|end_turn|>é<|end_turn|>"
    source, variables = load_template(saved)
    ours = ChatTemplate(source, variables, 1 << 20).render(messages, add_generation_prompt=False)
    assert ours == hf.apply_chat_template(messages, tokenize=False) == (
        "<|begin_text|><|begin_header|>system<|end_header|>\n\nBe brief.<|end_turn|>"
        "<|begin_header|>user<|end_header|>\n\n2+2?<|end_turn|><|begin_header|>Huginn<|end_header|>\n\n4<|end_turn|>"
        "<|begin_header|>user<|end_header|>\n\nünï?<|end_turn|><|begin_header|>Huginn<|end_header|>\n\né<|end_turn|>")


def test_chat_template_renders_a_null_content_as_empty_text(saved: Path) -> None:
    """OpenAI's assistant turn of tool calls only has `content: null`: the template wrote the text 'None' for it
    (in transformers' apply_chat_template and in our renderer alike)."""
    from transformers import AutoTokenizer

    from recurrent_depth.serving.chat_template import ChatTemplate, load_template

    messages = [{"role": "user", "content": "6*7?"},
                {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
                    "name": "mul", "arguments": "[6, 7]"}}]}, {"role": "tool", "content": "42"}]
    source, variables = load_template(saved)
    ours = ChatTemplate(source, variables, 1 << 20).render(messages, add_generation_prompt=False)
    assert ours == AutoTokenizer.from_pretrained(saved).apply_chat_template(messages, tokenize=False) == (
        "<|begin_text|><|begin_header|>user<|end_header|>\n\n6*7?<|end_turn|>"
        "<|begin_header|>Huginn<|end_header|>\n\n<|end_turn|><|begin_header|>tool<|end_header|>\n\n42<|end_turn|>")


def test_chat_template_rejects_unsafe_assistant_name() -> None:
    assert "'Bot'" in chat_template("Bot")
    with pytest.raises(ValueError, match="assistant_name"):
        chat_template("x' + evil + '")


def test_build_tokenizer_leaves_out_validation_documents(tmp_path: Path) -> None:
    corpus = DocumentListCorpus([Document(f"d{i}", f"def function_{i}(x):\n    return x + {i}\n") for i in range(40)])
    _, meta = build_tokenizer(corpus, 300, val_fraction=0.25, seed=1, out_dir=tmp_path)
    saved_meta = json.loads((tmp_path / "tokenizer_training.json").read_text())
    assert saved_meta == json.loads(json.dumps(meta))
    assert meta["split"]["val_fraction"] == 0.25 and meta["corpus"]["num_documents"] == 40
    from recurrent_depth.data.corpus import DocumentSplit

    split = DocumentSplit.plan(corpus.ids(), 0.25, seed=1)
    train_only = train_tokenizer(split.select(iter(corpus), "train"), 300)
    assert meta["tokenizer_sha256"] == tokenizer_sha256(train_only)


@pytest.mark.parametrize("bad", [-0.1, 1.0], ids=["negative", "one"])
def test_build_tokenizer_rejects_bad_val_fraction(bad: float) -> None:
    corpus = DocumentListCorpus(["x = 1\n"] * 3)
    with pytest.raises(ValueError, match=r"val_fraction must be in \[0, 1\)"):
        build_tokenizer(corpus, MIN_VOCAB_SIZE, val_fraction=bad)


def test_an_empty_corpus_is_named_as_such_not_as_a_vocab_size_problem(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """It said "vocab_size=512: the corpus only supports 0 merges ...; use a smaller vocab_size"."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_bytes(b"\xff\xfe not UTF-8")
    with pytest.raises(ValueError, match=r"has no documents \(1 file\(s\) skipped: binary or not UTF-8\)"):
        build_tokenizer(str(data), MIN_VOCAB_SIZE)
    assert cli_main(["tokenizer", "train", "--data", str(data), "--out", str(tmp_path / "tok")]) == 2
    assert "has no documents" in capsys.readouterr().err
    assert not (tmp_path / "tok").exists()


def test_training_cuts_very_long_words() -> None:
    # The `tokenizers` trainer is quadratic in a word's length: a corpus file holding one line of
    # a million letters took hours. Training now sees runs cut to 1024 characters, so no merge is
    # longer; encoding still reads the whole run, and the text round-trips.
    text = "a" * 5000
    tok = train_tokenizer([text], 300)
    assert max(len(t) for t in tok.get_vocab() if not t.startswith("<|")) == 1024
    assert tok.pre_tokenizer.pre_tokenize_str(text)[0][1] == (0, 5000)
    assert tok.decode(tok.encode(text).ids) == text


def test_load_tokenizer_names_a_corrupt_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text('{"version": ')
    with pytest.raises(ValueError, match="tokenizer.json' is not a valid tokenizers file"):
        load_tokenizer(tmp_path)


def test_cli_train_and_encode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "corpus"
    data.mkdir()
    for i in range(5):
        (data / f"m{i}.py").write_text(f"import os\n\ndef handler_{i}(path):\n    return os.path.join(path, '{i}')\n")
    out = tmp_path / "tok"
    assert cli_main(["tokenizer", "train", "--data", str(data), "--vocab-size", "300", "--out", str(out)]) == 0
    assert "special token ids" in capsys.readouterr().out
    assert (out / "tokenizer.json").is_file() and (out / "tokenizer_training.json").is_file()
    assert cli_main(["tokenizer", "encode", "--model", str(out), "import os"]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["ids"][0] == 300 - 32 and line["num_tokens"] == len(line["tokens"]) == len(line["ids"])
    tok = load_tokenizer(out)
    assert tok.decode(line["ids"]) == "import os"
    assert cli_main(["tokenizer", "train", "--data", str(tmp_path / "nope"), "--out", str(tmp_path / "tok2")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_train_reads_the_corpora_rdepth_train_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`rdepth train` takes --text-field and --follow-symlinks; `rdepth tokenizer train` had neither, so a
    tokenizer (with the same --val-fraction hold-out) could not be trained on such a corpus."""
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": f"def f_{i}(x):\n    return x + {i}\n"}) + "\n" for i in range(6)))
    out = tmp_path / "tok"
    assert cli_main(["tokenizer", "train", "--data", str(jsonl), "--text-field", "body", "--vocab-size", "300",
                     "--val-fraction", "0.2", "--out", str(out)]) == 0
    assert json.loads((out / "tokenizer_training.json").read_text())["split"] is not None
    capsys.readouterr()
    data = tmp_path / "dir"
    data.mkdir()
    (data / "a.py").write_text("import os\n")
    (tmp_path / "outside.py").write_text("import sys\n")
    (data / "b.py").symlink_to(tmp_path / "outside.py")
    assert cli_main(["tokenizer", "train", "--data", str(data), "--vocab-size", "290", "--out", str(out),
                     "--overwrite"]) == 2
    assert "--follow-symlinks" in capsys.readouterr().err
    assert cli_main(["tokenizer", "train", "--data", str(data), "--follow-symlinks", "--vocab-size", "290",
                     "--out", str(out), "--overwrite"]) == 0


def test_cli_train_says_when_max_bytes_cut_the_corpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`rdepth tokenizer train --max-bytes N` printed the whole corpus's size as what it trained on."""
    data = tmp_path / "corpus"
    data.mkdir()
    for i in range(3):
        (data / f"m{i}.py").write_text(f"def handler_{i}(path):\n    return path + '{i}'\n" * 20)
    out = tmp_path / "tok"
    assert cli_main(["tokenizer", "train", "--data", str(data), "--vocab-size", "300", "--max-bytes", "100",
                     "--out", str(out)]) == 0
    assert "its first 100 bytes (--max-bytes)" in capsys.readouterr().out
    assert json.loads((out / "tokenizer_training.json").read_text())["max_bytes"] == 100
