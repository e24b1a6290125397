"""`rdepth analyze` follow-ups: links in --out, refusals before the progress line, --tokens in the order typed, an
odd number of PCA components, a bounded PCA figure."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.analysis import plots, report
from recurrent_depth.analysis.report import AnalysisConfig, analyze, analyze_to_dir
from recurrent_depth.cli import main
from tests.test_analysis_s36 import FAST, model  # noqa: F401 - (a fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = ["--steps", "8", "--limit-steps", "8", "--starts", "2", "--threads", "1"]


@pytest.fixture
def no_rendering(monkeypatch):
    """PNG bytes without drawing them (drawing is most of a run's time; nothing here looks at the pixels)."""
    monkeypatch.setattr(report, "_png", lambda fig: b"\x89PNG this run")


@pytest.fixture(scope="module")
def short_model_dir(tmp_path_factory) -> Path:
    """A saved tiny model whose max_seq_len is 4."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("analysis2") / "model"
    rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", max_seq_len=4)).eval().save_pretrained(path)
    return path


def test_links_in_out_are_replaced_never_written_through(model, tmp_path, no_rendering):  # noqa: F811 - (a fixture)
    """analysis.json linked to a user's file: the run overwrote that file with its JSON (and likewise a PNG, the
    page, a trajectory file in OUT/states, a temporary file's name)."""
    out = tmp_path / "out"
    (out / "states").mkdir(parents=True)
    names = ["analysis.json", "report.html", "convergence.png", "analysis.json.tmp", "states/raw_states.npy"]
    victims = {}
    for k, name in enumerate(names):
        victims[name] = tmp_path / f"user{k}"
        victims[name].write_text(f"user file {k}\n")
        os.symlink(victims[name], out / name)
    analyze_to_dir(model, [5, 6, 7], out, config=AnalysisConfig(**FAST))
    assert {name: victim.read_text() for name, victim in victims.items()} == {
        name: f"user file {k}\n" for k, name in enumerate(names)}
    for name in ("analysis.json", "report.html", "convergence.png", "states/raw_states.npy"):
        assert not (out / name).is_symlink() and (out / name).is_file(), name
    assert (out / "convergence.png").read_bytes() == b"\x89PNG this run"
    assert not (out / "analysis.json.tmp").exists() and not (out / "analysis.json.tmp").is_symlink()


@pytest.mark.parametrize("save_states", [True, False])
def test_a_linked_states_dir_is_refused_and_its_target_untouched(model, tmp_path, no_rendering, save_states):  # noqa: F811 - (a fixture)
    """OUT/states linked to another directory: the run wrote its trajectory there, and with --no-states removed
    the trajectory files it found there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "trajectory.json").write_text("{}\n")
    (elsewhere / "raw_states.npy").write_bytes(b"kept")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(elsewhere, out / "states")
    with pytest.raises(ValueError, match=r"states is a symbolic link \(a symlink to .*elsewhere\): the trajectory"):
        analyze_to_dir(model, [5, 6, 7], out, config=AnalysisConfig(**FAST, save_states=save_states))
    assert sorted(p.name for p in elsewhere.iterdir()) == ["raw_states.npy", "trajectory.json"]
    assert (elsewhere / "raw_states.npy").read_bytes() == b"kept"
    assert not (out / "analysis.json").exists()


@pytest.mark.parametrize(("flags", "error"), [
    (["--ids", "5"], "the prompt has 1 token; the analysis compares tokens"),
    (["--ids", "5,6", "--tokens", "3"], r"tokens=\[3\] \(--tokens\) has positions \[3\] outside the prompt's 0..1"),
    (["--ids", "1,2,3,4,5"], "the prompt has 5 tokens but the model's max_seq_len is 4"),
    (["--ids", "1,2,3", "--max-tokens", "2"], r"more than max_tokens=2 \(--max-tokens\)"),
])
def test_a_refused_prompt_prints_no_progress_line(short_model_dir, tmp_path, capsys, flags, error):
    """"analysing 1 tokens, ..." was printed just above the one-token refusal (a bad --tokens, a prompt over
    max_seq_len too)."""
    out = tmp_path / "out"
    code = main(["analyze", "--model", str(short_model_dir), *flags, *STEPS, "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2 and re.search(error, captured.err), captured.err
    assert "analysing" not in captured.out
    assert not out.exists()


def test_a_linked_states_dir_is_refused_before_the_progress_line(short_model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(tmp_path, out / "states")
    code = main(["analyze", "--model", str(short_model_dir), "--ids", "1,2,3", *STEPS, "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2 and "states is a symbolic link" in captured.err and "analysing" not in captured.out


def test_tokens_keep_the_order_typed(model):  # noqa: F811 - (a fixture)
    """--tokens 4,1,3,2 was sorted: the PCA rows and path independence's "first 3" were 1, 2, 3, not 4, 1, 3."""
    result = analyze(model, [5, 6, 7, 8, 9, 10], config=AnalysisConfig(**FAST, tokens=[4, 1, 4, 3, 2]))
    assert result.chosen == [4, 1, 3, 2]
    assert list(result.projected) == [4, 1, 3, 2]
    assert list(result.path.paths) == [4, 1, 3]
    assert result.to_json_dict()["chosen_tokens"] == [4, 1, 3, 2]


def test_an_odd_number_of_components_draws_the_last_one(model):  # noqa: F811 - (a fixture)
    """pca_components=3 drew PC1-PC2 only: the third component was never plotted."""
    assert plots.component_pairs(6) == [(0, 1), (2, 3), (4, 5)]
    assert plots.component_pairs(5) == [(0, 1), (2, 3), (3, 4)]
    assert plots.component_pairs(1) == [(0, 0)]
    result = analyze(model, [5, 6, 7, 8], config=AnalysisConfig(**FAST, pca_components=3))
    assert result.pca.num_components == 3
    kinds = [s.kind for s in result.shapes]
    fig = plots.plot_pca_trajectories(result.projected, result.labels, kinds, result.pca)
    labels = {ax.get_xlabel().split()[0] + "-" + ax.get_ylabel().split()[0] for ax in fig.axes if ax.get_xlabel()}
    assert labels == {"PC1-PC2", "PC2-PC3"}


def test_the_pca_figure_has_a_bounded_number_of_rows(tmp_path, capsys):
    """--max-plot-tokens 230 on a 230-token prompt drew for 3 minutes a PNG 76,010 pixels tall."""
    most = plots.MAX_PCA_ROWS
    AnalysisConfig(max_plot_tokens=most, tokens=list(range(most)) + [0]).validate()  # (a repeat is one row)
    with pytest.raises(ValueError, match=rf"max_plot_tokens={most + 1} is invalid: expected an integer from 1 to "
                                         rf"{most} \(the PCA figure draws one row"):
        AnalysisConfig(max_plot_tokens=most + 1).validate()
    with pytest.raises(ValueError, match=rf"expected at most {most} different positions"):
        AnalysisConfig(tokens=list(range(most + 1))).validate()
    code = main(["analyze", "--model", "nowhere", "--ids", "1,2", "--max-plot-tokens", "230", "--out",
                 str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "--max-plot-tokens=230 is invalid" in err
    with pytest.raises(SystemExit):
        main(["analyze", "--help"])
    assert re.search(rf"--max-plot-tokens.*1\s+to\s+{most}\b", capsys.readouterr().out, re.S)  # (the limit)
