"""`rdepth lm-eval run --model recurrent-depth`: bad model_args are refused before lm-eval starts (its task
index alone takes 10+ s), with the backend's own one-line messages."""

from __future__ import annotations

import pytest

from recurrent_depth.cli import main
from tests.test_hf import make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("preflight-model")
    make_model_dir(path, max_seq_len=160)
    return path


@pytest.fixture
def reached(monkeypatch):
    """lm-eval's CLI replaced by a recorder: a pre-flight error must come without it."""
    import lm_eval.__main__

    calls: list[int] = []
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: calls.append(1))
    return calls


def last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_bad_model_args_are_refused_before_lm_eval_runs(model_dir, reached, capsys):
    run = ["lm-eval", "run", "--model", "recurrent-depth", "--tasks", "rd_chains_mc"]
    # every spelling of --model_args that lm-eval's parser takes
    for model_args in (["--model_args", f"pretrained={model_dir},num_steps=-1"],
                       [f"--model_args=pretrained={model_dir},num_steps=-1"],
                       ["-a", f"pretrained={model_dir}", "num_steps=-1"]):
        assert main([*run, *model_args]) == 2
        assert last_error(capsys) == "rdepth lm-eval: error: num_steps=-1 is invalid: expected an integer >= 0"
    assert main([*run, "--model_args", f"pretrained={model_dir / 'missing'}"]) == 2
    assert last_error(capsys) == (f"rdepth lm-eval: error: pretrained={model_dir / 'missing'}: no such directory "
                                  "(expected a saved model directory)")
    assert main([*run, "--model_args", f"pretrained={model_dir},dtype=float33"]) == 2
    assert last_error(capsys).startswith("rdepth lm-eval: error: dtype='float33' is invalid: expected one of [")
    assert main([*run, "--model_args", f"pretrained={model_dir},exit_criterion=klx"]) == 2
    assert "exit_criterion" in last_error(capsys)
    assert main([*run, "--model_args", f"pretrained={model_dir},seed=x"]) == 2
    assert last_error(capsys) == "rdepth lm-eval: error: seed='x' is invalid: expected an integer"
    assert reached == []


def test_good_args_and_other_models_go_to_lm_eval_unchecked(model_dir, reached):
    run = ["lm-eval", "run", "--tasks", "rd_chains_mc"]
    ours = f"pretrained={model_dir},num_steps=2,mean_recurrence=3,exit_criterion=kl,attn_implementation=eager"
    assert main([*run, "--model", "recurrent-depth", "--model_args", ours]) == 0
    # lm-eval's other backends are lm-eval's to check; --config files too (lm-eval merges them)
    assert main([*run, "--model", "hf", "--model_args", f"pretrained={model_dir},num_steps=-1"]) == 0
    assert main([*run, "--model_args", f"pretrained={model_dir / 'missing'}"]) == 0  # (lm-eval's default: hf)
    assert len(reached) == 3
