"""Figures for quality against depth (matplotlib, written as PNG, headless).

- `plot_metric_vs_depth`: one line per task/metric against test-time recurrence, log-2 x axis,
  saturation marked, optional horizontal baselines (the paper's figure 7);
- `plot_fewshot_vs_depth`: accuracy against recurrence, one line per number of in-context
  examples (the paper's figure 9);
- `plot_reasoning_grid`: accuracy against depth, one line per difficulty, difficulties beyond the
  training range dashed, plus accuracy against difficulty for each depth (depth extrapolation).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from recurrent_depth.evaluation.reasoning.evaluate import AccuracyGrid


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def saturation_point(depths: list[int], values: list[float], higher_is_better: bool, tolerance: float) -> int:
    """The shallowest depth within `tolerance` (relative to the total change) of the best value."""
    best = max(values) if higher_is_better else min(values)
    span = max(values) - min(values) or 1.0
    for d, v in zip(depths, values):
        gap = (best - v) if higher_is_better else (v - best)
        if gap <= tolerance * span:
            return d
    return depths[-1]


def plot_metric_vs_depth(
    curves: Mapping[str, Mapping[int, float]],
    path: str | Path,
    ylabel: str,
    title: str,
    higher_is_better: bool = True,
    baselines: Mapping[str, float] | None = None,
    tolerance: float = 0.05,
) -> Path:
    """curves: label -> {depth: value}. Saturation (within `tolerance` of the total gain) is circled."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, curve in curves.items():
        depths = sorted(curve)
        values = [curve[d] for d in depths]
        (line,) = ax.plot(depths, values, marker="o", label=label)
        if len(depths) > 1:
            sat = saturation_point(depths, values, higher_is_better, tolerance)
            ax.plot([sat], [curve[sat]], marker="o", markersize=14, markerfacecolor="none",
                    markeredgecolor=line.get_color())
    for i, (label, value) in enumerate((baselines or {}).items()):
        ax.axhline(value, linestyle=":", color=f"C{(len(curves) + i) % 10}", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("test-time recurrence r")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_fewshot_vs_depth(curves: Mapping[int, Mapping[int, float]], path: str | Path, title: str) -> Path:
    """curves: number of in-context examples -> {depth: accuracy}."""
    labelled = {f"{k}-shot": v for k, v in sorted(curves.items())}
    return plot_metric_vs_depth(labelled, path, "accuracy", title)


def plot_reasoning_grid(grid: AccuracyGrid, path: str | Path) -> Path:
    plt = _pyplot()
    trained = set(grid.trained_difficulties or grid.difficulties)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    cmap = plt.get_cmap("viridis")
    n = max(1, len(grid.difficulties) - 1)
    for i, difficulty in enumerate(grid.difficulties):
        values = [grid.accuracy[difficulty][d] for d in grid.depths]
        style = "-" if difficulty in trained else "--"
        left.plot(grid.depths, values, style, marker="o", markersize=3, color=cmap(i / n),
                  label=f"{grid.difficulty_name}={difficulty}" + ("" if difficulty in trained else " (unseen)"))
    for i, depth in enumerate(grid.depths):
        values = [grid.accuracy[d][depth] for d in grid.difficulties]
        right.plot(grid.difficulties, values, marker="o", markersize=3, color=plt.get_cmap("plasma")(
            i / max(1, len(grid.depths) - 1)), label=f"r={depth}")
    if grid.trained_difficulties:
        right.axvspan(min(grid.trained_difficulties) - 0.5, max(grid.trained_difficulties) + 0.5, alpha=0.1,
                      color="gray", label="training range")
    for ax in (left, right):
        if grid.chance is not None:
            ax.axhline(grid.chance, linestyle=":", color="gray", label="guessing")
        ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel("exact-match accuracy")
        ax.grid(alpha=0.3)
    left.set_xscale("log", base=2)
    left.set_xlabel("test-time recurrence r")
    left.set_title(f"{grid.task}: accuracy vs depth")
    right.set_xlabel(grid.difficulty_name)
    right.set_title(f"{grid.task}: accuracy vs {grid.difficulty_name} (depth extrapolation)")
    left.legend(fontsize=6, ncol=2)
    right.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
