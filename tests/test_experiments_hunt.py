"""`rdepth experiment` on inputs the tiny end-to-end runs of tests/test_experiments.py do not reach: a diverged
run, a run saturated before its first update, repeated or non-finite learning rates, a corpus shorter than
one window."""

from __future__ import annotations

import json
import math

import pytest
import torch
from matplotlib.figure import Figure

from recurrent_depth.experiments.common import ByteWindows
from recurrent_depth.experiments.logit_growth import LogitGrowthConfig, run_logit_growth, summarise
from recurrent_depth.experiments.mup import MupConfig, lr_transfer

pytestmark = pytest.mark.usefixtures("one_thread")


def strict_json(text: str):
    """json.loads that refuses NaN / Infinity (not JSON: jq, JavaScript and most readers reject them)."""
    def refuse(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tests.train_support import write_corpus

    return write_corpus(tmp_path_factory.mktemp("corpus"), num_docs=20)


def test_a_diverged_logit_growth_run_is_a_result(corpus, tmp_path, monkeypatch):
    """AdamW at lr 1e12 overflows the logits after one update: the trainer records max_logit None. That
    crashed the progress line (max over None) after the runs; its T_sat is the first non-finite step, and
    the JSON stays strict (NaN as null)."""
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: path.write_bytes(b"png"))  # (the slow part)
    cfg = LogitGrowthConfig(muon_lrs=(0.02, 0.05), adamw_lrs=(1e12, 1e13), variants=("plain",), steps=5, fit_start=1,
                            hidden_size=32, num_heads=2, batch_size=2, seq_len=16, corpus=str(corpus),
                            out=str(tmp_path / "lg"))
    result = run_logit_growth(cfg, log=lambda _: None)
    saved = strict_json((tmp_path / "lg" / "logit_growth.json").read_text())
    adamw = saved["summary"]["adamw"]
    assert adamw["t_sat"] == {str(1e12): 1, str(1e13): 1}
    assert adamw["peak_max_logit"]["plain"] == {str(1e12): None, str(1e13): None}  # inf: diverged
    diverged = [r for r in result["runs"] if r["optimizer"] == "adamw"]
    assert all(math.isnan(r["max_logit"][1]) for r in diverged)
    assert all(r["max_logit"][1] is None for r in saved["runs"] if r["optimizer"] == "adamw")
    assert all(None not in r["max_logit"] for r in saved["runs"] if r["optimizer"] == "muon")


def test_saturated_before_any_update_gives_no_t_sat_fit():
    """T_sat = 0 at every lr (S(0) >= C): log 0 made the T_sat-vs-lr fit NaN and its verdict 'NOT consistent'."""
    cfg = LogitGrowthConfig(variants=("plain",), saturation=0.5)
    runs = [dict(optimizer=name, variant="plain", lr=lr, max_logit=[1.0 + lr * t * t for t in range(20)])
            for name, lrs in (("muon", cfg.muon_lrs), ("adamw", cfg.adamw_lrs)) for lr in lrs]
    summary = summarise(runs, cfg)
    for optimizer in ("muon", "adamw"):
        assert set(summary[optimizer]["t_sat"].values()) == {0}
        assert summary[optimizer]["t_sat_vs_lr_fit"] is None
        assert summary[optimizer]["t_sat_slope_matches"] is False


@pytest.mark.parametrize(("field", "value", "match"), [
    ("muon_lrs", (0.02, 0.02, 0.04), "distinct"),  # the summary keyed by lr kept one; the T_sat fit raised
    ("adamw_lrs", (float("nan"), 0.002), "finite"),  # NaN <= 0 is False: it failed after the Muon runs
    ("muon_lrs", (float("inf"), 0.02), "finite"),
    ("fit_start", 0, "fit_start"),  # silently fitted from 1
    ("fit_start", -3, "fit_start"),
])
def test_logit_growth_refuses_bad_lrs_and_fit_start(field, value, match):
    with pytest.raises(ValueError, match=match):
        LogitGrowthConfig(**{field: value})


@pytest.mark.parametrize(("field", "value", "match"), [
    ("lrs", (0.001, 0.0010000001), "distinct"),  # one `:g` label: the second overwrote the first's loss
    ("lrs", (float("nan"), 0.01), "lrs"),
    ("lrs", (-0.01, 0.01), "lrs"),
    ("lr", float("nan"), "lr"),
])
def test_mup_config_refuses_bad_lrs(field, value, match):
    with pytest.raises(ValueError, match=match):
        MupConfig(**{field: value})


def test_lr_transfer_never_picks_a_diverged_lr():
    """A NaN loss (diverged run) first in a row stayed `min`'s answer: the 'best' lr was the diverged one."""
    tokens = torch.randint(0, 256, (4000,), generator=torch.Generator().manual_seed(0))
    cfg = MupConfig(widths=(32, 64), base_width=32, parametrizations=("mup",), lrs=(1e12, 1e-3), transfer_steps=3,
                    batch_size=2, seq_len=16)
    result = lr_transfer(cfg, tokens, log=lambda _: None)["mup"]
    assert all(math.isnan(row["1e+12"]) for row in result["final_loss"].values())
    assert result["best_lr"] == {"32": "0.001", "64": "0.001"}


def test_byte_windows_refuse_a_corpus_shorter_than_a_window():
    with pytest.raises(ValueError, match=r"seq_len=64 needs a corpus of at least 66 bytes; it holds 50"):
        ByteWindows(torch.zeros(50, dtype=torch.long), 64, seed=0)


@pytest.mark.parametrize("command, written", [("coord-check", "mup_coord_check"), ("lr-transfer", "mup_lr_transfer")])
def test_the_mup_commands_help_names_the_files_they_write(command, written, capsys):
    """--out's help said only "output directory" (logit-growth's names its files)."""
    from recurrent_depth.cli import main

    with pytest.raises(SystemExit):
        main(["experiment", command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert f"output directory for {written}.json and {written}.png" in help_text
