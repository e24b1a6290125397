"""`rdepth analyze` / `analyze()` on user paths that gave wrong numbers or unhelpful errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.analysis.report import AnalysisConfig, analyze, analyze_to_dir
from recurrent_depth.cli import main

FAST = dict(num_starts=2, max_plot_tokens=2)

# Tiny matmuls run fastest on one thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> rd.RecurrentDepthLM:
    torch.manual_seed(0)
    return rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny")).eval()


def test_limit_at_the_last_step_does_not_count_every_token_as_converged(model):
    """With --limit-steps = --steps, s* is step S itself, so every token was "converged at S": the report
    read "converged within S steps: T of T" for any model. Only a stay that starts before S counts."""
    result = analyze(model, [5, 77, 120, 9, 31], config=AnalysisConfig(num_steps=8, limit_steps=8, **FAST))
    relative = result.distance / np.linalg.norm(result.trajectory.limit[0], axis=-1)[:, None]
    assert (result.distance[:, -1] == 0).all()
    for t, row in enumerate(relative):  # reference: the first step i < S from which row[i:] stays within tol
        within = [i for i in range(8) if (row[i:] <= result.config.converge_tol).all()]
        assert result.converged_at[t] == (within[0] if within else -1)
    assert (result.converged_at < 8).all()


def test_zero_init_run_measures_path_independence_at_the_models_own_scale():
    """--init-scale 0 made path independence start from scale 1.0, far from Parcae's like-init 1/sqrt(h)."""
    torch.manual_seed(0)
    small = rd.RecurrentDepthLM(rd.ModelConfig.from_preset("tiny", init_scale=0.125)).eval()
    result = analyze(small, [5, 77, 120], config=AnalysisConfig(num_steps=8, limit_steps=8, init_scale=0, **FAST))
    assert result.config.init_scale == 0.0 and result.path.init_scale == 0.125


def test_too_large_in_memory_run_says_how_to_keep_states_on_disk(model, tmp_path):
    """Without saved states the refusal said "pass out_dir=...", a parameter neither analyze nor the CLI has."""
    config = AnalysisConfig(num_steps=2_000_000, limit_steps=2_000_000, save_states=False, **FAST)
    with pytest.raises(ValueError, match=r"needs 1953 MiB, .*without --no-states") as info:
        analyze_to_dir(model, [5, 77], tmp_path / "out", config=config)
    assert "out_dir" not in str(info.value)


def test_cli_token_positions_outside_the_prompt_name_the_flag(model, tmp_path: Path, capsys):
    model.save_pretrained(tmp_path / "m")
    code = main(["analyze", "--model", str(tmp_path / "m"), "--ids", "5,77,120", "--tokens", "1,9", "--steps", "8",
                 "--limit-steps", "8", "--starts", "2", "--no-states", "--out", str(tmp_path / "o")])
    assert code == 2
    assert "tokens=[1, 9] (--tokens) has positions [9] outside the prompt's 0..2" in capsys.readouterr().err


def test_cli_analyses_the_weight_quantized_model(model, tmp_path: Path):
    """`rdepth analyze --weights int8` (as generate, eval and serve take it): the report is the quantized model's,
    and says so; it was an unrecognized argument."""
    import json

    model.save_pretrained(tmp_path / "m")
    reports = {}
    for weights in (None, "int8"):
        out = tmp_path / f"o-{weights}"
        argv = ["analyze", "--model", str(tmp_path / "m"), "--ids", "5,77,120,9", "--steps", "8", "--limit-steps",
                "8", "--starts", "2", "--no-states", "--out", str(out)]
        assert main(argv + ([] if weights is None else ["--weights", weights])) == 0
        reports[weights] = json.loads((out / "analysis.json").read_text())
    assert reports["int8"]["model"]["weights"] == "int8" and "weights" not in reports[None]["model"]
    entropy = [[t["entropy"] for t in r["tokens"]] for r in reports.values()]
    assert entropy[0] != entropy[1]  # (int8 rounding reaches the numbers)
