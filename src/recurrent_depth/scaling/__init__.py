"""Scaling studies: resumable sweeps of `rdepth train` runs collected into one table (`sweep`), and
scaling-law fits on that table: Kaplan, joint (Chinchilla) and iso-depth (`fit`, `forms`, `plots`;
docs/scaling.md). The fits need scipy (the `scaling` extra), imported only when a fit runs."""

from recurrent_depth.scaling.fit import (
    ScalingFit,
    ScalingTable,
    compute_optimal,
    fit_law,
    fit_rows,
    holdout_error,
    load_table,
    parse_rows,
)
from recurrent_depth.scaling.forms import FORM_NAMES, LawForm, effective_depth, law_form
from recurrent_depth.scaling.plots import plot_fit
from recurrent_depth.scaling.sweep import (
    TABLE_COLUMNS,
    SweepPlan,
    collect_sweep,
    emit_sweep,
    load_sweep,
    run_sweep,
    sweep_status,
)
from recurrent_depth.scaling.synthetic import synthetic_rows

__all__ = ["FORM_NAMES", "TABLE_COLUMNS", "LawForm", "ScalingFit", "ScalingTable", "SweepPlan", "collect_sweep",
           "compute_optimal", "effective_depth", "emit_sweep", "fit_law", "fit_rows", "holdout_error", "law_form",
           "load_sweep", "load_table", "parse_rows", "plot_fit", "run_sweep", "sweep_status", "synthetic_rows"]
