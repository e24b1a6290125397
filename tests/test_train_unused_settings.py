"""Training settings that the run never reads warn once, in one line (`SETTING_NEEDS`, `UnusedSettingWarning`)."""

from __future__ import annotations

import warnings
from dataclasses import fields
from pathlib import Path

import pytest

from recurrent_depth.cli import main
from recurrent_depth.train.config import SETTING_NEEDS, TrainConfig, UnusedSettingWarning
from recurrent_depth.train.optim import OPTIM_PRESETS, OptimConfig


def unused(**values) -> list[UnusedSettingWarning]:
    """The UnusedSettingWarnings of building TrainConfig(**values)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TrainConfig(**values)
    return [w.message for w in caught if issubclass(w.category, UnusedSettingWarning)]


def fields_of(found: list[UnusedSettingWarning]) -> list[str]:
    return [w.field for w in found]


@pytest.fixture(autouse=True)
def _rank_zero(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)


@pytest.mark.parametrize("values, field, words", [
    ({"compile_mode": "max-autotune"}, "compile_mode", "without compile"),
    ({"optim": {"name": "adamw", "atan2": False}}, "optim.atan2", "optim.name='adamw'"),
    ({"optim": {"name": "muon", "running_init": False}}, "optim.running_init", "optim.name='muon'"),
    ({"optim": {"name": "adamw", "update_clipping": False}}, "optim.update_clipping", "'ellis-adam'"),
    ({"optim": {"muon_lr": 0.05}}, "optim.muon_lr", "optim.name='ellis-adam'"),
    ({"optim": {"name": "adamw", "muon_split_fused": True}}, "optim.muon_split_fused", "a 'muon' setting"),
    ({"optim": {"atan2": False, "bias_correction": "inside"}}, "optim.bias_correction", "without optim.atan2"),
    ({"optim": {"weight_decay": 0.0, "fully_decoupled_wd": False}}, "optim.fully_decoupled_wd",
     "optim.weight_decay=0"),
    ({"optim": {"update_clipping": False, "eps": 1e-8}}, "optim.eps", "without optim.update_clipping"),
    ({"optim": {"cooldown_fraction": None, "min_lr": 1e-4}}, "optim.min_lr", "without a cool-down"),
    ({"max_steps": 20, "optim": {"warmup_steps": 30}}, "optim.warmup_steps", "longer than the run (max_steps=20)"),
    ({"init_from": "some/model", "preset": "small"}, "preset", "with init_from"),
    ({"init_from": "some/model", "tokenizer_max_bytes": 1000}, "tokenizer_max_bytes", "with init_from"),
    ({"distill_alpha": 0.25}, "distill_alpha", "without a teacher"),
    ({"distill_temperature": 2.0}, "distill_temperature", "without a teacher"),
    ({"teacher": "t", "distill_alpha": 0.0}, "teacher", "distill_alpha=0"),
    ({"teacher": "t", "distill_alpha": 0.0, "teacher_depth": 8}, "teacher_depth", "distill_alpha=0"),
    ({"depth_curriculum_start": 2.0}, "depth_curriculum_start", "without depth_curriculum"),
    ({"depth_scheme": "uniform", "depth_sigma": 0.3}, "depth_sigma", "depth_scheme='uniform'"),
    ({"depth_scheme": "fixed", "depth_per_rank": True}, "depth_per_rank", "depth_scheme='fixed'"),
    ({"baseline": True, "depth_scheme": "uniform"}, "depth_scheme", "with baseline"),
])
def test_a_setting_the_run_never_reads_warns_in_one_line_naming_it_and_its_value(values, field, words):
    found = unused(**values)
    assert field in fields_of(found)
    message = str(found[fields_of(found).index(field)])
    name = field.removeprefix("optim.")
    value = values.get(name, values.get("optim", {}).get(name))
    assert message.startswith(f"TrainConfig.{field}={value!r} ") and words in message and "\n" not in message


def test_defaults_and_every_optimizer_preset_warn_nothing():
    assert unused() == []
    for preset in OPTIM_PRESETS:  # as a mapping, as an OptimConfig, and as a resumed run's recorded recipe
        for optim in ({"preset": preset}, OptimConfig.from_preset(preset),
                      OptimConfig.from_dict(OptimConfig.from_preset(preset).to_dict())):
            assert unused(optim=optim, max_steps=3) == [], preset  # (a preset's warmup longer than a short run)
    # a preset's own values are not the user's: k2-muon's Muon settings under another optimizer stay quiet
    assert unused(optim={"preset": "k2-muon", "name": "adamw"}) == []
    assert unused(optim=OptimConfig.from_preset("k2-muon", name="adamw")) == []


def test_a_setting_at_its_default_or_read_by_the_run_warns_nothing():
    assert unused(compile_mode="default", optim={"name": "adamw", "atan2": True}) == []
    assert unused(compile=True, compile_mode="max-autotune") == []
    assert unused(optim={"name": "muon", "muon_lr": 0.05, "atan2": True}) == []
    assert unused(teacher="t", distill_alpha=0.3, distill_temperature=2.0, teacher_depth=4) == []
    assert unused(depth_curriculum=0.5, depth_curriculum_start=2.0) == []
    assert unused(max_steps=30, optim={"warmup_steps": 30}) == []  # (the last step reaches the peak)
    # an OptimConfig of the caller's own: its values against the class defaults
    assert fields_of(unused(optim=OptimConfig(name="adamw", lr=1e-3, atan2=False))) == ["optim.atan2"]


def test_the_warning_points_at_the_line_that_built_the_config():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TrainConfig(compile_mode="max-autotune")
    assert [Path(w.filename).name for w in caught] == [Path(__file__).name]


def test_derived_configs_warn_only_what_they_add(recwarn):
    warnings.simplefilter("always")
    cfg = TrainConfig(init_from="some/model", compile_mode="max-autotune", optim={"name": "adamw", "muon_lr": 0.1})
    assert len(recwarn) == 2
    recwarn.clear()
    cfg.replace(seed=3).with_optim_for(lora=True)  # what a run from a model directory derives
    cfg.with_optim_preset("finetune-lora")
    # resuming: the recipe the checkpoint records, the run's optim settings on top (its preset's values quiet)
    TrainConfig(init_from="some/model", max_steps=2, optim={"name": "adamw"}).with_optim_for(
        lora=None, resumed=OptimConfig.from_dict(OPTIM_PRESETS["demo"].to_dict()))
    assert len(recwarn) == 0
    with pytest.warns(UnusedSettingWarning, match="depth_sigma=0.2") as caught:
        cfg.replace(depth_scheme="fixed", depth_sigma=0.2)
    assert len(caught) == 1


def test_only_rank_zero_warns(monkeypatch, recwarn):
    warnings.simplefilter("always")
    monkeypatch.setenv("RANK", "1")  # (torchrun: every rank builds the same config)
    TrainConfig(compile_mode="max-autotune")
    assert len(recwarn) == 0
    monkeypatch.setenv("RANK", "0")
    TrainConfig(compile_mode="max-autotune")
    assert len(recwarn) == 1


def test_rdepth_train_prints_each_once(capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # (not the default filter's once-per-location: the command's own count)
        assert main(["train", "--max-steps", "3", "--compile-mode", "max-autotune", "--optimizer", "adamw",
                     "--muon-lr", "0.1", "--print-config"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert lines == [
        "rdepth train: warning: TrainConfig.compile_mode='max-autotune' has no effect without compile",
        "rdepth train: warning: TrainConfig.optim.muon_lr=0.1 has no effect with optim.name='adamw' "
        "(a 'muon' setting)",
    ]


def test_every_setting_in_the_table_is_a_field():
    train = {f.name for f in fields(TrainConfig)}
    optim = {f.name for f in fields(OptimConfig)}
    for name in SETTING_NEEDS:
        assert (name[len("optim."):] in optim) if name.startswith("optim.") else (name in train), name
