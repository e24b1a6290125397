"""`rdepth experiment`: the logit-growth fit on known curves, and tiny end-to-end runs of each experiment."""

from __future__ import annotations

import json

import numpy as np
import pytest

from recurrent_depth.cli import main
from recurrent_depth.experiments.logit_growth import LogitGrowthConfig, growth_fit, saturation_step

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tests.train_support import write_corpus

    return write_corpus(tmp_path_factory.mktemp("corpus"), num_docs=20)


@pytest.mark.parametrize("power", [1.0, 2.0])
def test_growth_fit_recovers_a_known_exponent_before_saturation(power):
    t = np.arange(0, 200)  # updates done
    noise = np.exp(np.random.default_rng(0).normal(0, 0.02, len(t)))  # 2% multiplicative noise on the growth
    series = list(1.5 + 0.002 * t**power * noise)
    threshold = 1.5 + 0.002 * 150**power  # reached near t = 150
    cfg = LogitGrowthConfig(saturation=threshold, fit_start=5)
    fit = growth_fit(series, cfg)
    assert fit["slope"] == pytest.approx(power, abs=0.02)
    assert fit["ci95"][0] <= power <= fit["ci95"][1]
    assert fit["t_sat"] == saturation_step(series, threshold) == int(np.argmax(np.array(series) >= threshold))
    assert 140 < fit["t_sat"] < 160
    assert fit["window"] == [5, fit["t_sat"] - 1]
    assert saturation_step([1.0, 2.0], 5.0) is None


def test_logit_growth_command_writes_json_and_plot(corpus, tmp_path, capsys):
    out = tmp_path / "lg"
    code = main(["experiment", "logit-growth", "--steps", "12", "--muon-lrs", "0.02,0.05", "--adamw-lrs",
                 "0.003,0.01", "--hidden-size", "32", "--batch-size", "2", "--seq-len", "16", "--saturation", "2.5",
                 "--qk-clip-tau", "2.2", "--fit-start", "2", "--corpus", str(corpus), "--out", str(out)])
    assert code == 0
    result = json.loads((out / "logit_growth.json").read_text())
    assert (out / "logit_growth.png").stat().st_size > 10_000
    assert len(result["runs"]) == 2 * 2 * 3 and all(len(r["max_logit"]) == 12 for r in result["runs"])
    for r in result["runs"]:  # only the qk-clip runs rescale, and only heads over tau
        assert (sum(r["clipped_heads"]) > 0) == (r["variant"] == "qk-clip" and max(r["max_logit"]) > 2.2)
    for optimizer in ("muon", "adamw"):
        assert set(result["summary"][optimizer]) >= {"exponent_mean", "t_sat", "theory_exponent", "exponent_matches"}
    assert "theory" in capsys.readouterr().out


def test_logit_growth_rejects_bad_settings():
    with pytest.raises(ValueError, match="variants"):
        LogitGrowthConfig(variants=("plain", "weird"))
    with pytest.raises(ValueError, match="2 learning rates"):
        LogitGrowthConfig(muon_lrs=(0.02,))
