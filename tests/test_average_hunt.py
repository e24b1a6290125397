"""`rdepth average --out` inside a training run's own folders is refused in one line."""

import pytest

import recurrent_depth as rd
from recurrent_depth.cli import main
from tests.test_average import _save_models


def _run_with_checkpoints(run, count=2):
    """A run directory as `rdepth train` leaves it: run.json, model/ and complete step-* checkpoints."""
    run.mkdir()
    (run / "run.json").write_text('{"config": {}}')
    paths, _ = _save_models(run, count)
    rd.RecurrentDepthLM.from_pretrained(paths[-1]).save_pretrained(run / "model")


@pytest.mark.parametrize(
    "inside", ["model", "checkpoints", "checkpoints/step-00000030", "checkpoints/step-00000020/ema", "data"]
)
def test_out_in_a_runs_own_folder_is_refused_in_one_line(tmp_path, capsys, inside):
    """--resume republishes model/ whole and sets aside a step-* it did not write: an average written there was
    lost (or replaced the run's trained model/), and one in checkpoints/ or data/ mixed into the run's files."""
    run = tmp_path / "run"
    _run_with_checkpoints(run)
    model_before = (run / "model" / "model.safetensors").read_bytes()
    out = run / inside
    assert main(["average", "--run", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "a training run's own folder" in err and len(err.splitlines()) == 1
    assert (run / "model" / "model.safetensors").read_bytes() == model_before
    assert not (out / "model.safetensors").exists() or inside == "model"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000010", "step-00000020"]


def test_out_beside_the_runs_folders_is_still_written(tmp_path):
    run = tmp_path / "run"
    _run_with_checkpoints(run)
    assert main(["average", "--run", str(run), "--out", str(run / "ema")]) == 0
    assert rd.RecurrentDepthLM.from_pretrained(run / "ema") is not None
