"""Regressions found by fuzzing the training configuration (TrainConfig fields, the optim / model mappings and
`rdepth train --config FILE`): a bad value is one ValueError line naming the field, never a traceback from
deeper down, and never accepted to fail (or be ignored) once the run has set up."""

from __future__ import annotations

import datetime
import json

import pytest

from recurrent_depth.cli import main
from recurrent_depth.config import MAX_SEQ_LEN
from recurrent_depth.train.config import TrainConfig
from recurrent_depth.train.optim import OptimConfig


def refused(match: str, **values) -> str:
    with pytest.raises(ValueError, match=match) as info:
        TrainConfig(**values)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("preset", [["tiny"], {"a": 1}])
def test_an_unhashable_preset_is_one_line_naming_it(preset):
    # (was TypeError: unhashable type, from `preset not in PRESETS`)
    refused(r"TrainConfig\.preset=", preset=preset)


@pytest.mark.parametrize("preset", [["demo"], {}])
def test_an_unhashable_optimizer_preset_is_one_line_naming_it(preset):
    with pytest.raises(ValueError, match="optimizer preset must be one of"):
        TrainConfig(optim={"preset": preset})
    with pytest.raises(ValueError, match="optimizer preset must be one of"):
        OptimConfig.from_preset(preset)


@pytest.mark.parametrize("seq_len", ["abc", "128", [64], {"a": 1}, b"x"])
def test_a_seq_len_of_another_type_is_named_before_the_model_overrides_read_it(seq_len):
    # (was TypeError: '>' not supported between 'int' and 'str', from max(seq_len, max_seq_len))
    refused(r"TrainConfig\.seq_len=", seq_len=seq_len)


def test_a_seq_len_past_the_context_limit_names_seq_len_not_max_seq_len():
    message = refused(r"TrainConfig\.seq_len=", seq_len=MAX_SEQ_LEN + 1)
    assert "max_seq_len" not in message
    assert TrainConfig(seq_len=64).seq_len == 64


@pytest.mark.parametrize(("name", "value"), [("text_field", 3), ("text_field", ""), ("text_field", ["text"]),
                                             ("tokenizer", True), ("tokenizer", 7), ("tokenizer", ""),
                                             ("data_dir", 0), ("data_dir", [1, 2]),
                                             ("tokenizer", datetime.date(2001, 12, 14))])
def test_paths_and_the_text_field_are_checked_with_the_config_not_when_the_run_reads_them(name, value):
    # (were accepted: Path(True) / Path(0) raised TypeError in set-up, a date broke --print-config's JSON)
    refused(rf"TrainConfig\.{name}=", **{name: value})


@pytest.mark.parametrize("eos", ["abc", 1.5, [1, "a"], {"a": 1}])
def test_a_token_id_override_of_another_type_is_refused_with_the_config(eos):
    # (list[int] in the field's type matched any value; the token ids skip the ModelConfig check until the
    # tokenizer exists, so it failed after the tokenizer and the shards were built)
    refused(r"TrainConfig\.model\.eos_token_id=", model={"eos_token_id": eos})
    assert TrainConfig(model={"eos_token_id": [1, 2]}).model == {"eos_token_id": [1, 2]}


def test_an_optimizer_description_that_is_not_text_is_refused():
    # (a YAML date was accepted, and the first checkpoint's trainer_state.json could not be written)
    with pytest.raises(ValueError, match=r"optim\.description must be a string"):
        TrainConfig(optim={"description": datetime.date(2001, 12, 14)})


@pytest.mark.parametrize(("values", "named"), [
    (dict(mean_recurrence=4), "mean_recurrence=4"),
    (dict(backprop_depth=2), "backprop_depth=2"),
    (dict(model={"mean_recurrence": 8}), "model.mean_recurrence=8"),
])
def test_a_baseline_with_a_depth_beside_it_is_refused_not_silently_run_at_depth_one(values, named):
    # (was accepted: the baseline trained one core pass, but a model override was saved as its config's depth,
    # which `rdepth eval --baseline` then evaluates it at; a sampler depth was ignored)
    message = refused(r"TrainConfig\.baseline=True", baseline=True, **values)
    assert named in message
    assert TrainConfig(baseline=True, model={"mean_recurrence": 1}).baseline is True


def test_rdepth_train_reports_bad_yaml_values_in_one_line(tmp_path, capsys):
    for text, named in (("preset: [1, 2]\n", "TrainConfig.preset="), ("seq_len: abc\n", "TrainConfig.seq_len="),
                        ("optim: {preset: [demo]}\n", "optimizer preset"), ("tokenizer: 2001-12-14\n",
                                                                             "TrainConfig.tokenizer=")):
        config = tmp_path / "c.yaml"
        config.write_text(text)
        code = main(["train", "--config", str(config), "--out", str(tmp_path / "o"), "--print-config",
                     "--threads", "1"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2, text
        assert err[-1].startswith("rdepth train: error: ") and named in err[-1], (text, err)


def test_rdepth_train_print_config_round_trips_through_the_resume_comparison(tmp_path, capsys):
    from recurrent_depth.train.trainer_checkpoints import _with_field_defaults, config_changes

    config = tmp_path / "c.yaml"
    config.write_text("tokenizer: tok\ndata_dir: dd\ntext_field: content\nseq_len: 64\n"
                      "optim: {preset: demo-muon, betas: [0.8, 0.9]}\nmodel: {eos_token_id: [1, 2]}\n")
    assert main(["train", "--config", str(config), "--out", str(tmp_path / "o"), "--print-config",
                 "--threads", "1"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (printed["tokenizer"], printed["data_dir"], printed["text_field"]) == ("tok", "dd", "content")
    assert printed["optim"]["betas"] == [0.8, 0.9] and printed["model"] == {"eos_token_id": [1, 2]}
    again = TrainConfig.from_dict(printed)
    assert config_changes(_with_field_defaults(json.loads(json.dumps(printed))), again.to_dict()) == []
