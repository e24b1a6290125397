"""Scaling-law fits: recovery of known parameters, bootstrap coverage, table validation, the CLI."""

import csv
import json
import math

import numpy as np
import pytest

from recurrent_depth.scaling import (
    compute_optimal,
    effective_depth,
    fit_law,
    fit_rows,
    law_form,
    load_table,
    parse_rows,
    synthetic_rows,
)
from recurrent_depth.scaling.fit import bootstrap_samples, fit_params

pytest.importorskip("scipy")


def rows_from(form_name: str, truth: dict[str, float], noise: float, seed: int, n_runs: int = 12):
    """Rows drawn from `form_name` itself at log-spaced N, D (and depths for iso-depth)."""
    rng = np.random.default_rng(seed)
    form = law_form(form_name)
    rows = []
    for i in range(n_runs):
        n = 1e5 * 4 ** (i % 4 + rng.uniform(-0.2, 0.2))
        d = 1e6 * 4 ** (i // 4 + rng.uniform(-0.2, 0.2))
        recurrent = i % 2 == 0
        row = {"run": f"run{i}", "params_non_embedding": n, "tokens": d, "train_flops": 6 * n * d,
               "prelude_layers": 1.0, "core_layers": 2.0 if recurrent else float(1 + i % 3),
               "coda_layers": 1.0, "depth": float([2, 4, 8][i % 3]) if recurrent else 1.0}
        params = np.array([truth[p] for p in form.parameters])
        row["loss"] = float(form.predict(params, {k: np.array([v]) for k, v in row.items() if k != "run"})[0]
                            * math.exp(noise * rng.standard_normal()))
        rows.append(row)
    return rows


TRUTH = {"log_E": math.log(1.8), "log_A": math.log(300.0), "alpha": 0.35, "log_B": math.log(200.0), "beta": 0.3,
         "log_K": math.log(2000.0), "gamma": 0.15, "phi": 0.46}
# (form, parameter -> absolute tolerance) at 0.5% log noise on 12 runs: exponents within 0.05, phi within 0.1
TOLERANCES = {
    "kaplan-n": {"alpha": 0.05}, "kaplan-d": {"beta": 0.05}, "kaplan-c": {"gamma": 0.05},
    "joint": {"alpha": 0.05, "beta": 0.05}, "iso-depth": {"alpha": 0.05, "beta": 0.05, "phi": 0.1},
}


@pytest.mark.parametrize("form_name", list(TOLERANCES))
def test_fit_recovers_the_parameters_of_its_own_form(form_name):
    rows = rows_from(form_name, TRUTH, noise=0.005, seed=1, n_runs=12 if form_name != "iso-depth" else 18)
    form = law_form(form_name)
    fitted = dict(zip(form.parameters, fit_params(form, rows)))
    for name, tolerance in TOLERANCES[form_name].items():
        assert abs(fitted[name] - TRUTH[name]) < tolerance, (name, fitted[name], TRUTH[name])
    assert abs(math.exp(fitted["log_E"]) - 1.8) < 0.3  # the irreducible loss: within 0.3 nats


def test_iso_depth_recovers_phi_from_a_sweep_shaped_table_with_an_interval_covering_it():
    table = parse_rows(synthetic_rows(noise=0.005, seed=2, widths=(64, 256), recurrences=(2, 8),
                                      token_budgets=(1e6, 4e6, 16e6)))
    fit = fit_law(table, "iso-depth", bootstrap=12, level=0.9, holdout="largest")
    low, high = fit.intervals()["phi"]
    assert abs(fit.named()["phi"] - 0.46) < 0.08 and low <= 0.46 <= high and high - low < 0.5
    assert fit.holdout["log_rmse"] < 0.05  # extrapolation to the largest runs at 0.5% noise
    opt = compute_optimal(fit, 1e15)
    assert math.isclose(6 * opt["N"] * opt["D"], 1e15, rel_tol=1e-9) and opt["N_interval"][0] <= opt["N"]


def test_effective_depth_counts_the_first_pass_as_real_layers():
    assert effective_depth(1, 2, 1, 1, 0.3) == 4  # r = 1: the real depth, whatever phi
    assert effective_depth(1, 2, 1, 4, 0.5) == 1 + 1 + 2 * (1 + 0.5 * 3)
    assert effective_depth(1, 2, 1, 4, 1.0) == effective_depth(1, 8, 1, 1, 0.0)  # phi = 1: as unique layers


def test_bootstrap_intervals_cover_the_truth_at_the_nominal_rate():
    """30 draws, 80% percentile intervals (15 resamples over runs) on alpha of a pure power law (no E, Huber
    delta 0.1 so each refit takes a few iterations; coverage does not depend on delta, and the benchmark
    checks the default delta on the joint and iso-depth forms). If the intervals are right the count of
    covering draws is binomial(30, 0.8): mean 24, sd 2.2; we accept 17..30 (about 3 sd below; an interval
    that ignores run-to-run variance covers far less). Full check: benchmarks/scaling_coverage.py."""
    form = law_form("kaplan-n", irreducible=False)
    covered = 0
    for draw in range(30):
        rng = np.random.default_rng(100 + draw)
        n = np.geomspace(1e5, 1e8, 10)
        rows = [{"run": f"r{i}", "params_non_embedding": float(x),
                 "loss": float(50 * x**-0.2 * math.exp(0.03 * rng.standard_normal()))} for i, x in enumerate(n)]
        params = fit_params(form, rows, delta=0.1, starts=1)
        samples = bootstrap_samples(form, rows, params, resamples=15, seed=draw, delta=0.1)
        low, high = np.percentile(samples[:, 1], [10, 90])
        covered += low <= 0.2 <= high
    assert 17 <= covered <= 30, covered


def test_fit_rows_picks_the_trained_depth_row_per_run():
    table = parse_rows(synthetic_rows(widths=(64,), recurrences=(4,), token_budgets=(1e6,), dense_cores=(2,)))
    trained = fit_rows(table, "trained")
    picked = sorted((r["run"].split("-")[2], r["test_depth"], r["depth"]) for r in trained)
    assert picked == [("r1", 1, 1), ("r4", 4, 4)]
    assert len(fit_rows(table, "test")) == len(table.rows)


def write_csv(path, rows):
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_bad_tables_get_one_line_errors(tmp_path):
    rows = synthetic_rows(widths=(64,), recurrences=(4,), token_budgets=(1e6,), dense_cores=(1,))
    missing = [{k: v for k, v in r.items() if k != "loss"} for r in rows]
    write_csv(tmp_path / "missing.csv", missing)
    with pytest.raises(ValueError, match="no column 'loss'"):
        load_table(tmp_path / "missing.csv")
    bad = [dict(r) for r in rows]
    bad[1]["tokens"] = "lots"
    write_csv(tmp_path / "bad.csv", bad)
    with pytest.raises(ValueError, match=r"row 2: column 'tokens' is 'lots', not a number"):
        load_table(tmp_path / "bad.csv")
    bad[1]["tokens"] = -5
    (tmp_path / "neg.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"row 2: column 'tokens' is -5; it must be a finite positive number"):
        load_table(tmp_path / "neg.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_table(tmp_path / "broken.json")
    unfinished = [{**r, "status": "failed"} for r in rows]
    write_csv(tmp_path / "none.csv", unfinished)
    with pytest.raises(ValueError, match=r"no finished rows \(\d+ skipped"):
        load_table(tmp_path / "none.csv")
    no_tokens = [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
    with pytest.raises(ValueError, match="form joint needs column 'tokens'"):
        fit_law(parse_rows(no_tokens), "joint", bootstrap=0)
    with pytest.raises(ValueError, match="unknown scaling-law form 'chinchilla'"):
        law_form("chinchilla")


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("deep.json", b"[" * 100_000, "deep.json is JSON nested too deeply"),  # was a RecursionError
        ("wide.csv", b"run,loss\n" + b"a" * 200_000 + b",1\n", "wide.csv is not a readable CSV table"),  # _csv.Error
        ("latin.csv", b"run,loss\ncaf\xe9,1\n", "latin.csv is not UTF-8 text"),  # did not name the file
    ],
    ids=["deep-json", "huge-csv-field", "not-utf8"],
)
def test_unreadable_tables_are_one_line_errors_naming_the_file(tmp_path, capsys, name, content, message):
    from recurrent_depth.cli import main

    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_table(tmp_path / name)
    assert main(["scaling", "fit", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_cli_fits_a_synthetic_table_and_writes_json_and_plots(tmp_path, capsys):
    from recurrent_depth.cli import main

    rows = synthetic_rows(noise=0.005, seed=4, widths=(64, 256), recurrences=(4,), token_budgets=(1e6, 8e6),
                          dense_cores=(1, 4))
    rows[0] = {**rows[0], "status": "running"}
    write_csv(tmp_path / "results.csv", rows)
    code = main(["scaling", "fit", str(tmp_path / "results.csv"), "--form", "joint", "--bootstrap", "3",
                 "--budget", "1e15", "--out", str(tmp_path / "fits")])
    out = capsys.readouterr().out
    assert code == 0 and "skipped 1 row(s)" in out and "compute-optimal at C = 1e+15" in out
    report = json.loads((tmp_path / "fits" / "fits.json").read_text())
    joint = report["fits"]["joint"]
    assert joint["bootstrap"] == 3 and set(joint["intervals"]) >= {"alpha", "beta"} and "log_rmse" in joint["holdout"]
    assert (tmp_path / "fits" / "joint.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["scaling", "fit", str(tmp_path / "nope.csv")]) == 2
    assert "is not a file" in capsys.readouterr().err
    # a bad level is one line before anything is fitted or written (--form all said it once per form, then again)
    assert main(["scaling", "fit", str(tmp_path / "results.csv"), "--form", "all", "--level", "1.5",
                 "--out", str(tmp_path / "bad")]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("level must be in (0, 1), not 1.5") == 1 and "skipped" not in captured.out
    assert not (tmp_path / "bad").exists()


def test_a_missing_scipy_is_a_one_line_error_naming_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "scipy", None)
    rows = rows_from("kaplan-n", TRUTH, noise=0.0, seed=0)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'recurrent-depth\[scaling\]'"):
        fit_params(law_form("kaplan-n"), rows)


def test_form_all_fits_what_the_table_supports_and_names_the_forms_it_skips(tmp_path, capsys):
    """`--form all` stopped at the first form with too few runs, fitting none of the others."""
    from recurrent_depth.cli import main

    small = dict(recurrences=(4,), token_budgets=(1e6,), dense_cores=(2,))
    write_csv(tmp_path / "results.csv", synthetic_rows(widths=(64, 128), **small))  # 4 runs
    args = ["scaling", "fit", str(tmp_path / "results.csv"), "--bootstrap", "0", "--out", str(tmp_path / "fits")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "joint      skipped: form joint has 5 parameters but only 4 rows" in out
    report = json.loads((tmp_path / "fits" / "fits.json").read_text())
    assert {"kaplan-n", "kaplan-d", "kaplan-c"} <= set(report["fits"])
    assert {"joint", "iso-depth"} == set(report["skipped_forms"])
    assert main([*args, "--form", "joint"]) == 2  # one form asked for: its error, as before
    assert "form joint has 5 parameters" in capsys.readouterr().err
    write_csv(tmp_path / "two.csv", synthetic_rows(widths=(64,), **small))  # 2 runs: no form fits
    assert main(["scaling", "fit", str(tmp_path / "two.csv"), "--out", str(tmp_path / "f2")]) == 2
    err = capsys.readouterr().err.strip()
    assert "error: no form could be fitted to" in err and "kaplan-n: form kaplan-n has 3 parameters" in err
    assert "\n" not in err
