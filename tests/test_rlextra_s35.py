"""`rdepth rl --prompts FILE.jsonl`: a record's other fields (`"answer": "42"`) reach a reward function that takes
keyword arguments, as trl's GRPOTrainer passes a row's other columns; one of the three arguments alone is called as
before. A record the chat template fails on is named FILE:LINE."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import recurrent_depth as rd
from recurrent_depth.cli import main
from recurrent_depth.data.chat import prompt_fields
from recurrent_depth.train.rl.rewards import RewardKeywords, ShapedReward
from recurrent_depth.train.rl.rollouts import chat_prompts
from tests.test_rlchat_s34 import chat_model  # noqa: F401 (a fixture: the tiny chat model of that file)

pytestmark = pytest.mark.usefixtures("one_thread")

CALLS: list[tuple[str, str]] = []  # (prompt, answer) of each call of `graded`, in this process


def graded(prompt: str, completion: str, depths: list[int], answer: str) -> float:
    """A trl-style reward reading the record's `answer`: each prompt's own (its user message says `q-<answer>`)."""
    assert f"q-{answer}" in prompt, (prompt, answer)
    CALLS.append((prompt, answer))
    return float(answer in completion)


def plain(prompt: str, completion: str, depths: list[int]) -> float:
    return float(len(completion))


def everything(prompt: str, completion: str, depths: list[int], **kwargs: Any) -> float:
    return 0.0


def record(answer: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": f"q-{answer}"}], "answer": answer, **extra}


def rl_args(model: Path, out: Path, data: Path, reward: str, *more: str) -> list[str]:
    return ["rl", "--init-from", str(model), "--out", str(out), "--prompts", str(data), "--reward", reward,
            "--num-steps", "2", "--max-new-tokens", "2", "--backprop-depth", "1", "--threads", "1", "--seed", "1",
            *more]


def one_error(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1, err
    return err[0]


def test_which_fields_a_reward_function_takes():
    def named(prompt, completion, depths, answer, solution=None): ...
    def keyword_only(prompt, completion, depths, *, answer): ...
    def positional_only(p, c, d, /, **kwargs): ...
    def star_args(*args, answer): ...

    assert RewardKeywords.of(plain) == RewardKeywords("plain")  # called as before
    assert RewardKeywords.of(named) == RewardKeywords("named", False, frozenset({"answer", "solution"}),
                                                      frozenset({"answer"}))
    assert RewardKeywords.of(keyword_only).required == {"answer"}
    assert RewardKeywords.of(star_args).named == {"answer"}
    every = RewardKeywords.of(everything)
    assert every.every and every.taken == {"prompt", "completion", "depths"}
    assert RewardKeywords.of(positional_only).taken == frozenset()  # (a field 'p' is no second value of p)
    assert RewardKeywords.of(max) == RewardKeywords("max")  # a builtin without a signature: the three arguments
    fields = {"answer": "4", "solution": [1], "tools": None}
    assert RewardKeywords.of(named).take(fields) == {"answer": "4", "solution": [1]}
    assert every.take(fields) == fields
    assert RewardKeywords.of(plain).take(fields) == {}


def test_shaped_reward_passes_fields_to_functions_that_take_them_and_copies_them():
    seen: list[dict[str, Any]] = []

    def greedy(prompt: str, completion: str, depths: list[int], **kwargs: Any) -> float:
        seen.append(kwargs)
        kwargs["meta"]["k"].append("changed")  # (a later call must not see it)
        return 1.0

    fields = {"answer": "4", "meta": {"k": [1]}}
    reward = ShapedReward(greedy, max_depth=2, max_new_tokens=2)
    assert reward("p", "c", [1], 1, fields) == reward("p", "c", [1], 1, fields) == 1.0
    assert seen[0] == {"answer": "4", "meta": {"k": [1, "changed"]}} and fields == {"answer": "4", "meta": {"k": [1]}}
    assert seen[1]["meta"] == {"k": [1, "changed"]}  # a fresh copy, changed once
    assert ShapedReward(plain, max_depth=2, max_new_tokens=2)("p", "ab", [1, 1], 2, fields) == 2.0  # as before
    failing = ShapedReward(lambda p, c, d, answer: 1 / 0, max_depth=2, max_new_tokens=2, on_error="zero",
                           log=seen.append)
    assert failing("p", "c", [1], 1, fields) == 0.0 and "fields={'answer': '4'}" in seen[-1]


def test_every_completion_of_a_prompt_gets_that_prompts_fields(chat_model, tmp_path, capsys):  # noqa: F811 - (a fixture)
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps(record(a)) for a in ("A", "B", "C")) + "\n")
    CALLS.clear()
    assert main(rl_args(chat_model, tmp_path / "run", data, "tests.test_rlextra_s35:graded", "--group-size", "3",
                        "--prompts-per-step", "2", "--updates", "1", "--save-every", "1", "--json")) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["updates"] == 1
    assert len(CALLS) == 2 * 3  # (each asserted its prompt's answer)
    for group in (CALLS[:3], CALLS[3:]):  # a prompt's G rollouts are consecutive: one prompt, one answer
        assert len(set(group)) == 1


def test_a_required_field_a_record_lacks_is_refused_before_the_model_loads(chat_model, tmp_path, capsys):  # noqa: F811 - (a fixture)
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(record("A")) + "\n" + json.dumps({"messages": record("B")["messages"]}) + "\n")
    assert main(rl_args(chat_model, tmp_path / "run", data, "tests.test_rlextra_s35:graded")) == 2
    line = one_error(capsys)
    assert f"{data}:2" in line and "graded takes answer" in line and "no field" in line, line
    text = tmp_path / "prompts.txt"
    text.write_text("q-A\n")
    assert main(rl_args(chat_model, tmp_path / "run", text, "tests.test_rlextra_s35:graded")) == 2
    assert "prompt 1: reward function graded takes answer" in one_error(capsys)
    assert not (tmp_path / "run").exists()  # refused before the model loads


def test_a_field_named_like_an_argument_is_refused_under_kwargs(chat_model, tmp_path, capsys):  # noqa: F811 - (a fixture)
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(record("A", depths=[1])) + "\n")
    assert main(rl_args(chat_model, tmp_path / "run", data, "tests.test_rlextra_s35:everything")) == 2
    line = one_error(capsys)
    assert f"{data}:1: field 'depths'" in line and "rename the field" in line, line
    assert not (tmp_path / "run").exists()


def test_fields_must_be_json_values(chat_model):  # noqa: F811 - (a fixture)
    config = rd.RecurrentDepthLM.from_pretrained(chat_model).config
    with pytest.raises(ValueError, match=r"^prompt 2: field 'answer' is not a JSON value: it holds a set$"):
        chat_prompts([record("A"), {**record("B"), "answer": {1, 2}}], chat_model, config)
    with pytest.raises(ValueError, match=r"^x:3: field 'meta' is not a JSON value: it holds the object key 1, not"):
        prompt_fields({"messages": [], "meta": [{1: "a"}]}, "x:3")
    prompts = chat_prompts([record("A", tools=None)], chat_model, config)
    assert prompts.prompts[0].fields == {"answer": "A", "tools": None} and prompts.prompts[0].where == "prompt 1"


def test_the_python_api_checks_the_fields_a_reward_needs_before_any_rollout(chat_model):  # noqa: F811 - (a fixture)
    from recurrent_depth.evaluation.reasoning.tasks import get_task
    from recurrent_depth.train.rl import ListPrompts, RolloutSettings, RolloutSource, TaskPrompts

    model = rd.RecurrentDepthLM.from_pretrained(chat_model)
    settings = RolloutSettings(group_size=2, generation={"max_new_tokens": 2, "do_sample": True, "num_steps": 2})
    reward = ShapedReward(graded, max_depth=2, max_new_tokens=2)
    chats = chat_prompts([record("A"), {"prompt": record("B")["messages"]}], chat_model, model.config,
                         names=["f.jsonl:1", "f.jsonl:4"])
    for prompts, where in ((chats, "f.jsonl:4"), (ListPrompts(["q-A"]), "prompt 1"),
                           (TaskPrompts(get_task("shells"), [1]), "task prompts")):
        with pytest.raises(ValueError, match=rf"^{where}: reward function graded takes answer \(no default\)"):
            RolloutSource(model, prompts, reward, settings)
    RolloutSource(model, chats, ShapedReward(plain, max_depth=2, max_new_tokens=2), settings)  # (ignores fields)


def test_a_record_the_chat_template_fails_on_is_named_file_and_line(chat_model, tmp_path, capsys):  # noqa: F811 - (a fixture)
    model = tmp_path / "m"
    shutil.copytree(chat_model, model)
    refuse = "{%- for m in messages -%}{%- if m['content'] == 'q-boom' -%}{{ raise_exception('no boom') }}" \
             "{%- endif -%}{%- endfor -%}"
    template = model / "chat_template.jinja"
    template.write_text(refuse + template.read_text())
    config_file = model / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    if "chat_template" in tokenizer_config:
        tokenizer_config["chat_template"] = refuse + tokenizer_config["chat_template"]
        config_file.write_text(json.dumps(tokenizer_config))
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(record("A")) + "\n\n" + json.dumps(record("boom")) + "\n")
    assert main(rl_args(model, tmp_path / "run", data, "tests.test_rlchat_s34:ends_turn")) == 2
    line = one_error(capsys)
    assert f"{data}:3: the chat template failed on this record: no boom" in line, line
