"""transformers users' chats stop at the end of the assistant's turn: the generation config a model directory loads
with lists the chat template's end-of-turn id beside eos (as chat models on the Hub do), both for an `rdepth export
--remote-code` directory loaded with `trust_remote_code=True` and for the library's layout loaded through the
registered Auto classes. Before, `apply_chat_template(..., add_generation_prompt=True)` then `generate` stopped at
eos only and ran on into a made-up next turn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken, Tokenizer

import recurrent_depth  # (also registers the Auto classes)
from recurrent_depth.cli import main
from recurrent_depth.data.tokenizer import save_tokenizer, train_tokenizer
from tests.test_hf import TINY_VOCAB, make_model_dir, tiny_config
from tests.test_serving import CORPUS
from tests.test_serving_chat_extras import TEMPLATE as CHATML
from tests.test_serving_chat_extras import USER

pytestmark = pytest.mark.usefixtures("one_thread")

EOS, END_TURN, BEGIN_HEADER = TINY_VOCAB - 31, TINY_VOCAB - 28, TINY_VOCAB - 30  # the tiny tokenizer's specials


class Scripted:
    """A logits processor that makes `reply[i]` win the i-th generated position: the model writes some text, the
    end of its turn, then the start of a made-up next turn, which generate must never reach."""

    def __init__(self, prompt_length: int, reply: list[int]) -> None:
        self.prompt_length, self.reply = prompt_length, reply

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        token = self.reply[min(input_ids.shape[1] - self.prompt_length, len(self.reply) - 1)]
        forced = torch.full_like(scores, -1e9)
        forced[:, token] = 0.0
        return forced


def chat_reply(model, tokenizer, reply: list[int]) -> list[int]:
    """The ids `generate` appends to the chat prompt of USER while `reply` is what the model writes."""
    from transformers import LogitsProcessorList

    x = tokenizer.apply_chat_template(USER, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    x = x["input_ids"]
    out = model.generate(x, max_new_tokens=len(reply) + 2, do_sample=False, num_steps=2,
                         logits_processor=LogitsProcessorList([Scripted(x.shape[1], reply)]))
    return out[0, x.shape[1]:].tolist()


@pytest.mark.parametrize("own", [None, {"eos_token_id": [EOS, 10], "max_new_tokens": 7}],
                         ids=["no-generation-config", "own-generation-config"])
def test_the_library_layout_through_transformers_stops_at_the_end_of_a_turn(tmp_path, own):
    """The library's layout (no generation_config.json, or one whose eos list lacks the end of turn) loaded with
    AutoModelForCausalLM: its generation config lists `<|end_turn|>` after its own ids, and the chat stops there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    make_model_dir(tmp_path)
    if own is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(own))
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert model.generation_config.eos_token_id == ([EOS, 10, END_TURN] if own else [EOS, END_TURN])
    if own:
        assert model.generation_config.max_new_tokens == 7  # the file's other values stay
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert chat_reply(model, tokenizer, [65, 66, END_TURN, BEGIN_HEADER, 67]) == [65, 66, END_TURN]


def chatml_dir(path: Path) -> None:
    """A tiny model whose tokenizer ends a turn ChatML's way (`<|im_end|>` added as a special token, as in a
    retrofitted Qwen's), with its own generation_config.json (eos and a user's extra stop)."""
    save_tokenizer(train_tokenizer(CORPUS, TINY_VOCAB), path)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    tok.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(CHATML)
    torch.manual_seed(0)
    recurrent_depth.RecurrentDepthLM(tiny_config(vocab_size=320)).save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 10], "max_new_tokens": 9}))


def test_a_remote_code_export_stops_a_chatml_chat_at_im_end(tmp_path):
    """`rdepth export --remote-code` writes the end-of-turn ids the server stops a chat at (`<|im_end|>` here, and
    the tokenizer's `<|end_turn|>`) after the source's own eos list; the exported file's class (what
    `trust_remote_code=True` runs: tests/test_hf_export.py loads it in a process without the library) reads them and
    stops the chat at `<|im_end|>`."""
    from transformers import AutoTokenizer

    from recurrent_depth.integrations.remote.modeling_recurrent_depth import RecurrentDepthForCausalLM as Remote

    chatml_dir(tmp_path / "src")
    im_start, im_end = TINY_VOCAB, TINY_VOCAB + 1
    assert main(["export", "--model", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--remote-code"]) == 0
    written = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert written == {"eos_token_id": [EOS, 10, END_TURN, im_end], "max_new_tokens": 9}
    model = Remote.from_pretrained(tmp_path / "out").eval()
    assert model.generation_config.eos_token_id == [EOS, 10, END_TURN, im_end]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert chat_reply(model, tokenizer, [65, 66, im_end, im_start, 67]) == [65, 66, im_end]


def test_official_layout_and_plain_exports_list_the_end_of_turn(tmp_path):
    """`--official-layout` (and a plain re-save) write Huginn's stops, as the official code's `_get_stops` and its
    vLLM generation_config.json hold them: eos and `<|end_turn|>`, beside the config's bos and pad; an export of a
    model without a chat template writes no generation config."""
    from transformers import AutoModelForCausalLM

    make_model_dir(tmp_path / "src")
    for flags in (["--official-layout"], ["--dtype", "float32"]):
        out = tmp_path / flags[0]
        assert main(["export", "--model", str(tmp_path / "src"), "--out", str(out), *flags]) == 0
        written = json.loads((out / "generation_config.json").read_text())
        assert written == {"bos_token_id": TINY_VOCAB - 32, "eos_token_id": [EOS, END_TURN],
                           "pad_token_id": TINY_VOCAB - 27}
        assert AutoModelForCausalLM.from_pretrained(out).generation_config.eos_token_id == [EOS, END_TURN]
    make_model_dir(tmp_path / "bare", with_tokenizer=False)
    bare = tmp_path / "bare"
    assert main(["export", "--model", str(bare), "--out", str(tmp_path / "bare-out"), "--remote-code"]) == 0
    assert not (tmp_path / "bare-out" / "generation_config.json").exists()
    # --tokenizer hands the export its chat template after the copy: its end of turn is listed too
    assert main(["export", "--model", str(bare), "--out", str(tmp_path / "bare-tok"), "--dtype", "float32",
                 "--tokenizer", str(tmp_path / "src")]) == 0
    assert json.loads((tmp_path / "bare-tok" / "generation_config.json").read_text())["eos_token_id"] == [
        EOS, END_TURN]
