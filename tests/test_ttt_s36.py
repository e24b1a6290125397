"""Sweeps as a user meets them: a diverged run's null losses, and a base that makes every run non-recurrent."""

from __future__ import annotations

import json

import pytest

from recurrent_depth.config import ModelConfig
from recurrent_depth.scaling import parse_rows
from recurrent_depth.scaling.sweep import EVAL_CACHE, PlannedRun, plan_sweep, run_rows
from recurrent_depth.train.config import TrainConfig


def finished_run(out, final_losses):
    """What a finished `rdepth train` run leaves for `run_rows` (no model: nothing may be evaluated again)."""
    out.mkdir()
    cfg = TrainConfig(preset="tiny", seq_len=32, batch_size=4, max_steps=2, mean_recurrence=2)
    (out / "run.json").write_text(json.dumps({
        "config": cfg.to_dict(), "model_config": ModelConfig.from_preset("tiny").to_dict(), "seq_len": 32,
        "parameters": 10**6, "tokens_per_step": 128, "world_size": 1, "finished": {"step": 2}}))
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "tokens": 128 * i}) + "\n" for i in (1, 2)))
    # the trainer writes a diverged validation loss as null (strict JSON)
    (out / "eval.jsonl").write_text(json.dumps({"step": 2, "final": True, "val_loss_by_depth": final_losses}) + "\n")


def test_a_diverged_depth_is_a_no_loss_row_not_a_collect_crash(tmp_path):
    """A null loss in the run's final evaluation made `collect` fail with float()'s TypeError (a traceback)."""
    out = tmp_path / "run"
    finished_run(out, {"1": 5.0, "2": None})
    rows = run_rows(out, PlannedRun("r2", {"mean_recurrence": 2}, {}), [1, 2])
    assert [(r["test_depth"], r["loss"], r["status"]) for r in rows] == [(1, 5.0, "finished"), (2, None, "no_loss")]
    table = parse_rows(rows)  # what `rdepth scaling fit` reads: the no_loss row is skipped, not a bad number
    assert len(table.rows) == 1 and table.skipped == 1


def test_a_null_in_the_collect_cache_is_not_evaluated_again(tmp_path):
    out = tmp_path / "run"
    finished_run(out, {"1": 5.0})
    (out / EVAL_CACHE).write_text(json.dumps({"2": None}) + "\n")  # depth 2, measured by collect: not finite
    rows = run_rows(out, PlannedRun("r2", {"mean_recurrence": 2}, {}), [1, 2])  # (no model/: evaluating would fail)
    assert [r["status"] for r in rows] == ["finished", "no_loss"]


@pytest.mark.parametrize("override", [{"backprop_depth": 2}, {"depth_scheme": "poisson-lognormal"}])
def test_a_run_contradicting_the_bases_non_recurrence_is_refused(override):
    """With the base's mean_recurrence 1, runs named backprop_depth=2 and =3 both trained at 1: two names, one run."""
    data = {"base": {"preset": "tiny", "mean_recurrence": 1}, "runs": [{"seed": 1, **override}], "test_depths": [1]}
    key = next(iter(override))
    with pytest.raises(ValueError, match=rf"mean_recurrence 1 \(the base's\) is a non-recurrent run .*{key}="):
        plan_sweep(data)
    # a run that sets its own depth keeps its settings; one that keeps the base's non-recurrence is fine
    plan = plan_sweep({**data, "runs": [{"mean_recurrence": 2, **override}, {"seed": 2}]})
    assert plan.runs[0].config[key] == override[key] and plan.runs[1].config["backprop_depth"] == 1


def test_a_budget_with_a_form_that_has_no_compute_optimum_is_refused(tmp_path, capsys):
    """`--form kaplan-n --budget C` fitted, printed and wrote fits.json without the optimum asked for, silently."""
    from recurrent_depth.cli import main
    from recurrent_depth.scaling.synthetic import synthetic_rows

    rows = synthetic_rows(widths=(64,), recurrences=(2,), dense_cores=(1, 2), token_budgets=(1e6, 4e6))
    table = tmp_path / "results.json"
    table.write_text(json.dumps({"rows": rows}))
    args = ["scaling", "fit", str(table), "--bootstrap", "0", "--holdout", "none", "--out", str(tmp_path / "fits")]
    assert main([*args, "--form", "kaplan-n", "--budget", "1e18"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--budget" in err and "kaplan-n" in err and "\n" not in err
    assert not (tmp_path / "fits").exists()
    assert main([*args, "--form", "joint", "--budget", "1e18"]) == 0  # joint and all keep taking it
    assert "compute_optimal" in json.loads((tmp_path / "fits" / "fits.json").read_text())["fits"]["joint"]
