"""Reasoning task generators: deterministic, well formed, answers confirmed by the independent solvers."""

from __future__ import annotations

import json
import random
import re

import pytest

from recurrent_depth.evaluation.reasoning import (
    Addition,
    ProblemEncoder,
    RunningSum,
    ShellGame,
    VariableChains,
    get_task,
    make_problems,
    write_jsonl,
)
from recurrent_depth.evaluation.tasks import utils as task_utils


@pytest.mark.parametrize(
    "task", [VariableChains(), VariableChains(num_chains=2), Addition(), RunningSum(), ShellGame()],
    ids=["chains-4", "chains-2", "addition", "modsum", "shells"],
)
def test_generators_are_deterministic_and_solver_agrees(task):
    difficulties = list(range(task.min_difficulty, min(task.max_difficulty, 12) + 1))
    first = make_problems(task, 20, difficulties, seed=3)
    assert first == make_problems(task, 20, difficulties, seed=3)
    assert first != make_problems(task, 20, difficulties, seed=4)
    for problem in first:
        assert task.solve(problem.prompt) == problem.answer, problem


def chain_links(prompt: str) -> list[tuple[str, str]]:
    """(defined name, source) pairs of `source>name;` definitions."""
    return [(name, source) for source, name in re.findall(r"([A-Za-z0-9])>([A-Za-z]);", prompt)]


@pytest.mark.parametrize("hops", [0, 1, 5, 12], ids=lambda h: f"hops-{h}")
def test_chain_problems_have_the_stated_structure(hops):
    task = VariableChains()
    for problem in make_problems(task, 30, [hops], seed=0):
        links = chain_links(problem.prompt)
        defined = set()
        for name, ref in links:  # every reference was defined earlier, every name once
            assert name not in defined
            assert ref.isdigit() or ref in defined
            defined.add(name)
        roots = [ref for _, ref in links if ref.isdigit()]
        assert len(roots) == task.num_chains == len(set(roots))  # distinct root digits: no lucky guess
        env = dict(links)
        name = problem.prompt[-1]
        steps = 0
        while env[name].isalpha():
            name, steps = env[name], steps + 1
        assert steps == hops == problem.difficulty


@pytest.mark.parametrize("intermediate", [False, True], ids=["answer-only", "intermediate"])
def test_training_rows_supervise_the_answer_and_optionally_every_reference(intermediate):
    task = VariableChains()
    rng = random.Random(0)
    for hops in (0, 3, 6):
        segments = task.training_segments(rng, hops, intermediate=intermediate)
        (query, q_label), (answer, a_label) = segments[-2:]
        definitions = "".join(text for text, _ in segments[:-2])
        assert q_label is False and a_label is True
        assert task.solve(definitions + query) == answer
        references = 0
        for i, (text, label) in enumerate(segments[:-2]):
            if isinstance(label, str):  # a reference predicts its variable's value where it names it
                assert intermediate and text == ">"
                references += 1
                assert task.solve(definitions + f"?{segments[i - 1][0]}") == label
            else:
                assert label is False
        assert references == (len(chain_links(definitions)) - task.num_chains if intermediate else 0)


@pytest.mark.parametrize("intermediate", [False, True], ids=["answer-only", "intermediate"])
def test_running_sum_rows_label_every_partial_sum(intermediate):
    task = RunningSum()
    segments = task.training_segments(random.Random(2), 7, intermediate=intermediate)
    prompt = "".join(text for text, _ in segments[:-1])
    assert len(prompt) == 8 and prompt.endswith("=")
    assert segments[-1] == (task.solve(prompt), True)
    if intermediate:
        (first, unscored), (rest, labels), _ = segments
        assert unscored is False and len(labels) == len(rest)
        for i, label in enumerate(labels):  # the label after digit i is the sum of digits 0..i, mod 10
            assert label == task.solve(prompt[: i + 1] + "=")


def test_addition_is_most_significant_digit_first_and_fixed_width():
    problem = Addition().sample(random.Random(1), 4)
    a, b = problem.prompt[:-1].split("+")
    assert len(a) == len(b) == 4 and len(problem.answer) == 5
    assert int(problem.answer) == int(a) + int(b)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: VariableChains().sample(random.Random(0), 13), "hops=13"),
        (lambda: VariableChains().sample(random.Random(0), -1), "hops=-1"),
        (lambda: Addition().sample(random.Random(0), 0), "digits=0"),
        (lambda: VariableChains(num_chains=11), "num_chains=11"),
        (lambda: get_task("sorting"), "unknown reasoning task"),
        (lambda: make_problems(Addition(), 0, [1]), "count=0"),
        (lambda: VariableChains().solve("b>a;?a"), "undefined or circular"),
    ],
    ids=["too-many-hops", "negative-hops", "zero-digits", "too-many-chains", "unknown-task", "zero-count",
         "bad-prompt"],
)
def test_bad_arguments_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_encoder_labels_only_the_answers():
    encoder = ProblemEncoder()
    problem = make_problems(VariableChains(), 1, [2], seed=0)[0]
    batch = encoder.batch([problem, make_problems(Addition(), 1, [3], seed=0)[0]])
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids[0, 0] == encoder.bos
    scored = labels[0][labels[0] != -100].tolist()
    assert encoder.tokenizer.decode(scored) == problem.answer  # the digit, not the end token
    row = encoder.training_batch([[("ab", False), ("c", True)]])
    assert row["labels"][0].tolist() == [-100, -100, -100, encoder.encode_text("c")[0], encoder.eos]
    # One token per character: digits never merge.
    assert len(encoder.encode_text("0123456789")) == 10


