"""`rdepth generate` as a command-line user meets it: the printed text against a plain decode and the server's."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.inference import generate
from recurrent_depth.serving.text import TextCodec, TextState

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
         "h\u00e9llo w\u00f6rld \u65e5\u672c\u8a9e \U0001f642"]


def _save_model(path, tokenizer: Tokenizer) -> None:
    cfg = rd.ModelConfig.from_preset("tiny")
    cfg.vocab_size = 320
    torch.manual_seed(0)
    rd.RecurrentDepthLM(cfg).save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def byte_level_dir(tmp_path_factory):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|end|>"],
        show_progress=False))
    path = tmp_path_factory.mktemp("byte_level")
    _save_model(path, tok)
    return path


@pytest.fixture(scope="module")
def metaspace_dir(tmp_path_factory):
    """A SentencePiece-style word vocabulary: every generated token but two is a word that starts with a space."""
    vocab = {"<unk>": 0, "a": 1, "\u2581Hello": 2, **{f"\u2581w{i}": i for i in range(3, 320)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    path = tmp_path_factory.mktemp("metaspace")
    _save_model(path, tok)
    return path


def _run(capsys, model_dir, *flags: str) -> str:
    assert main(["generate", "--model", str(model_dir), "--max-new-tokens", "6", "--num-steps", "2",
                 "--init-scale", "0", *flags]) == 0
    return capsys.readouterr().out


def test_a_completion_keeps_the_space_a_sentencepiece_decoder_strips_from_a_text_start(metaspace_dir, capsys):
    # "Hello" + "\u2581w5 ..." printed "Hellow5 ...": the completion was decoded alone, its first space stripped
    tok = Tokenizer.from_file(str(metaspace_dir / "tokenizer.json"))
    prompt = tok.encode("Hello").ids
    record = json.loads(_run(capsys, metaspace_dir, "--prompt", "Hello", "--json"))
    whole = tok.decode(prompt + record["tokens"][0])  # the plain reference: prompt and completion decoded together
    assert whole.startswith("Hello w") and record["completions"] == [whole[len("Hello"):]]
    assert _run(capsys, metaspace_dir, "--prompt", "Hello", "--stream") == whole + "\n"
    assert _run(capsys, metaspace_dir, "--prompt", "Hello", "--no-stream") == whole + "\n"


def test_stop_text_is_cut_as_the_server_cuts_it(byte_level_dir, capsys):
    # the matched --stop text (and the rest of its token) was printed, unlike rdepth serve's text
    from recurrent_depth.serving.text import TextCodec, TextState

    model = rd.RecurrentDepthLM.from_pretrained(byte_level_dir).eval()
    tok = Tokenizer.from_file(str(byte_level_dir / "tokenizer.json"))
    kw = dict(max_new_tokens=12, num_steps=2, init_scale=0.0)
    ids = tok.encode("def add").ids
    free = generate(model, ids, **kw).token_lists()[0]
    text = tok.decode(free)
    at = next(i for i in range(1, len(text)) if text[i] != "\ufffd" and text.find(text[i]) == i)
    stop = text[at]
    api = generate(model, ids, stop=[stop], tokenizer=tok, **kw).token_lists()[0]
    state = TextState(TextCodec(byte_level_dir, 320), [stop])
    served = "".join(state.push(t)[0] for t in api)
    assert served == text[:at] and stop in tok.decode(api)  # the server's text ends before the stop string
    base = ["--prompt", "def add", "--max-new-tokens", "12", "--stop", stop]
    assert _run(capsys, byte_level_dir, *base, "--stream") == "def add" + served + "\n"
    assert _run(capsys, byte_level_dir, *base, "--no-stream") == "def add" + served + "\n"
    record = json.loads(_run(capsys, byte_level_dir, *base, "--json"))
    assert record["completions"] == [served] and record["tokens"] == [api]  # the tokens keep the stop token


def test_streamed_text_holds_a_character_split_across_byte_tokens_until_it_is_whole(byte_level_dir):
    """The CLI prints the server's `TextState` deltas: each character once whole, a stop string's start held back."""
    codec = TextCodec(byte_level_dir, 10_000)
    byte_token = {b: codec.tokenizer.token_to_id(ch) for ch, b in _byte_alphabet().items()}
    text = "x\u65e5\U0001f642y"
    tokens = [byte_token[b] for b in text.encode("utf-8")]  # one token per byte
    stream = TextState(codec, [])
    pieces = [stream.push(t)[0] for t in tokens] + [stream.flush()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    assert [p for p in pieces if p] == ["x", "\u65e5", "\U0001f642", "y"]  # each character as soon as it is whole
    stopping = TextState(codec, ["\u65e5\U0001f642"])  # a stop string across tokens: its start held back
    pushed = [stopping.push(t) for t in tokens]
    assert [p for p, _ in pushed if p] == ["x"] and any(hit for _, hit in pushed)


def _byte_alphabet() -> dict[str, int]:
    from recurrent_depth.serving.text import _byte_level_alphabet

    return _byte_level_alphabet()


def test_an_empty_prompt_file_is_named_in_the_error(byte_level_dir, tmp_path, capsys):
    # it was reported as "--prompt must not be empty", a flag the user had not given
    empty = tmp_path / "notes.txt"
    empty.write_text("")
    assert main(["generate", "--model", str(byte_level_dir), "--prompt", "x", "--prompt-file", str(empty)]) == 2
    assert f"--prompt-file {empty} must not be empty" in capsys.readouterr().err


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(byte_level_dir, tmp_path, capsys, monkeypatch):
    """As the server (`TextCodec.check_fits`): a 4 MB prompt file took 1.2 GB and 19 s to tokenize before the
    context-length error."""
    from tokenizers import Tokenizer as RustTokenizer

    big = tmp_path / "big.txt"
    big.write_text("word " * 200_000)

    def never(self, *args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(RustTokenizer, "encode", never)  # (the bound comes first)
    assert main(["generate", "--model", str(byte_level_dir), "--prompt-file", str(big)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"rdepth generate: error: the --prompt-file {big} is 1000000 bytes, so at least ")
    assert "more than the model's context of" in err
