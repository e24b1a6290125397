"""Issue 33 (items 12, 14): a model directory's tokenizer and weight files as untrusted input.

A tokenizer with more tokens than the model's vocabulary is refused at load (server, `rdepth
generate`), one line naming both sizes; a tokenizer that panics on a text (a catastrophic
pre-tokenizer regex) answers that request with a 400 and keeps its worker; weight files reached
through symlinks are read only where they are regular files of a bounded size.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from tokenizers import Regex, Tokenizer, pre_tokenizers

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.data.tokenizer import special_token_ids
from recurrent_depth.files import open_regular, reopen_path
from recurrent_depth.serving.prep import Preparer, PrepSpec
from recurrent_depth.serving.protocol import Limits
from recurrent_depth.serving.text import TextCodec
from tests.test_serving import model_dir  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

CATASTROPHIC = r"(\w+\s?)*$"  # exponential backtracking: onig gives up (a Rust panic) at ~25 word characters
PANICS = "a" * 30 + "!"


def copy_dir(src, dst):
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)
    return dst


@pytest.fixture(scope="module")
def small_vocab_dir(model_dir, tmp_path_factory):  # noqa: F811
    """The tiny model's 320-token tokenizer with a model of 300 embedding rows."""
    out = copy_dir(model_dir, tmp_path_factory.mktemp("small_vocab"))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    cfg = rd.ModelConfig.from_preset("tiny", vocab_size=300, eos_token_id=special_token_ids(tok)["begin_text"])
    rd.RecurrentDepthLM(cfg).save_pretrained(out)
    return out


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_at_load(small_vocab_dir, capsys):
    """The server's TextCodec (`build_app` and every request-preparation worker make one) and `rdepth generate`."""
    sizes = "has 320 tokens but the model's vocabulary has 300 (config.json vocab_size)"
    with pytest.raises(ValueError, match=rf"the tokenizer '{small_vocab_dir / 'tokenizer.json'}' {re.escape(sizes)}"):
        TextCodec(small_vocab_dir, 300, 256)
    args = ["generate", "--model", str(small_vocab_dir), "--prompt", "hi", "--max-new-tokens", "1", "--threads", "1"]
    assert main(args) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # (after the thread-count line)
    assert last == f"rdepth generate: error: the tokenizer '{small_vocab_dir}' {sizes}: it is not this model's " \
                   "tokenizer"


@pytest.fixture(scope="module")
def panicking_dir(model_dir, tmp_path_factory):  # noqa: F811
    """The tiny model whose tokenizer splits on a catastrophic regex before its byte-level step."""
    out = copy_dir(model_dir, tmp_path_factory.mktemp("panicking"))
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(CATASTROPHIC), "isolated"),
                                                 tok.pre_tokenizer])
    tok.save(str(out / "tokenizer.json"))
    return out


def test_a_tokenizer_panic_is_a_value_error(panicking_dir):
    codec = TextCodec(panicking_dir, 320, 256)
    assert codec.encode("hello")  # short texts tokenize
    with pytest.raises(ValueError, match="the tokenizer failed on this text: Onig: Regex search error"):
        codec.encode(PANICS)


def test_a_tokenizer_panic_answers_400_and_the_worker_keeps_serving(panicking_dir):
    """What a request-preparation worker does with a body (`Preparer.prepare`: a result tuple back; before,
    the panic, a BaseException, ended the worker: a 503)."""
    limits = Limits(256, 4, 320)
    spec = PrepSpec(str(panicking_dir), 320, limits, frozenset({"tiny"}), memory_headroom=None)
    preparer = Preparer(spec)
    for kind, body in (("completions", {"model": "tiny", "prompt": PANICS}),
                       ("chat", {"model": "tiny", "messages": [{"role": "user", "content": PANICS}]})):
        status, message = preparer.prepare(kind, json.dumps(body).encode())[1:3]
        assert status == 400 and message.startswith("the tokenizer failed on this text: Onig: Regex search error")
    ok = preparer.prepare("completions", json.dumps({"model": "tiny", "prompt": "hello"}).encode())
    assert ok[0] == "ok" and ok[2] == [TextCodec(panicking_dir, 320, 256).encode("hello")]


# ---------------------------------------------------------------- item 14: symlinked weight files
@pytest.fixture
def linked_dir(model_dir, tmp_path):  # noqa: F811
    """The tiny model with its weights in a blob store next door, linked in (a hub-cache snapshot)."""
    out = copy_dir(model_dir, tmp_path / "snapshot")
    blob = tmp_path / "blobs" / "0123abcd"
    blob.parent.mkdir()
    shutil.move(out / "model.safetensors", blob)
    (out / "model.safetensors").symlink_to(blob)
    return out, blob


def test_weight_symlinks_are_followed_to_regular_bounded_files_only(linked_dir, tmp_path):
    out, blob = linked_dir
    reference = rd.RecurrentDepthLM.from_pretrained(out)  # the hub case: followed
    link = out / "model.safetensors"
    padded = tmp_path / "padded.safetensors"  # a valid header, then a terabyte (sparse) the header never names
    shutil.copyfile(blob, padded)
    with open(padded, "r+b") as handle:
        handle.truncate(blob.stat().st_size + (1 << 40))
    os.mkfifo(tmp_path / "fifo")
    cases = {padded: r"has 1,099,511,627,776 bytes past its last tensor", tmp_path / "fifo": "is not a regular file",
             tmp_path: r"is not a regular file \(a directory"}
    for target, error in cases.items():
        link.unlink()
        link.symlink_to(target)
        with pytest.raises(ValueError, match=rf"weights file {re.escape(str(link))} \(a symlink to "
                                             rf"{re.escape(str(target))}\) {error}"):
            rd.RecurrentDepthLM.from_pretrained(out)
    link.unlink()
    link.symlink_to(blob)
    again = rd.RecurrentDepthLM.from_pretrained(out)
    assert torch.equal(again.transformer.wte.weight, reference.transformer.wte.weight)


def test_the_weights_read_are_the_file_checked_not_a_swapped_link(tmp_path):
    (tmp_path / "a").write_text("checked")
    (tmp_path / "b").write_text("swapped")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "a")
    fd, _ = open_regular(link, None, "weights file")
    with os.fdopen(fd, "rb") as handle:
        link.unlink()
        link.symlink_to(tmp_path / "b")
        with open(reopen_path(handle, link)) as again:
            assert again.read() == "checked"
