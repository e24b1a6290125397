"""Scaling-law forms: each predicts log loss from a table's columns and a parameter vector.

Every form is fitted in log space (docs/scaling.md, "Fits"). Positive scales are stored as logs
(``log_E``, ``log_A``, ``log_B``) so the optimiser is unconstrained in them, and a sum of power-law
terms is evaluated as a log-sum-exp (``log(E + A N^-a) = logaddexp(log_E, log_A - a log N)``), the
Hoffmann et al. (2022) trick that keeps tiny and huge terms exact.

Forms (x = a table column, all natural logs):
  kaplan-n   L = E + A N^-alpha            (N = non-embedding parameters by default)
  kaplan-d   L = E + B D^-beta             (D = training tokens)
  kaplan-c   L = E + K C^-gamma            (C = training FLOPs, the library's own count)
  joint      L = E + A N^-alpha + B D^-beta          (Rosenfeld et al. 2020; Hoffmann et al. 2022)
  iso-depth  L = E + A N_eff^-alpha + B D^-beta,  N_eff = n_layer * d_eff,
             d_eff = prelude + coda + core * (1 + phi * (r - 1)),  n_layer = N / (prelude + core + coda)
Without the irreducible term (``irreducible=False``) E is dropped: Kaplan's pure power laws.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

FORM_NAMES = ("kaplan-n", "kaplan-d", "kaplan-c", "joint", "iso-depth")

# Exponents and phi live in these boxes; log scales are free within +-60 (e^60 covers any loss scale).
_EXPONENT = (0.0, 3.0)
_PHI = (0.0, 4.0)
_LOG_SCALE = (-60.0, 60.0)


@dataclass(frozen=True)
class LawForm:
    """One scaling-law form: its parameters, the columns it reads and its log-loss prediction."""

    name: str
    equation: str
    parameters: tuple[str, ...]
    columns: tuple[str, ...]  # table columns `predict` reads (after the x-column substitution)
    bounds: tuple[tuple[float, float], ...]
    init_grid: tuple[tuple[float, ...], ...]  # per parameter: the starting values tried (their product)
    log_predict: Callable[[np.ndarray, dict[str, np.ndarray]], np.ndarray]

    def predict(self, params: np.ndarray, data: dict[str, np.ndarray]) -> np.ndarray:
        """The predicted loss (not its log) at each row of `data` (column name -> array)."""
        return np.exp(self.log_predict(np.asarray(params, dtype=float), data))


def effective_depth(prelude: np.ndarray, core: np.ndarray, coda: np.ndarray, depth: np.ndarray,
                    phi: float) -> np.ndarray:
    """prelude + coda + core * (1 + phi (r - 1)): the first pass through the core counts as real layers,
    each further recurrence as phi of one (phi = 1: looping is as good as unique layers; 0: worth nothing)."""
    return prelude + coda + core * (1.0 + phi * (depth - 1.0))


def effective_params(data: dict[str, np.ndarray], n_column: str, phi: float) -> np.ndarray:
    """N_eff = (N / real layers) * d_eff: the per-layer parameters times the effective depth."""
    real = data["prelude_layers"] + data["core_layers"] + data["coda_layers"]
    depth = effective_depth(data["prelude_layers"], data["core_layers"], data["coda_layers"], data["depth"], phi)
    return data[n_column] / real * depth


def _terms(*terms: np.ndarray) -> np.ndarray:
    return np.logaddexp.reduce(np.stack(np.broadcast_arrays(*terms)), axis=0)


def law_form(name: str, irreducible: bool = True, n_column: str = "params_non_embedding") -> LawForm:
    """The form called `name` (one of FORM_NAMES); `n_column` is the table column used as N."""
    if name not in FORM_NAMES:
        raise ValueError(f"unknown scaling-law form {name!r}; choose from {', '.join(FORM_NAMES)} or all")
    e_names = ("log_E",) if irreducible else ()
    e_bounds = (_LOG_SCALE,) if irreducible else ()
    e_grid = ((-1.0, 0.0, 1.0),) if irreducible else ()

    def with_e(params: np.ndarray, *terms: np.ndarray) -> np.ndarray:
        return _terms(params[0], *terms) if irreducible else _terms(*terms)

    k = len(e_names)
    if name in ("kaplan-n", "kaplan-d", "kaplan-c"):
        column = {"kaplan-n": n_column, "kaplan-d": "tokens", "kaplan-c": "train_flops"}[name]
        symbol, scale, exponent = {"kaplan-n": ("N", "log_A", "alpha"), "kaplan-d": ("D", "log_B", "beta"),
                                   "kaplan-c": ("C", "log_K", "gamma")}[name]

        def log_predict(p: np.ndarray, data: dict[str, np.ndarray]) -> np.ndarray:
            return with_e(p, p[k] - p[k + 1] * np.log(data[column]))

        return LawForm(name, f"L = {'E + ' if irreducible else ''}{scale[4:]} {symbol}^-{exponent}",
                       (*e_names, scale, exponent), (column,), (*e_bounds, _LOG_SCALE, _EXPONENT),
                       (*e_grid, (0.0, 5.0, 10.0, 20.0), (0.05, 0.2, 0.5, 1.0)), log_predict)
    if name == "joint":
        def log_predict(p: np.ndarray, data: dict[str, np.ndarray]) -> np.ndarray:
            return with_e(p, p[k] - p[k + 1] * np.log(data[n_column]), p[k + 2] - p[k + 3] * np.log(data["tokens"]))

        return LawForm(name, f"L = {'E + ' if irreducible else ''}A N^-alpha + B D^-beta",
                       (*e_names, "log_A", "alpha", "log_B", "beta"), (n_column, "tokens"),
                       (*e_bounds, _LOG_SCALE, _EXPONENT, _LOG_SCALE, _EXPONENT),
                       (*e_grid, (0.0, 5.0, 10.0), (0.1, 0.3, 0.6), (0.0, 5.0, 10.0), (0.1, 0.3, 0.6)), log_predict)

    def log_predict(p: np.ndarray, data: dict[str, np.ndarray]) -> np.ndarray:
        n_eff = effective_params(data, n_column, p[k + 4])
        return with_e(p, p[k] - p[k + 1] * np.log(n_eff), p[k + 2] - p[k + 3] * np.log(data["tokens"]))

    return LawForm(name, f"L = {'E + ' if irreducible else ''}A N_eff^-alpha + B D^-beta, "
                         "N_eff = N/(P+R+C) * (P + C + R (1 + phi (r - 1)))",
                   (*e_names, "log_A", "alpha", "log_B", "beta", "phi"),
                   (n_column, "tokens", "prelude_layers", "core_layers", "coda_layers", "depth"),
                   (*e_bounds, _LOG_SCALE, _EXPONENT, _LOG_SCALE, _EXPONENT, _PHI),
                   (*e_grid, (0.0, 5.0, 10.0), (0.1, 0.3, 0.6), (0.0, 5.0, 10.0), (0.1, 0.3, 0.6), (0.25, 0.75)),
                   log_predict)