def test_jsonl_corpus_for_the_trainer(tmp_path):
    path = write_jsonl(tmp_path / "chains.jsonl", VariableChains(), 5, [1, 2], seed=0)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 10
    assert all(row["text"] == row["prompt"] + row["answer"] for row in rows)


def test_lm_eval_dataset_builders_accept_metadata():
    data = task_utils.chains_dataset(hops=[1, 3], count=4, version=1.0)  # lm-eval passes its metadata too
    test = data["test"]
    assert len(test) == 8 and len(data["train"]) == 32
    for row in test:
        assert row["choices"][row["label"]] == row["answer"]
        assert VariableChains().solve(row["prompt"]) == row["answer"]
    assert data["test"][0] == task_utils.chains_dataset(hops=[1, 3], count=4)["test"][0]
    addition = task_utils.addition_dataset(digits=2, count=3)
    assert all(len(row["answer"]) == 3 for row in addition["test"])


def test_lm_eval_metadata_changes_size_and_difficulty():
    # `--metadata '{"hops": [6, 8], "count": 3}'` as docs/evaluation.md shows: lm-eval passes the
    # metadata and the yaml's dataset_kwargs to the builder together, so a key in both raised TypeError
    from lm_eval.tasks import TaskManager

    from recurrent_depth.evaluation.tasks import TASKS_DIR

    def load(names, **metadata):
        # Only our tasks: indexing lm-eval's own ~15k task configs takes 10+ s and plays no part here.
        manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False,
                              **({"metadata": metadata} if metadata else {}))
        if hasattr(manager, "load"):  # newer lm-eval (0.4.13 here) deprecates get_task_dict for it
            return manager.load(names)["tasks"]
        from lm_eval.tasks import get_task_dict

        return get_task_dict(names, manager)

    tasks = load(["rd_chains_mc", "rd_chains_gen", "rd_addition_gen"], hops=[6, 8], count=3)
    for name in ("rd_chains_mc", "rd_chains_gen"):
        test = tasks[name].dataset["test"]
        assert len(test) == 6 and sorted(set(test["difficulty"])) == [6, 8]
    assert len(tasks["rd_addition_gen"].dataset["test"]) == 9  # count applies, hops is not its knob
    default = load(["rd_chains_mc"])["rd_chains_mc"]
    assert len(default.dataset["test"]) == 200 and sorted(set(default.dataset["test"]["difficulty"])) == [1, 2, 3, 4]


def test_export_writes_a_corpus_the_trainer_config_points_to(tmp_path):
    from pathlib import Path

    from recurrent_depth.data.corpus import load_corpus
    from recurrent_depth.evaluation.reasoning.__main__ import main as reasoning_main
    from recurrent_depth.train.config import TrainConfig

    assert reasoning_main(["export", "--task", "chains", "--difficulties", "0-2", "--count", "3",
                           "--out", str(tmp_path / "chains")]) == 0
    docs = list(load_corpus(str(tmp_path / "chains" / "train.jsonl")))
    assert len(docs) == 9 and all(VariableChains().solve(d.text[:-1]) == d.text[-1] for d in docs)
    assert (tmp_path / "chains" / "tokenizer" / "tokenizer.json").is_file()
    examples = Path(__file__).resolve().parent.parent / "examples"
    for name in ("reasoning_chains.yaml", "reasoning_addition.yaml"):
        config = TrainConfig.from_yaml(examples / name)
        assert config.tokenizer and config.data.endswith("train.jsonl")
        assert config.model_config().max_seq_len >= config.seq_len
    assert reasoning_main(["export", "--task", "chains", "--difficulties", "0-40", "--count", "1",
                           "--out", str(tmp_path / "bad")]) == 2


@pytest.mark.parametrize("intermediate", [False, True], ids=["answer-only", "intermediate"])
def test_shell_game_rows_label_the_cup_after_every_swap(intermediate):
    task = ShellGame()
    segments = task.training_segments(random.Random(5), 9, intermediate=intermediate)
    prompt = "".join(text for text, _ in segments[:-1])
    assert re.fullmatch(r"[0-4]>[a-d]{9}=", prompt)
    assert segments[-1] == (task.solve(prompt), True)
    if intermediate:
        (_, unscored), (rest, labels), _ = segments
        assert unscored is False and len(labels) == len(rest) == 9
        for k, label in enumerate(labels):  # the cup after swap k = the answer to the first k + 1 swaps
            assert label == task.solve(prompt[: 3 + k] + "=")


def test_shell_game_swaps_move_only_the_touched_cups():
    task = ShellGame()
    assert task.solve("0>a=") == "1" and task.solve("1>a=") == "0" and task.solve("2>a=") == "2"
    assert task.solve("4>dd=") == "4" and task.solve("0>abcd=") == "4"
    with pytest.raises(ValueError, match="shells: expected"):
        task.solve("5>a=")
