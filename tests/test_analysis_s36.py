"""`rdepth analyze` / `analyze_to_dir`: runs sharing an output directory, interrupted drawing, an Ouro s_0 scale,
a zero s_0 in the report, a single left-padded row."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.analysis import report
from recurrent_depth.analysis.path_independence import path_independence
from recurrent_depth.analysis.report import FIGURES, AnalysisConfig, analyze, analyze_to_dir
from recurrent_depth.analysis.trajectory import Trajectory, collect_trajectory
from recurrent_depth.cli import main
from recurrent_depth.files import lock_directory

FAST = dict(num_steps=8, limit_steps=8, num_starts=2, max_plot_tokens=1)

# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(0)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()


@pytest.fixture(scope="module")
def earlier(model, tmp_path_factory) -> Path:
    """An output directory holding a complete earlier run on [5, 6, 7] (its figures not rendered: faster)."""
    out = tmp_path_factory.mktemp("analysis") / "out"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(report, "_png", lambda fig: b"\x89PNG earlier")
        analyze_to_dir(model, [5, 6, 7], out, config=AnalysisConfig(**FAST))
    return out


def _report_files(out: Path) -> dict[str, bytes]:
    names = ["analysis.json", "report.html", *(name for name, _ in FIGURES.values())]
    return {name: (out / name).read_bytes() for name in names if (out / name).exists()}


def test_a_second_run_into_a_busy_out_is_refused_and_touches_nothing(model, earlier):
    """Two runs into one OUT (both with the default runs/analysis): the second truncated the first one's
    memory-mapped states under it, and the first died of SIGBUS (exit 135, no message)."""
    before = _report_files(earlier)
    lock = lock_directory(earlier)  # (what a running analysis holds)
    try:
        with pytest.raises(ValueError, match=r"output directory .* is in use by another run"):
            analyze_to_dir(model, [9, 8, 7, 6], earlier, config=AnalysisConfig(**FAST))
    finally:
        lock.close()
    assert _report_files(earlier) == before
    assert Trajectory.load(earlier / "states").input_ids.tolist() == [[5, 6, 7]]


def test_a_run_interrupted_while_drawing_leaves_the_earlier_report_and_no_states(model, earlier, monkeypatch):
    """Ctrl-C while the figures were drawn (most of a run's time) left this run's states beside the earlier
    run's report, with some figures of each: docs/analysis.md promises a failed run leaves no states."""
    before = _report_files(earlier)
    drawn = []

    def png(fig):  # the third figure is interrupted
        drawn.append(fig)
        if len(drawn) == 3:
            raise KeyboardInterrupt
        return b"\x89PNG new"

    monkeypatch.setattr(report, "_png", png)
    with pytest.raises(KeyboardInterrupt):
        analyze_to_dir(model, [9, 8, 7, 6], earlier, config=AnalysisConfig(**FAST))
    assert _report_files(earlier) == before
    assert not (earlier / "states" / "trajectory.json").exists()


def test_a_scale_for_an_embedding_start_is_refused_not_ignored(tmp_path, capsys):
    """An Ouro model starts from its embedding whatever init_scale says: --init-scale 2 ran, ignored, and
    analysis.json recorded init_scale 2.0 for a run that never drew an s_0 (the forward refuses it)."""
    torch.manual_seed(0)
    ouro = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny-ouro")).eval()
    with pytest.raises(ValueError, match=r"init_scale=2\.0 scales a random s_0, but this model starts from its emb"):
        analyze(ouro, [5, 6, 7], config=AnalysisConfig(**FAST, init_scale=2.0))
    with pytest.raises(ValueError, match="starts from its embedding"):
        collect_trajectory(ouro, torch.tensor([[5, 6, 7]]), 2, init_scale=2.0)
    for scale in (None, 0.0, ouro.config.init_scale):  # what the forward accepts too
        collect_trajectory(ouro, torch.tensor([[5, 6, 7]]), 2, init_scale=scale)
    ouro.save_pretrained(tmp_path / "ouro")
    out = tmp_path / "out"
    code = main(["analyze", "--model", str(tmp_path / "ouro"), "--ids", "5,6,7", "--steps", "8", "--limit-steps", "8",
                 "--init-scale", "2", "--threads", "1", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--init-scale=2.0 scales a random s_0" in err and "leave --init-scale unset" in err
    assert not out.exists()
    # (and --ids without an id said "the prompt is empty after tokenization", though nothing was tokenized)
    assert main(["analyze", "--model", str(tmp_path / "ouro"), "--ids", ",", "--threads", "1", "--out", str(out)]) == 2
    assert "--ids holds no token ids" in capsys.readouterr().err


def test_the_report_says_a_zero_s0_is_zeros(model):
    """With --init-scale 0 the settings table read "s0: random, init_scale=0.0, seed=0" for a run from s_0 = 0."""
    result = analyze(model, [5, 6, 7], config=AnalysisConfig(**FAST, init_scale=0))
    assert "<td>s0</td><td>zeros (init_scale=0)</td>" in report.render_html(result, {})
    assert (result.trajectory.raw[0] == 0).all()


def test_a_single_left_padded_row_has_the_states_of_its_prompt_run_alone(model):
    """Only batches of 2+ rows drew each row's s_0 over its real tokens: one padded row drew it over the padded
    length, so its trajectory (and path independence) was not its prompt's, unlike the same row beside another."""
    ids, mask, alone = torch.tensor([[0, 0, 5, 6, 7]]), torch.tensor([[0, 0, 1, 1, 1]]), torch.tensor([[5, 6, 7]])
    padded = collect_trajectory(model, ids, 3, attention_mask=mask, seed=5)
    reference = collect_trajectory(model, alone, 3, seed=5)
    torch.testing.assert_close(torch.from_numpy(padded.states("raw")), torch.from_numpy(reference.states("raw")))
    spread = path_independence(model, ids, 3, seeds=[1, 2], attention_mask=mask).spread
    reference_spread = path_independence(model, alone, 3, seeds=[1, 2]).spread
    torch.testing.assert_close(torch.from_numpy(spread), torch.from_numpy(reference_spread))
