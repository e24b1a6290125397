"""TrainConfig: defaults, YAML + flag precedence, validation messages, `rdepth train` flags."""

import json
from pathlib import Path

import pytest

from recurrent_depth.cli import build_parser, main
from recurrent_depth.cli.train import config_from_args
from recurrent_depth.train.config import TrainConfig


def test_defaults_are_valid_and_round_trip():
    cfg = TrainConfig()
    again = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg


@pytest.mark.parametrize(
    "mean, expected",
    [(32, [1, 4, 8, 16, 32, 64]), (8, [1, 2, 4, 8, 16]), (4, [1, 2, 4, 8])],
    ids=["paper-r32", "small-r8", "tiny-r4"],
)
def test_default_eval_depths_scale_with_the_run(mean, expected):
    assert TrainConfig().resolved_eval_depths(mean) == expected


def test_baseline_evaluates_one_pass_by_default():
    assert TrainConfig(baseline=True).resolved_eval_depths(8) == [1]


def test_yaml_then_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "preset: small\nmodel: {hidden_size: 128, num_heads: 4}\nseq_len: 128\n"
        "optim: {name: muon, lr: 0.002}\neval_depths: [1, 8]\n"
    )
    cfg = TrainConfig.from_sources(path, {"seq_len": 64, "model": {"core_layers": 1}, "optim": {"lr": 0.001}})
    assert cfg.preset == "small" and cfg.seq_len == 64 and cfg.eval_depths == [1, 8]
    assert cfg.model == {"hidden_size": 128, "num_heads": 4, "core_layers": 1}
    assert cfg.optim.name == "muon" and cfg.optim.lr == 0.001
    model_cfg = cfg.model_config(vocab_size=512)
    assert (model_cfg.hidden_size, model_cfg.core_layers, model_cfg.vocab_size) == (128, 1, 512)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"preset": "huge"}, "preset"),
        ({"dtype": "float16"}, "dtype"),
        ({"val_fraction": 0.0}, "val_fraction"),
        ({"eval_depths": []}, "eval_depths"),
        ({"max_minutes": -1}, "max_minutes"),
        ({"depth_scheme": "geometric"}, "depth_scheme"),
        ({"model": {"hidden_sise": 3}}, "hidden_sise"),
        ({"compile": "yes"}, "compile"),
        ({"compile_mode": "fastest"}, "compile_mode"),
        # checked up front, not after the tokenizer and the shards are built
        ({"depth_scheme": "fixed", "mean_recurrence": 2.5}, "TrainConfig.mean_recurrence=2.5"),
        ({"depth_scheme": "uniform", "mean_recurrence": 3.5}, "TrainConfig.mean_recurrence=3.5"),
        # FSDP2 gathers the core block at every recurrence step: a depth per rank hung torchrun in the first step
        ({"fsdp": True, "depth_per_rank": True}, "TrainConfig.depth_per_rank=True"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_values_name_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        TrainConfig(**changes)


@pytest.mark.parametrize(
    "model, message",
    [
        ({"hidden_size": "abc"}, "TrainConfig.model.hidden_size='abc'"),  # was a TypeError from ModelConfig
        ({"rope_base": "fast"}, "TrainConfig.model.rope_base='fast'"),
        ({"qk_bias": 2}, "TrainConfig.model.qk_bias=2"),  # was silently truthy
        ({"mixer": 5}, "TrainConfig.model.mixer=5"),
        ({"hidden_size": -3}, "ModelConfig.hidden_size=-3"),  # was only found after training a tokenizer
        ({"num_heads": 3}, "ModelConfig.num_heads=3"),
    ],
    ids=["str-int", "str-float", "int-bool", "int-mixer", "negative", "not-a-divisor"],
)
def test_model_overrides_are_checked_up_front(model, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        TrainConfig(model=model)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model": {"mixer": {"core": "nope"}}}, "unknown mixer 'nope' for the core"),
        ({"model": {"mixer_options": {"bogus": 1}}}, r"mixer_options \['bogus'\] are not options"),
        ({"model": {"mixer": {"core": "gla"}, "qk_norm": True}}, "qk_norm=True is implemented by the 'attention'"),
        ({"model": {"mixer": {"core": "gla"}}, "qk_clip": 5.0}, "QK-clip / max-logit recording needs softmax"),
        ({"model": {"mixer": {"core": "gla"}}, "record_max_logit": True}, "QK-clip / max-logit recording"),
    ],
    ids=["mixer-name", "mixer-option", "qk-norm-on-gla", "qk-clip-on-gla", "record-on-gla"],
)
def test_what_the_model_constructor_refuses_is_refused_by_the_config(changes, message):
    """These were found only when the Trainer built the model: after training a tokenizer and packing shards."""
    with pytest.raises(ValueError, match=message):
        TrainConfig(**changes)


def test_model_overrides_that_fit_pass_and_token_ids_wait_for_the_tokenizer():
    cfg = TrainConfig(model={"num_kv_heads": None, "rope_base": 10000, "mixer": {"core": "gla"},
                             "eos_token_id": 300})  # 300 >= tiny's 256: the tokenizer sets the vocab later
    assert cfg.model["eos_token_id"] == 300


