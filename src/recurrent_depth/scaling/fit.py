"""Fitting scaling laws: table loading, robust log-space fits, bootstrap over runs, held-out error,
compute-optimal allocation. The method is in docs/scaling.md ("Fits")."""

from __future__ import annotations

import csv
import io
import itertools
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from recurrent_depth.files import parse_json, read_text
from recurrent_depth.scaling.forms import LawForm, effective_params, law_form

MAX_TABLE_BYTES = 64 * 1024 * 1024
BASE_COLUMNS = ("run", "test_depth", "mean_recurrence", "loss", "status")
NUMERIC_COLUMNS = ("seed", "hidden_size", "prelude_layers", "core_layers", "coda_layers", "mean_recurrence",
                   "train_depth_mean", "test_depth", "lr", "params", "params_non_embedding", "tokens",
                   "train_flops", "flops_per_token_test", "loss")
POSITIVE_COLUMNS = ("params", "params_non_embedding", "tokens", "train_flops", "loss", "mean_recurrence",
                    "test_depth", "core_layers", "hidden_size")
NON_NEGATIVE_COLUMNS = ("prelude_layers", "coda_layers")  # (a model may have no prelude or coda; every one a core)
HUBER_DELTA = 1e-3  # Hoffmann et al. (2022): Huber on log residuals with delta 1e-3
REFINED_STARTS = 3  # the best grid points (by the Huber objective) refined by least squares


@dataclass
class ScalingTable:
    """A results table: one dict per finished row, and how many rows were skipped for their status."""

    rows: list[dict[str, Any]]
    skipped: int
    source: str


def _scipy_optimize() -> Any:
    try:
        from scipy import optimize
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError("scaling-law fits need scipy: pip install 'recurrent-depth[scaling]'",
                                  name="scipy") from exc
    return optimize


