"""The `rdepth` entry point: dispatch, --help, and the `info` command."""

import json

import pytest

from recurrent_depth.cli import main


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


def test_bad_preset_is_a_clean_error(capsys):
    assert main(["info", "--preset", "nope"]) == 2
    assert "unknown preset" in capsys.readouterr().err


def test_help_shows_defaults():
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "--help"])
    assert exit_info.value.code == 0