def test_yaml_numbers_in_exponent_form_are_numbers(tmp_path):
    """PyYAML reads `3e-3` (no dot) as a string; a config must read it as 0.003 (as YAML 1.2 does)."""
    path = tmp_path / "run.yaml"
    path.write_text("optim: {lr: 3e-3, weight_decay: 1E-4}\ndepth_sigma: 5e-1\nname_like: 1e3x\n")
    with pytest.raises(ValueError, match="name_like"):  # still a string, so still an unknown key
        TrainConfig.from_yaml(path)
    path.write_text("optim: {lr: 3e-3, weight_decay: 1E-4}\ndepth_sigma: 5e-1\n")
    cfg = TrainConfig.from_yaml(path)
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.depth_sigma) == (0.003, 0.0001, 0.5)
    args = build_parser("train").parse_args(["train", "--model-set", "rope_base=1e4"])
    assert config_from_args(args).model == {"rope_base": 10000.0}


def test_invalid_yaml_is_a_one_line_error(tmp_path, capsys):
    """PyYAML's message spans seven lines (context, the line, a caret); `rdepth sweep` already joined them."""
    path = tmp_path / "run.yaml"
    path.write_text("preset: tiny\nmax_steps: [1\n")
    assert main(["train", "--config", str(path), "--print-config"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error" in line or line.startswith(" ")]
    assert len(lines) == 1 and "is not valid YAML: while parsing a flow sequence" in lines[0]
    with pytest.raises(SystemExit):
        main(["train", "--model-set", "hidden_size=[1", "--print-config"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rdepth train: error: argument --model-set") and "expected ','" in err[-1]


def test_a_config_path_that_is_a_directory_is_a_clean_error(tmp_path, capsys):
    assert main(["train", "--config", str(tmp_path), "--print-config"]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_integral_mean_recurrence_is_fine_for_every_scheme():
    assert TrainConfig(depth_scheme="fixed", mean_recurrence=4.0).mean_recurrence == 4.0
    assert TrainConfig(depth_scheme="poisson-lognormal", mean_recurrence=2.5).mean_recurrence == 2.5


def test_a_budget_is_required():
    with pytest.raises(ValueError, match="budget"):
        TrainConfig(max_steps=None)


def test_unknown_yaml_key_is_reported(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("max_step: 10\n")
    with pytest.raises(ValueError, match="max_step"):
        TrainConfig.from_yaml(path)


def test_vocab_disagreeing_with_the_tokenizer_is_an_error():
    with pytest.raises(ValueError, match="vocab"):
        TrainConfig(model={"vocab_size": 300}).model_config(vocab_size=512)


def test_cli_flags_override_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("preset: tiny\nmax_steps: 50\nbatch_size: 2\noptim: {name: adamw}\n")
    args = build_parser("train").parse_args(
        ["train", "--config", str(path), "--max-steps", "7", "--eval-depths", "1,3", "--compile",
         "--compile-mode", "max-autotune-no-cudagraphs", "--model-set", "hidden_size=32", "--lr", "0.01",
         "--seed", "5", "--muon-ns-dtype", "float32"]
    )
    cfg = config_from_args(args)
    assert (cfg.max_steps, cfg.batch_size, cfg.eval_depths, cfg.compile, cfg.seed) == (7, 2, [1, 3], True, 5)
    assert cfg.optim.muon_ns_dtype == "float32"
    assert cfg.compile_mode == "max-autotune-no-cudagraphs"
    assert cfg.model == {"hidden_size": 32}
    assert (cfg.optim.name, cfg.optim.lr) == ("adamw", 0.01)


def test_train_help_shows_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "--max-steps" in text and "(default: 1000)" in text and "(default: poisson-lognormal)" in text
    # a literal % in a field's help is printed as is, not as argparse's internal dict
    flat = " ".join(text.split())  # argparse wraps lines at the terminal width
    assert "~25% slower" in flat and "option_strings" not in flat
    assert "demo, demo-muon, k2-muon, finetune, finetune-lora or huginn-0125" in flat
    assert "(default: 0.003; from --init-from 1e-05, with --lora 0.0001)" in flat  # --lr


def test_print_config(capsys):
    assert main(["train", "--preset", "small", "--max-steps", "3", "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["preset"] == "small" and printed["max_steps"] == 3


def test_bad_flag_value_is_a_clean_error(capsys):
    assert main(["train", "--batch-size", "0", "--print-config"]) == 2
    assert "batch_size" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted((Path(__file__).parent.parent / "examples").glob("train_*.yaml")),
                         ids=lambda p: p.name)
def test_example_configs_load(path):
    cfg = TrainConfig.from_yaml(path)
    assert cfg.out.startswith("runs/")


def test_compile_core_compiles_each_core_block_with_the_mode(monkeypatch):
    """Compiling is slow on CPU; record the calls instead (the compiled path's numerics are torch's)."""
    import torch

    import recurrent_depth as rd
    from recurrent_depth.train.trainer import compile_core

    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: calls.append((type(self).__name__, kw)))
    model = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny"))
    compile_core(model, "max-autotune-no-cudagraphs")
    assert len(calls) == model.config.core_layers
    assert all(kw == {"dynamic": False, "mode": "max-autotune-no-cudagraphs"} for _, kw in calls)