def load_table(path: str | Path) -> ScalingTable:
    """Read a sweep's results table (CSV, or JSON: a list of row objects or {"rows": [...]}).

    Rows whose `status` is not "finished" are skipped (counted in `skipped`). Raises ValueError naming
    the missing column or the bad value."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"scaling table {path} is not a file")
    if path.stat().st_size > MAX_TABLE_BYTES:
        raise ValueError(f"scaling table {path} is over {MAX_TABLE_BYTES // 2**20} MiB")
    text = read_text(path, MAX_TABLE_BYTES, "scaling table")  # (a file that is not UTF-8: one line naming it)
    text = text.removeprefix("\ufeff")  # the byte-order mark spreadsheets write ("CSV UTF-8")
    if path.suffix.lower() == ".json":
        data = parse_json(text, f"scaling table {path}")  # (JSON nested too deeply: one line, no traceback)
        data = data.get("rows") if isinstance(data, dict) else data
        if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
            raise ValueError(f"scaling table {path}: expected a list of row objects (or {{\"rows\": [...]}})")
        raw = data
    else:
        try:
            reader = csv.DictReader(io.StringIO(text))
            if reader.fieldnames:  # a hand-written header's "run, loss, ..." names the columns without the spaces
                reader.fieldnames = [name.strip() for name in reader.fieldnames]
            raw = list(reader)
        except csv.Error as exc:  # e.g. a field over the csv module's 128 KiB limit
            raise ValueError(f"scaling table {path} is not a readable CSV table: {exc}") from None
    return parse_rows(raw, str(path))


def parse_rows(raw: list[dict[str, Any]], source: str = "scaling table") -> ScalingTable:
    """Validate and convert raw rows (strings or numbers) into a ScalingTable."""
    if not raw:
        raise ValueError(f"{source} has no rows")
    columns = set(raw[0])
    for column in BASE_COLUMNS:
        if column not in columns:
            raise ValueError(f"{source} has no column {column!r} (its columns: "
                             f"{', '.join(repr(c) for c in list(raw[0])[:20])})")
    rows, skipped = [], 0
    first_row: dict[tuple[str, float], int] = {}
    for number, entry in enumerate(raw, start=1):
        if str(entry.get("status", "")).strip() != "finished":
            skipped += 1
            continue
        row: dict[str, Any] = {"run": str(entry.get("run", "")).strip(), "status": "finished"}
        if not row["run"]:
            raise ValueError(f"{source} row {number}: column 'run' is empty")
        for column in NUMERIC_COLUMNS:
            if column not in entry or entry[column] in ("", None):
                continue
            value = entry[column]
            try:
                if isinstance(value, bool):  # (a JSON table's `true` was fitted as a loss of 1.0)
                    raise TypeError
                number_value = float(value)
            except (TypeError, ValueError):
                raise ValueError(f"{source} row {number}: column {column!r} is {value!r}, not a number") from None
            positive, non_negative = column in POSITIVE_COLUMNS, column in NON_NEGATIVE_COLUMNS
            if (not math.isfinite(number_value) or (positive and number_value <= 0)
                    or (non_negative and number_value < 0)):
                kind = " positive" if positive else " non-negative" if non_negative else ""
                raise ValueError(f"{source} row {number}: column {column!r} is {value!r}; it must be a "
                                 f"finite{kind} number")
            row[column] = number_value
        for column in ("test_depth", "mean_recurrence", "loss"):
            if column not in row:
                raise ValueError(f"{source} row {number}: column {column!r} is empty")
        # one loss per run and depth: a second (a table pasted in twice, a copied row) would be fitted silently
        at = (row["run"], row["test_depth"])
        if at in first_row:
            raise ValueError(f"{source} row {number}: run {row['run']!r} already has a row at test_depth "
                             f"{row['test_depth']:g} (row {first_row[at]}); one row per run and test depth")
        first_row[at] = number
        rows.append(row)
    if not rows:
        raise ValueError(f"{source}: no finished rows ({skipped} skipped for their status)")
    return ScalingTable(rows, skipped, source)


def fit_rows(table: ScalingTable, depth: str = "trained") -> list[dict[str, Any]]:
    """The rows a fit uses, each with `depth` r set.

    depth="trained": one row per run, the one evaluated at (nearest to) its trained mean recurrence r̄,
    with r = r̄ (non-recurrent runs: r̄ = 1). depth="test": every row, r = its test depth."""
    if depth not in ("trained", "test"):
        raise ValueError(f"depth must be 'trained' or 'test', not {depth!r}")
    if depth == "test":
        return [{**row, "depth": row["test_depth"]} for row in table.rows]
    by_run: dict[str, dict[str, Any]] = {}
    for row in table.rows:
        best = by_run.get(row["run"])
        gap = abs(row["test_depth"] - row["mean_recurrence"])
        if best is None or gap < abs(best["test_depth"] - best["mean_recurrence"]):
            by_run[row["run"]] = row
    return [{**row, "depth": row["mean_recurrence"]} for row in by_run.values()]


def _columns(rows: list[dict[str, Any]], form: LawForm) -> dict[str, np.ndarray]:
    data = {}
    for column in (*form.columns, "loss"):
        missing = [r["run"] for r in rows if column not in r]
        if missing:
            raise ValueError(f"form {form.name} needs column {column!r}, which run {missing[0]!r} lacks")
        data[column] = np.array([r[column] for r in rows], dtype=float)
    return data


def _huber(residuals: np.ndarray, delta: float) -> np.ndarray:
    a = np.abs(residuals)
    return np.where(a <= delta, 0.5 * a**2, delta * (a - 0.5 * delta))


def _grid_starts(form: LawForm, data: dict[str, np.ndarray], delta: float, count: int) -> list[np.ndarray]:
    """The `count` grid points with the lowest Huber objective (scored without optimising)."""
    if count <= 0:
        return []
    grid = np.array(list(itertools.product(*form.init_grid)), dtype=float)  # [M, P]
    with np.errstate(all="ignore"):  # one vectorised call: the forms broadcast a [P, M, 1] parameter stack
        predicted = form.log_predict(grid.T[:, :, None], data)  # [M, rows]
        objective = np.sum(_huber(np.log(data["loss"]) - predicted, delta), axis=1)
    objective = np.where(np.isfinite(objective), objective, np.inf)
    return [grid[i] for i in np.argsort(objective, kind="stable")[:count]]


def _refine(form: LawForm, data: dict[str, np.ndarray], starts: list[np.ndarray], delta: float) -> np.ndarray:
    """Huber least squares on log residuals from each start; the lowest objective wins."""
    optimize = _scipy_optimize()
    log_loss = np.log(data["loss"])
    lower, upper = (np.array(b, dtype=float) for b in zip(*form.bounds))

    def residuals(params: np.ndarray) -> np.ndarray:
        return log_loss - form.log_predict(params, data)

    def jacobian(params: np.ndarray) -> np.ndarray:
        # forward differences in one vectorised call: the forms broadcast a [P, M, 1] stack of M parameter
        # vectors (scipy's own 2-point scheme makes P calls, the bulk of the time on tables this small)
        step = 1e-7 * np.maximum(1.0, np.abs(params))
        stack = np.concatenate([params[:, None], params[:, None] + np.diag(step)], axis=1)[:, :, None]
        predicted = form.log_predict(stack, data)  # [P + 1, rows]
        return -((predicted[1:] - predicted[0]) / step[:, None]).T

    best, best_cost = None, math.inf
    for start in starts:
        x0 = np.clip(start, lower + 1e-9, upper - 1e-9)
        result = optimize.least_squares(residuals, x0, bounds=(lower, upper), jac=jacobian, loss="huber", f_scale=delta,
                                        max_nfev=400)
        cost = float(np.sum(_huber(residuals(result.x), delta)))
        if cost < best_cost:
            best, best_cost = result.x, cost
    assert best is not None
    return best


def fit_params(form: LawForm, rows: list[dict[str, Any]], delta: float = HUBER_DELTA,
               extra_starts: list[np.ndarray] | None = None, starts: int = REFINED_STARTS) -> np.ndarray:
    """The parameter vector of `form` fitted to `rows` (a point estimate, no intervals)."""
    data = _columns(rows, form)
    if len(rows) < len(form.parameters):
        raise ValueError(f"form {form.name} has {len(form.parameters)} parameters but only {len(rows)} "
                         "rows to fit; add runs or choose a smaller form")
    return _refine(form, data, [*(extra_starts or []), *_grid_starts(form, data, delta, starts)], delta)


@dataclass
class ScalingFit:
    """A fitted form: point estimate, bootstrap samples and intervals, held-out error."""

    form: LawForm
    params: np.ndarray
    rows: list[dict[str, Any]]
    level: float
    samples: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))  # [B, parameters]
    holdout: dict[str, Any] = field(default_factory=dict)

    def named(self) -> dict[str, float]:
        """Parameters by name, with the scales (E, A, B, K) also as plain numbers."""
        values = dict(zip(self.form.parameters, (float(v) for v in self.params)))
        for name in list(values):
            if name.startswith("log_"):
                values[name[4:]] = math.exp(values[name])
        return values

    def intervals(self) -> dict[str, tuple[float, float]]:
        """Percentile bootstrap intervals at `level` for every parameter (and the plain scales)."""
        if self.samples.size == 0:
            return {}
        tail = 100 * (1 - self.level) / 2
        low, high = np.percentile(self.samples, [tail, 100 - tail], axis=0)
        out = {name: (float(a), float(b)) for name, a, b in zip(self.form.parameters, low, high)}
        for name in list(out):
            if name.startswith("log_"):
                out[name[4:]] = (math.exp(out[name][0]), math.exp(out[name][1]))
        return out

    def log_rmse(self) -> float:
        """RMSE of the log-loss residuals on the fitted rows (in-sample)."""
        data = _columns(self.rows, self.form)
        return float(np.sqrt(np.mean((np.log(data["loss"]) - self.form.log_predict(self.params, data)) ** 2)))

    def predict(self, rows: list[dict[str, Any]], params: np.ndarray | None = None) -> np.ndarray:
        """Predicted loss at `rows` (column dicts) with the fitted (or given) parameters."""
        data = {c: np.array([r[c] for r in rows], dtype=float) for c in self.form.columns}
        return self.form.predict(self.params if params is None else params, data)

    def to_json(self) -> dict[str, Any]:
        intervals = self.intervals()
        return {
            "form": self.form.name, "equation": self.form.equation, "runs": len({r["run"] for r in self.rows}),
            "rows": len(self.rows), "params": self.named(),
            "intervals": {k: list(v) for k, v in intervals.items()}, "level": self.level,
            "bootstrap": int(self.samples.shape[0]), "log_rmse_in_sample": self.log_rmse(), "holdout": self.holdout,
        }


def bootstrap_samples(form: LawForm, rows: list[dict[str, Any]], params: np.ndarray, resamples: int,
                      seed: int = 0, delta: float = HUBER_DELTA) -> np.ndarray:
    """Refits on `resamples` resamples of the runs (with replacement; a run's rows travel together)."""
    runs = sorted({r["run"] for r in rows})
    by_run = {run: [r for r in rows if r["run"] == run] for run in runs}
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(resamples):
        chosen = rng.integers(0, len(runs), size=len(runs))
        sample = [row for i in chosen for row in by_run[runs[i]]]
        if len({runs[i] for i in chosen}) < 2:
            continue
        # from the full-data estimate and the resample's best grid point (a warm start alone can stay in
        # the full data's basin and make the interval too narrow)
        samples.append(fit_params(form, sample, delta, extra_starts=[params], starts=1)
                       if len(sample) >= len(form.parameters) else params)
    return np.array(samples, dtype=float).reshape(-1, len(form.parameters))


# What orders runs by training compute, best first: the first that every row has.
COMPUTE_COLUMNS = (("train_flops",), ("params_non_embedding", "tokens"), ("params", "tokens"),
                   ("params_non_embedding",), ("params",), ("tokens",))


def compute_by_run(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each run's training compute, to order runs by: `train_flops`, else N D (6 N D without the 6), else N or D
    alone, whichever every row has (a hand-written table may have no FLOPs: ordering by a column some rows lack
    would hold out arbitrary runs)."""
    for columns in COMPUTE_COLUMNS:
        if all(c in r for r in rows for c in columns):
            return {r["run"]: math.prod(float(r[c]) for c in columns) for r in rows}
    raise ValueError("the held-out runs are the largest by train_flops, params or tokens: the table has none of "
                     "them in every row")


def holdout_error(form: LawForm, rows: list[dict[str, Any]], scheme: str = "largest",
                  fraction: float = 0.2, delta: float = HUBER_DELTA) -> dict[str, Any]:
    """Out-of-sample RMSE of log loss.

    scheme="largest": fit on all runs but the largest-compute `fraction` (at least one run), predict those
    (extrapolation, what a scaling law is for). scheme="loo": leave each run out in turn."""
    runs = sorted({r["run"] for r in rows})
    if scheme == "none":
        return {}
    if scheme == "largest":
        flops = compute_by_run(rows)
        held = max(1, round(fraction * len(runs)))
        ordered = sorted(runs, key=lambda run: flops[run])
        folds = [set(ordered[-held:])]
    elif scheme == "loo":
        folds = [{run} for run in runs]
    else:
        raise ValueError(f"holdout must be 'largest', 'loo' or 'none', not {scheme!r}")
    errors = []
    for fold in folds:
        train = [r for r in rows if r["run"] not in fold]
        test = [r for r in rows if r["run"] in fold]
        if len(train) < len(form.parameters):
            return {"scheme": scheme, "error": f"too few runs left to fit ({len(train)} rows)"}
        params = fit_params(form, train, delta)
        data = _columns(test, form)
        errors.extend(np.log(data["loss"]) - form.log_predict(params, data))
    errors_array = np.array(errors)
    return {"scheme": scheme, "held_out_runs": sum(len(f) for f in folds), "held_out_rows": len(errors),
            "log_rmse": float(np.sqrt(np.mean(errors_array**2))), "log_bias": float(np.mean(errors_array))}


def check_fit_settings(level: float, bootstrap: int, budget: float | None = None) -> None:
    """One ValueError for an interval level outside (0, 1), a negative bootstrap count or a compute budget that
    is not a finite positive number (form-independent mistakes: `rdepth scaling fit --form all` says them once,
    before fitting anything)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), not {level}")
    if bootstrap < 0:
        raise ValueError(f"bootstrap must be >= 0, not {bootstrap}")
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        raise ValueError(f"budget must be a finite positive number of FLOPs, not {budget}")


def fit_law(rows: list[dict[str, Any]] | ScalingTable, form: str | LawForm = "joint", bootstrap: int = 200,
            level: float = 0.9, holdout: str = "largest", seed: int = 0, depth: str = "trained",
            irreducible: bool = True, n_column: str = "params_non_embedding",
            delta: float = HUBER_DELTA) -> ScalingFit:
    """Fit one form to a table (or to rows already chosen by `fit_rows`) with bootstrap intervals over runs
    and the held-out error. `bootstrap=0` gives the point estimate only."""
    check_fit_settings(level, bootstrap)
    law = form if isinstance(form, LawForm) else law_form(form, irreducible, n_column)
    chosen = fit_rows(rows, depth) if isinstance(rows, ScalingTable) else rows
    params = fit_params(law, chosen, delta)
    samples = bootstrap_samples(law, chosen, params, bootstrap, seed, delta) if bootstrap else np.zeros((0, 0))
    result = ScalingFit(law, params, chosen, level, samples)
    result.holdout = holdout_error(law, chosen, holdout, delta=delta)
    return result


def compute_optimal(fit: ScalingFit, budget: float, flops_per_param_token: float = 6.0) -> dict[str, Any]:
    """N and D minimising the joint (or iso-depth) law at training compute C = 6 N D (Kaplan's count:
    2 FLOPs per multiply-add, forward + backward = 3x forward; N the fitted N column).

    Closed form (Hoffmann et al. 2022, appendix D): N_opt = G (C/6)^(beta/(alpha+beta)),
    G = (alpha A / (beta B))^(1/(alpha+beta)), D_opt = C / (6 N_opt). For iso-depth, N is N_eff. With
    bootstrap samples the same formula over each sample gives the interval."""
    if fit.form.name not in ("joint", "iso-depth"):
        raise ValueError(f"compute-optimal N and D need the joint or iso-depth form, not {fit.form.name}")
    check_fit_settings(fit.level, 0, budget)
    names = fit.form.parameters

    def optimum(params: np.ndarray) -> tuple[float, float, float]:
        p = dict(zip(names, params))
        a, b, alpha, beta = math.exp(p["log_A"]), math.exp(p["log_B"]), p["alpha"], p["beta"]
        if alpha <= 0 or beta <= 0:
            return math.nan, math.nan, math.nan
        g = (alpha * a / (beta * b)) ** (1 / (alpha + beta))
        n = g * (budget / flops_per_param_token) ** (beta / (alpha + beta))
        d = budget / (flops_per_param_token * n)
        loss = math.exp(p.get("log_E", -math.inf)) + a * n**-alpha + b * d**-beta
        return n, d, loss

    n, d, loss = optimum(fit.params)
    out: dict[str, Any] = {"budget_flops": budget, "flop_convention": f"C = {flops_per_param_token:g} N D",
                           "N": n, "D": d, "loss": loss, "tokens_per_param": d / n}
    if fit.samples.size:
        values = np.array([optimum(s) for s in fit.samples])
        values = values[np.isfinite(values).all(axis=1)]
        if len(values):
            tail = 100 * (1 - fit.level) / 2
            for i, key in enumerate(("N", "D", "loss")):
                low, high = np.percentile(values[:, i], [tail, 100 - tail])
                out[f"{key}_interval"] = [float(low), float(high)]
    return out


def effective_params_of(fit: ScalingFit, rows: list[dict[str, Any]] | None = None) -> np.ndarray:
    """N_eff of each row at the fitted phi (iso-depth fits only): the x axis of its plot."""
    if fit.form.name != "iso-depth":
        raise ValueError(f"effective parameters need an iso-depth fit, not {fit.form.name}")
    rows = fit.rows if rows is None else rows
    data = {c: np.array([r[c] for r in rows], dtype=float) for c in fit.form.columns}
    return effective_params(data, fit.form.columns[0], float(fit.named()["phi"]))
