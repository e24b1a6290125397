"""The `rdepth` entry point: dispatch, --help, and the `info` command."""

import json
import sys

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.cli import COMMANDS, main
from recurrent_depth.model.cache import DynamicCache


def test_top_level_help_lists_commands(capsys):
    assert main([]) == 0
    assert "info" in capsys.readouterr().out


def test_info_on_the_huginn_preset(capsys):
    assert main(["info", "--preset", "huginn-0125", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["unique_parameters"] == 3_564_976_800
    assert info["layers_at_mean_recurrence"] == 132


def test_info_on_a_saved_model(tiny_model, tmp_path, capsys):
    tiny_model.save_pretrained(tmp_path)
    assert main(["info", "--model", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["hidden_size"] == 64


def test_info_on_a_run_directory_uses_its_model(tiny_model, tmp_path, capsys):
    """Every other --model takes a run directory (its model/); info said "no config file at RUN/config.json"."""
    tiny_model.save_pretrained(tmp_path / "run" / "model")
    assert main(["info", "--model", str(tmp_path / "run"), "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["config"]["hidden_size"] == 64
    assert "is a run directory" in captured.err


def test_bad_preset_is_a_clean_error(capsys):
    assert main(["info", "--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err


def test_help_shows_defaults():
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "--help"])
    assert exit_info.value.code == 0


def _info_for(config, tmp_path, capsys) -> dict:
    config.to_json(tmp_path / "config.json")
    assert main(["info", "--model", str(tmp_path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "overrides",
    [{"mixer": {"core": "gated_deltanet"}}, {"mixer": "mla"}, {"bias": True}, {"num_kv_heads": 2}],
    ids=["gdn-core", "mla", "bias", "gqa"],
)
def test_info_counts_the_parameters_of_the_real_model(overrides, tmp_path, capsys):
    config = rd.ModelConfig.from_preset("tiny", **overrides)
    info = _info_for(config, tmp_path, capsys)
    assert info["unique_parameters"] == rd.RecurrentDepthLM(config).num_parameters()


@pytest.mark.parametrize(
    "overrides", [{}, {"mixer": {"core": "gla"}}, {"mixer": "mla"}], ids=["attention", "gla-core", "mla"]
)
def test_info_cache_bytes_match_a_real_bf16_cache(overrides, tmp_path, capsys):
    config = rd.ModelConfig.from_preset("tiny", max_seq_len=24, **overrides)
    info = _info_for(config, tmp_path, capsys)
    torch.manual_seed(0)
    model = rd.RecurrentDepthLM(config).to(torch.bfloat16).eval()

    def cache_nbytes(tokens: int) -> int:
        cache = DynamicCache()
        with torch.no_grad():
            model(torch.randint(0, 256, (1, tokens)), num_steps=config.mean_recurrence, cache=cache, init_scale=0.0)
        return cache.nbytes()

    full, short = cache_nbytes(24), cache_nbytes(12)
    assert info["cache_bytes_at_max_seq_len_bf16"] == full
    assert info["kv_cache_bytes_per_token_bf16"] == (full - short) // 12


def test_info_model_must_be_a_directory(tmp_path, capsys):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x9d\xff not json")
    assert main(["info", "--model", str(weights)]) == 2
    err = capsys.readouterr().err
    assert "is not a directory" in err and str(weights) in err
    (tmp_path / "config.json").write_bytes(b"\xff\xfe{")
    assert main(["info", "--model", str(tmp_path)]) == 2
    assert str(tmp_path / "config.json") in capsys.readouterr().err


def test_info_on_a_lora_run_says_it_is_an_adapter(tmp_path, capsys):
    """It said only "no config file at RUN/config.json", where generate and serve name the adapter."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "adapter_config.json").write_text("{}")
    assert main(["info", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in err if "error" in line]) == 1
    assert err[-1].startswith(f"rdepth info: error: --model {tmp_path} has no config.json") and \
        "it is a LoRA adapter (adapter_config.json)" in err[-1]


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "lm-eval"])
def test_every_command_help_exits_cleanly(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert f"rdepth {command}" in capsys.readouterr().out



@pytest.mark.parametrize(
    "command", ["average", "export"], ids=["average-out-is-a-file", "export-out-under-a-file"]
)
def test_an_unusable_out_path_is_a_clean_error(command, tiny_model, tmp_path, capsys):
    model_dir, blocker = tmp_path / "model", tmp_path / "file"
    tiny_model.save_pretrained(model_dir)
    blocker.write_text("not a directory")
    argv = {
        "average": ["average", "--checkpoints", str(model_dir), "--out", str(blocker)],
        "export": ["export", "--model", str(model_dir), "--out", str(blocker / "sub")],
    }[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"rdepth {command}: error:") and str(blocker) in err


def test_ctrl_c_is_a_one_line_exit_130(monkeypatch, capsys):
    import recurrent_depth.cli.info as info

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(info, "run", interrupted)
    assert main(["info", "--preset", "tiny"]) == 130
    assert capsys.readouterr().err == "rdepth info: interrupted\n"
    # (and while the command's modules import, before it runs: that was a KeyboardInterrupt traceback)
    import recurrent_depth.cli as cli

    def importing(only):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", importing)
    assert main(["info", "--preset", "tiny"]) == 130
    assert capsys.readouterr().err == "rdepth: interrupted\n"


def test_a_missing_optional_dependency_is_a_clean_error(tmp_path, monkeypatch, capsys):
    from tokenizers import Tokenizer, models

    model_dir = tmp_path / "model"
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).save_pretrained(model_dir)
    Tokenizer(models.BPE()).save(str(model_dir / "tokenizer.json"))
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if lm-eval were not installed
    argv = ["eval", "--model", str(model_dir), "--data", "none", "--lm-eval-tasks", "rd_chains_mc",
            "--depths", "1", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after the line saying the thread count
    assert err.startswith("rdepth eval: error:") and "lm_eval" in err and "pip install" in err
