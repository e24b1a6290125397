"""A notebook user's path through the public Python API: arguments that are the wrong kind or out of range
are one clear error up front, naming the argument (not an AttributeError or a silent zero from deep inside)."""

from __future__ import annotations

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.data import save_tokenizer, train_tokenizer
from recurrent_depth.evaluation.reasoning import ShellGame, accuracy_grid
from recurrent_depth.train import TrainConfig, Trainer, validation_loss_by_depth


class _Rows:
    """The two methods `validation_loss_by_depth` reads of a `ShardDataset`."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def iter_batches(self, batch_size: int, drop_last: bool = False):
        for start in range(0, len(self.rows) - batch_size + 1, batch_size):
            yield self.rows[start : start + batch_size]


@pytest.fixture(scope="module")
def model_288() -> rd.RecurrentDepthLM:
    torch.manual_seed(0)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", vocab_size=288, max_seq_len=64)).eval()


def test_generate_takes_a_tokenizer_directory_for_stop_strings(tmp_path, model_288):
    tok = train_tokenizer(["alpha beta gamma delta " * 20, "def class return import " * 20], vocab_size=288)
    save_tokenizer(tok, tmp_path)
    ids = torch.tensor([tok.encode("alpha beta").ids])
    free = rd.generate(model_288, ids, max_new_tokens=6, num_steps=2, init_scale=0.0)
    text = tok.decode(free.token_lists()[0], skip_special_tokens=False)
    stop = text[len(text) // 2:][:2]
    assert stop
    by_object = rd.generate(model_288, ids, max_new_tokens=6, num_steps=2, init_scale=0.0, tokenizer=tok, stop=[stop])
    by_dir = rd.generate(model_288, ids, max_new_tokens=6, num_steps=2, init_scale=0.0, tokenizer=str(tmp_path),
                         stop=[stop])  # (was: AttributeError 'str' object has no attribute 'decode')
    assert by_dir.finish_reasons == by_object.finish_reasons == ["stop"]
    assert by_dir.token_lists() == by_object.token_lists()


@pytest.mark.parametrize("kwargs, message", [
    ({"tokenizer": 3, "stop": ["a"]}, "tokenizer must be a tokenizers.Tokenizer"),
    ({"streamer": 3}, "streamer must be a callable receiving each TokenEvent, got int"),
], ids=["tokenizer-int", "streamer-int"])
def test_generate_refuses_a_tokenizer_or_streamer_of_the_wrong_kind(model_288, kwargs, message):
    with pytest.raises(TypeError, match=message):
        rd.generate(model_288, torch.tensor([[5, 6, 7]]), max_new_tokens=2, num_steps=1, **kwargs)


@pytest.mark.parametrize("config", [{"hidden_size": 64}, "tiny"], ids=["dict", "preset-name"])
def test_model_refuses_a_config_that_is_not_a_model_config(config):
    with pytest.raises(TypeError, match=f"RecurrentDepthLM takes a ModelConfig .* got {type(config).__name__}"):
        rd.RecurrentDepthLM(config)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"batch_size": -1}, ValueError, r"batch_size=-1 is invalid"),  # (was: every accuracy 0.0, nothing scored)
    ({"batch_size": 0}, ValueError, r"batch_size=0 is invalid"),  # (was: range() arg 3 must not be zero)
    ({"difficulties": []}, ValueError, "difficulties is empty"),  # (was: an empty grid)
    ({"difficulties": [1, 0]}, ValueError, r"swaps=0 is invalid"),
    ({"task": "shells"}, TypeError, r"task must be a ReasoningTask \(get_task\(name\) gives one\), got str"),
], ids=["batch-negative", "batch-zero", "no-difficulties", "bad-difficulty", "task-name"])
def test_accuracy_grid_refuses_bad_arguments_before_scoring(model_288, monkeypatch, kwargs, error, message):
    from recurrent_depth.evaluation.reasoning import evaluate

    def scored(*args, **kw):
        raise AssertionError("scored before the arguments were checked")

    monkeypatch.setattr(evaluate, "answer_correct_at_depths", scored)
    call = {"task": ShellGame(), "difficulties": [1, 2], "depths": [1], "count": 2, **kwargs}
    with pytest.raises(error, match=message):
        accuracy_grid(model_288, call.pop("task"), **call)


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_size": 0}, r"batch_size=0 is invalid: expected an integer >= 1"),  # (was: silently 1)
    ({"batch_size": -2}, r"batch_size=-2 is invalid"),
    ({"max_batches": 0}, r"max_batches=0 is invalid"),  # (was: "validation split has 8 rows: too few")
], ids=["batch-zero", "batch-negative", "no-batches"])
def test_validation_loss_by_depth_refuses_bad_sizes(model_288, kwargs, message):
    data = _Rows(torch.randint(0, 288, (8, 9)))
    call = {"batch_size": 2, "max_batches": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        validation_loss_by_depth(model_288, data, [1], **call)


def test_validation_loss_by_depth_names_ids_outside_the_vocabulary(model_288):
    data = _Rows(torch.randint(0, 288, (4, 9)))
    data.rows[1, 3] = 300  # another tokenizer's rows (was: torch's IndexError "index out of range in self")
    with pytest.raises(ValueError, match=r"token id 300, outside the model's vocabulary \[0, 288\)"):
        validation_loss_by_depth(model_288, data, [1], batch_size=2, max_batches=2)
    assert validation_loss_by_depth(model_288, _Rows(data.rows[2:]), [1], batch_size=2, max_batches=1).tokens == 16


@pytest.mark.parametrize("build, message", [
    (lambda m: {"max_steps": 2}, r"Trainer takes a TrainConfig .* got dict"),  # (was: 'dict' ... no 'init_from')
    (lambda m: (TrainConfig(max_steps=1), "x"), r"Trainer\(model=\.\.\.\) takes a torch module .* got str"),
], ids=["config-dict", "model-str"])
def test_trainer_refuses_arguments_of_the_wrong_type(model_288, build, message):
    made = build(model_288)
    cfg, model = made if isinstance(made, tuple) else (made, None)
    with pytest.raises(TypeError, match=message):
        Trainer(cfg, model=model)


def test_train_result_repr_leaves_the_module_tree_out(model_288):
    from recurrent_depth.train.trainer import TrainResult

    result = TrainResult(None, model_288, None, 1, 8, 0, 0.1, "max_steps", None, None, None)
    assert "RecurrentDepthLM(" not in repr(result) and "steps=1" in repr(result)
