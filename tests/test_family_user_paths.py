"""The other looped-family models (Parcae, Ouro, retrofitted) through the user's commands, where they differ
from Huginn in a way a command must honour.

Parcae's s_0 scale is a config value (`init_scale` = 1/sqrt(h) for its like-init, 0 for its zero init, against
Huginn's 1): the analysis must draw what the model's forward draws, not Huginn's scale.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import recurrent_depth as rd
from recurrent_depth.analysis.path_independence import path_independence
from recurrent_depth.analysis.trajectory import collect_trajectory
from recurrent_depth.cli import main

PARCAE = Path(__file__).parent / "goldens" / "parcae" / "released-layout"

pytestmark = pytest.mark.usefixtures("one_thread")


def parcae(tmp_path: Path, **changes: object) -> Path:
    """A copy of the tiny Parcae golden with config.json keys changed."""
    out = tmp_path / "parcae"
    shutil.copytree(PARCAE, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **changes}))
    return out


def test_the_trajectory_of_a_parcae_model_is_its_forwards(tmp_path):
    """collect_trajectory drew s_0 at Huginn's scale 1 whatever the config said: sqrt(h) times Parcae's like-init
    s_0, and a random s_0 for a zero-init Parcae model whose forward starts from 0."""
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    for state_init, scale in (("like-init", 1 / math.sqrt(32)), ("zero", 0.0)):
        model = rd.RecurrentDepthLM.from_pretrained(parcae(tmp_path / state_init, state_init=state_init),
                                                    dtype=torch.float32).eval()
        assert model.config.init_scale == pytest.approx(scale)
        traj = collect_trajectory(model, ids, 3, seed=7, with_predictions=False)
        with torch.no_grad():
            out = model(ids, 3, generator=torch.Generator().manual_seed(7), output_all_states=True)
        np.testing.assert_allclose(traj.raw, out.all_states.numpy(), atol=1e-5, rtol=0)
        assert traj.init_scale == pytest.approx(scale)


def test_path_independence_reads_the_config_scale_and_refuses_a_zero_one(tmp_path):
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    like = rd.RecurrentDepthLM.from_pretrained(parcae(tmp_path / "a"), dtype=torch.float32).eval()
    assert path_independence(like, ids, 2, seeds=[1, 2]).init_scale == pytest.approx(1 / math.sqrt(32))
    zero = rd.RecurrentDepthLM.from_pretrained(parcae(tmp_path / "b", state_init="zero"), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"init_scale=0\.0 is invalid: path independence needs random starts"):
        path_independence(zero, ids, 2, seeds=[1, 2])


def test_rdepth_analyze_records_the_parcae_scale(tmp_path, capsys):
    model = parcae(tmp_path)
    out = tmp_path / "analysis"
    assert main(["analyze", "--model", str(model), "--ids", "3,5,7,9", "--out", str(out), "--steps", "8",
                 "--limit-steps", "8", "--starts", "2", "--no-states", "--threads", "1"]) == 0
    report = json.loads((out / "analysis.json").read_text())
    assert report["config"]["init_scale"] == pytest.approx(1 / math.sqrt(32))
    assert main(["analyze", "--model", str(model), "--ids", "3,5,7,9", "--out", str(out), "--steps", "8",
                 "--limit-steps", "8", "--starts", "2", "--no-states", "--init-scale", "0.5", "--threads", "1"]) == 0
    assert json.loads((out / "analysis.json").read_text())["config"]["init_scale"] == 0.5
