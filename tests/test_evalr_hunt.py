"""Evaluation as a researcher meets it: lm-eval scores per depth, the shipped generation tasks' answer rules,
reasoning grids and recipes checked against plain recomputations."""

from __future__ import annotations

import pytest

from recurrent_depth.evaluation.reasoning import Addition, ReasoningRunConfig, make_problems
from recurrent_depth.evaluation.reasoning.evaluate import AccuracyGrid
from tests.test_hf import make_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")


def _rd_tasks(names: list[str], **metadata):
    """Our shipped lm-eval tasks only (lm-eval's own ~15k configs take 10+ s to index)."""
    from lm_eval.tasks import TaskManager

    from recurrent_depth.evaluation.tasks import TASKS_DIR

    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False,
                          **({"metadata": metadata} if metadata else {}))
    return manager, manager.load(names)["tasks"]


def test_a_generation_score_at_a_depth_does_not_depend_on_the_depths_evaluated_before_it(tmp_path, monkeypatch):
    # One backend serves every depth; its generations drew their s_0 seeds from one stream, so depth 2's
    # generations got other seeds (and other tokens) after depth 1 had run than in a run of depth 2 alone.
    import recurrent_depth.inference as inference
    from recurrent_depth.evaluation.depth_eval import EvalConfig, _lm_eval

    make_model_dir(tmp_path / "model", max_seq_len=128)
    calls = []
    generate = inference.generate

    def recording(model, context, **kwargs):
        out = generate(model, context, **kwargs)
        calls.append((kwargs["num_steps"], kwargs["seed"], out.sequences.tolist()))
        return out

    monkeypatch.setattr(inference, "generate", recording)
    config = EvalConfig(model=str(tmp_path / "model"), data=None, lm_eval_tasks=["rd_chains_gen"], limit=2,
                        seed=3).validate()
    manager, _ = _rd_tasks(["rd_chains_gen"])
    _lm_eval(config.model, config, [1, 2], 0, manager)
    after_depth_1 = [c for c in calls if c[0] == 2]
    calls.clear()
    _lm_eval(config.model, config, [2], 0, manager)
    assert after_depth_1 and after_depth_1 == calls


def _chains_gen_answer(task, response: str) -> str:
    """What rd_chains_gen's filters keep of a generation (then compared with the answer by exact match)."""
    from lm_eval.api.instance import Instance

    [ensemble] = task._filters
    instance = Instance("generate_until", {}, ("?a", {}), 0)
    instance.resps = [response]
    ensemble.apply([instance])
    return instance.filtered_resps[ensemble.name]


def test_rd_chains_gen_takes_the_first_character_as_the_answer():
    _, tasks = _rd_tasks(["rd_chains_gen"], count=1)
    # rd_chains_gen: the answer is the generation's first character; a digit after a variable name ("b>4", a
    # definition written instead of an answer) was taken as the answer
    chains = tasks["rd_chains_gen"]
    assert _chains_gen_answer(chains, "4") == "4"
    assert _chains_gen_answer(chains, "4>") == "4"
    assert _chains_gen_answer(chains, "b>4") != "4"


def test_rd_addition_gen_generates_room_for_the_longest_answer():
    _, tasks = _rd_tasks(["rd_addition_gen"], digits=[8, 40], count=2)
    # rd_addition_gen: 8 generated tokens cut every answer of 8 digits or more (9+ characters), so a model
    # scored 0 at any difficulty --metadata chose there
    addition = tasks["rd_addition_gen"]
    longest = max(len(row["answer"]) for row in addition.dataset["test"])
    assert longest == Addition.max_difficulty + 1
    assert addition.config.generation_kwargs["max_gen_toks"] >= longest


def test_solved_up_to_takes_difficulties_in_order_however_they_were_given():
    accuracy = {1: {1: 0.2}, 2: {1: 1.0}, 4: {1: 1.0}}
    for order in ([1, 2, 4], [4, 2, 1], [2, 4, 1]):
        grid = AccuracyGrid("t", "n", order, [1], 10, accuracy)
        assert grid.solved_up_to(0.9) is None, order  # difficulty 1 fails: nothing is solved up to any d
        assert grid.solved_up_to(0.1) == 4, order
    grid = AccuracyGrid("t", "n", [4, 1, 2], [1], 10, {1: {1: 1.0}, 2: {1: 1.0}, 4: {1: 0.5}})
    assert grid.solved_up_to(0.9) == 2  # (was 4's failure ending the loop first: None)


@pytest.mark.parametrize("test_difficulties, message",
                         [([0, 13], r"hops=13 is invalid: expected an integer in \[0, 12\]"),
                          ([], "test_difficulties is empty")])
def test_a_test_difficulty_out_of_the_task_is_refused_before_training(test_difficulties, message):
    # it was met by the final evaluation, after the whole training budget was spent
    with pytest.raises(ValueError, match=message):
        ReasoningRunConfig(task="chains", test_difficulties=test_difficulties).validate()
    ReasoningRunConfig(task="chains", test_difficulties=[0, 12]).validate()


def test_addition_problems_are_fixed_width_sums_for_every_difficulty():
    task = Addition()
    for problem in make_problems(task, 30, [1, 2, 7, 40], seed=5):
        a, b = problem.prompt[:-1].split("+")
        assert len(a) == len(b) == problem.difficulty and len(problem.answer) == problem.difficulty + 1
        assert int(problem.answer) == int(a) + int(b)  # (leading zeros kept: a fixed-width string)
    assert make_problems(task, 5, [3], seed=5) == make_problems(task, 5, [3], seed=5)
