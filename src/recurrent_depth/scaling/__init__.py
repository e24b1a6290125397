"""Scaling laws for recurrent-depth models: Kaplan, joint (Chinchilla) and iso-depth fits (docs/scaling.md)."""

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
from recurrent_depth.scaling.synthetic import synthetic_rows

__all__ = ["FORM_NAMES", "LawForm", "ScalingFit", "ScalingTable", "compute_optimal", "effective_depth", "fit_law",
           "fit_rows", "holdout_error", "law_form", "load_table", "parse_rows", "plot_fit", "synthetic_rows"]
