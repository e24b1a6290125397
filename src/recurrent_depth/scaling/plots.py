"""Log-log plots of a fitted law: the measured losses, the fit, and its bootstrap band."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from recurrent_depth.scaling.fit import ScalingFit, effective_params_of


def plot_fit(fit: ScalingFit, path: str | Path) -> Path:
    """Write the fit's plot (PNG) to `path`: loss against its x axis (N, D, C, or N_eff for iso-depth),
    one curve per token budget for the two-variable forms, shaded between the bootstrap percentiles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    form = fit.form
    rows = fit.rows
    loss = np.array([r["loss"] for r in rows])
    two_variable = form.name in ("joint", "iso-depth")
    x_column = form.columns[0]
    x = effective_params_of(fit) if form.name == "iso-depth" else np.array([r[x_column] for r in rows])
    label = {"tokens": "training tokens D", "train_flops": "training FLOPs C"}.get(
        x_column, f"{'effective ' if form.name == 'iso-depth' else ''}parameters ({x_column})")
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    groups: list[tuple[Any, np.ndarray]] = (
        [(d, np.array([r["tokens"] == d for r in rows])) for d in sorted({r["tokens"] for r in rows})]
        if two_variable else [(None, np.ones(len(rows), dtype=bool))])
    colors = plt.cm.viridis(np.linspace(0.0, 0.85, len(groups)))
    grid = np.geomspace(x.min() / 1.5, x.max() * 1.5, 60)
    for (tokens, mask), color in zip(groups, colors):
        name = f"D = {tokens:.3g}" if tokens is not None else "runs"
        if form.name == "iso-depth":
            recurrent = np.array([r["depth"] > 1 and r["core_layers"] > 0 for r in rows])
            ax.scatter(x[mask & recurrent], loss[mask & recurrent], color=color, marker="o", s=18,
                       label=f"{name} (recurrent)")
            ax.scatter(x[mask & ~recurrent], loss[mask & ~recurrent], color=color, marker="s", s=18,
                       facecolors="none", label=f"{name} (non-recurrent)")
        else:
            ax.scatter(x[mask], loss[mask], color=color, s=18, label=name)
        curve_rows = [_curve_row(form.name, x_column, value, tokens) for value in grid]
        ax.plot(grid, _curve(fit, curve_rows, fit.params), color=color, lw=1.5)
        if fit.samples.size:
            band = np.array([_curve(fit, curve_rows, s) for s in fit.samples])
            tail = 100 * (1 - fit.level) / 2
            low, high = np.percentile(band, [tail, 100 - tail], axis=0)
            ax.fill_between(grid, low, high, color=color, alpha=0.2, lw=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(label)
    ax.set_ylabel("validation loss")
    title = f"{form.name}: {form.equation.split(',')[0]}"
    if form.name == "iso-depth":
        phi = fit.named()["phi"]
        interval = fit.intervals().get("phi")
        title += f"\nphi = {phi:.2f}" + (f" [{interval[0]:.2f}, {interval[1]:.2f}]" if interval else "")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _curve_row(form: str, x_column: str, value: float, tokens: float | None) -> dict[str, float]:
    if form == "iso-depth":  # N_eff = value exactly: one real layer of `value` parameters at depth 1
        return {x_column: value, "tokens": tokens or 1.0, "prelude_layers": 0.0, "core_layers": 1.0,
                "coda_layers": 0.0, "depth": 1.0}
    row = {x_column: value}
    if tokens is not None:
        row["tokens"] = tokens
    return row


def _curve(fit: ScalingFit, rows: list[dict[str, float]], params: np.ndarray) -> np.ndarray:
    return fit.predict(rows, params)
