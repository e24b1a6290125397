"""`rdepth rl --prompts FILE.jsonl`: chat prompts rendered as SFT and the server render them, rollouts that stop at
the turn's end, and a bad record named FILE:LINE in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.data.chat import ExampleEncoder, conversation
from recurrent_depth.data.tokenizer import save_tokenizer
from recurrent_depth.evaluation.reasoning.data import byte_tokenizer
from recurrent_depth.serving.text import TextCodec
from recurrent_depth.train.rl.rollouts import ChatPrompts, chat_prompts

pytestmark = pytest.mark.usefixtures("one_thread")

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? <|end_turn|>"}]


def ends_turn(prompt: str, completion: str, depths: list[int]) -> float:
    """A reward that varies on an untrained model, and fails if the chat prompt or its stop leaked into it."""
    assert prompt.startswith("<|begin_text|><|begin_header|>system") and "<|end_turn|>" not in completion
    return completion.count("1") / max(1, len(completion))


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    out: Path = tmp_path_factory.mktemp("rlchat") / "m"
    torch.manual_seed(7)
    config = dataclasses.replace(rd.ModelConfig.from_preset("tiny"), vocab_size=288)
    rd.RecurrentDepthLM(config).save_pretrained(out)
    save_tokenizer(byte_tokenizer(), out)
    return out


def test_chat_prompt_ids_are_what_sft_and_the_server_render(chat_model):
    config = rd.RecurrentDepthLM.from_pretrained(chat_model).config
    prompts = chat_prompts([{"messages": MESSAGES}, {"prompt": MESSAGES}], chat_model, config)
    codec = TextCodec(chat_model, config.vocab_size)
    served = codec.encode_chat(MESSAGES, add_generation_prompt=True)
    assert [list(p.ids) for p in prompts.prompts] == [served, served]  # messages and trl's prompt: one render
    bos = codec.tokenizer.token_to_id("<|begin_text|>")
    assert served.count(bos) == 1 and served[0] == bos  # the template's bos, not a second one
    # SFT's example of the same messages and an answer: the prompt ids, then the learned answer
    example = ExampleEncoder(chat_model, config).encode(
        conversation({"messages": [*MESSAGES, {"role": "assistant", "content": "4"}]}, "x"), "x")
    n = len(served)
    assert example.ids[:n] == served and not any(example.scored[:n]) and example.scored[n]
    assert codec.tokenizer.token_to_id("<|end_turn|>") in prompts.stop_ids


def test_a_two_update_rl_run_on_chat_jsonl_stops_at_the_turn_end(chat_model, tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in ({"messages": MESSAGES, "answer": "4"}, {"prompt": MESSAGES})))
    out = tmp_path / "run"
    assert main(["rl", "--init-from", str(chat_model), "--out", str(out), "--prompts", str(data),
                 "--reward", "tests.test_rlchat_s34:ends_turn", "--group-size", "2", "--prompts-per-step", "1",
                 "--updates", "2", "--save-every", "2", "--num-steps", "2", "--max-new-tokens", "3",
                 "--backprop-depth", "1", "--threads", "1", "--seed", "1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["updates"] == 2 and summary["reward_last"] is not None


def test_rollouts_of_chat_prompts_also_stop_at_the_end_of_turn(chat_model):
    from recurrent_depth.train.rl import RolloutSettings, RolloutSource, ShapedReward

    model = rd.RecurrentDepthLM.from_pretrained(chat_model)
    prompts = chat_prompts([{"messages": MESSAGES}], chat_model, model.config)
    assert isinstance(prompts, ChatPrompts)
    settings = RolloutSettings(group_size=2, generation={"max_new_tokens": 2, "do_sample": True, "num_steps": 2})
    source = RolloutSource(model, prompts, ShapedReward(ends_turn, max_depth=2, max_new_tokens=2), settings)
    end_turn = TextCodec(chat_model, model.config.vocab_size).tokenizer.token_to_id("<|end_turn|>")
    assert end_turn in source.end_ids and source.encoder.eos in source.end_ids


@pytest.mark.parametrize(("line", "message"), [
    ('{"messages": [{"role": "usr", "content": "hi"}]}', "is not a chat role"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]}', "is the assistant's"),
    ('{"prompt": "plain text"}', "must be a non-empty list of messages"),
    ('{"text": "hi"}', "expected one of 'messages' or 'prompt'"),
    ("[1, 2", "not valid JSON"),
])
def test_a_bad_chat_record_is_one_line_naming_file_and_line(chat_model, tmp_path, capsys, line, message):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"messages": MESSAGES}) + "\n" + line + "\n")
    assert main(["rl", "--init-from", str(chat_model), "--out", str(tmp_path / "run"), "--prompts", str(data),
                 "--reward", "tests.test_rlchat_s34:ends_turn", "--threads", "1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and f"{data}:2" in err[0] and message in err[0], err
    assert not (tmp_path / "run").exists()  # refused before the model loads
