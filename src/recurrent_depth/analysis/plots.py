"""Figures of the analysis report, drawn with matplotlib's object API.

Every function returns a `matplotlib.figure.Figure` built without pyplot, so nothing touches a
global backend (a notebook's stays as it is) and PNGs render with Agg via `fig.savefig`.
Token axes list tokens top to bottom with their text; long prompts show every n-th label.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from recurrent_depth.analysis.classify import KINDS
from recurrent_depth.analysis.exit_gate import ExitGate
from recurrent_depth.analysis.path_independence import PathIndependence
from recurrent_depth.analysis.pca import PCA

MAX_TICK_LABELS = {"y": 80, "x": 60}  # more token labels than this overlap; show every n-th instead
ROW_INCHES = 0.24  # height per token row in heatmaps
MAX_HEIGHT_INCHES = 36.0
PCA_ROW_INCHES = 3.0  # one row of PCA panels per token
MAX_PCA_ROWS = 12  # tokens in the PCA figure: 12 rows are about the heatmaps' MAX_HEIGHT_INCHES
KIND_COLOURS = {"fixed point": "tab:blue", "orbit": "tab:red", "slider": "tab:green"}


@lru_cache(maxsize=1)
def _label_font():  # the font token labels are drawn in (family="monospace")
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    return FT2Font(font_manager.findfont(font_manager.FontProperties(family="monospace")))


def drawable(label: str) -> str:
    """`label` with each character the label font has no glyph for as its escape (`世` -> `\\u4e16`):
    matplotlib draws every such character as the same empty box, so "世" and "界" would look alike."""
    font = _label_font()
    return "".join(c if c.isascii() or font.get_char_index(ord(c)) else c.encode("unicode_escape").decode("ascii")
                   for c in label)


def _token_axis(ax, labels: list[str], axis: str = "y") -> None:
    labels = [drawable(label) for label in labels]
    n = len(labels)
    stride = max(1, -(-n // MAX_TICK_LABELS[axis]))
    ticks = list(range(0, n, stride))
    size = 8 if n <= 40 else 7 if n <= 80 else 6
    if axis == "y":
        ax.set_yticks(ticks)
        ax.set_yticklabels([labels[i] for i in ticks], fontsize=size, family="monospace")
    else:
        ax.set_xticks(ticks)
        ax.set_xticklabels([labels[i] for i in ticks], fontsize=size, family="monospace", rotation=90)


def _heatmap_height(num_tokens: int) -> float:
    return min(MAX_HEIGHT_INCHES, max(3.5, ROW_INCHES * num_tokens + 1.6))


def _colorbar_shrink(fig: Figure) -> float:
    """Keep colour bars about 6 inches tall even on very tall heatmaps."""
    return min(0.8, 6.0 / fig.get_figheight())


def _step_axis(ax, num_steps: int) -> None:
    ax.set_xlabel("recurrence step i")
    stride = max(1, int(np.ceil(num_steps / 16)))
    ax.set_xticks(range(0, num_steps + 1, stride))


def plot_convergence(
    distance: np.ndarray, labels: list[str], converged_at: np.ndarray, limit_steps: int
) -> Figure:
    """Heatmap of ‖ln_f(s_i) − s*‖ [T, S+1], tokens down, steps across (log colour scale).

    A black bar marks the step from which each token stays within tolerance of s*.
    """
    T, cols = distance.shape
    fig = Figure(figsize=(11, _heatmap_height(T)), layout="constrained")
    ax = fig.add_subplot()
    positive = distance[distance > 0]
    top = float(positive.max()) if positive.size else 1.0
    bottom = max(float(positive.min()) if positive.size else top * 1e-4, top * 1e-4)
    # Distance 0 (the last step when s* is this very run) sits at the bottom of the log scale.
    shown = np.clip(distance, bottom, None)
    im = ax.imshow(shown, aspect="auto", interpolation="nearest", cmap="magma_r",
                   norm=LogNorm(vmin=bottom, vmax=max(top, bottom * 10)))
    for t, step in enumerate(converged_at):
        if step >= 0:
            ax.plot([step - 0.5, step - 0.5], [t - 0.45, t + 0.45], color="black", lw=1.6)
    _token_axis(ax, labels)
    _step_axis(ax, cols - 1)
    ax.set_ylabel("token (position: text)")
    ax.set_title(f"Distance to the limit point s* (ln_f state after {limit_steps} steps, same s0)\n"
                 "black bar: step from which the token stays converged", fontsize=10)
    fig.colorbar(im, ax=ax, label="‖ln_f(s_i) − s*‖ (log scale)", shrink=_colorbar_shrink(fig))
    return fig


def _trajectory_panel(ax, xy: np.ndarray, first_step: int) -> object:
    steps = np.arange(first_step, first_step + len(xy))
    ax.plot(xy[:, 0], xy[:, 1], color="0.6", lw=0.8, zorder=1)
    sc = ax.scatter(xy[:, 0], xy[:, 1], c=steps, cmap="viridis", s=14, zorder=2)
    ax.scatter(xy[0, 0], xy[0, 1], marker="x", color="black", s=40, zorder=3)
    ax.scatter(xy[-1, 0], xy[-1, 1], marker="*", color="black", s=90, zorder=3)
    ax.tick_params(labelsize=7)
    return sc


def component_pairs(k: int) -> list[tuple[int, int]]:
    """The PCA panels' (x, y) components, 0-based: 1-2, 3-4, ...; an odd k pairs its last component with the one
    before it (k = 5: 1-2, 3-4, 4-5), so every component is drawn; one component is drawn against itself."""
    pairs = [(a, a + 1) for a in range(0, k - 1, 2)]
    if k % 2 and k > 1:
        pairs.append((k - 2, k - 1))
    return pairs or [(0, 0)]


def plot_pca_trajectories(
    projected: dict[int, np.ndarray], labels: list[str], kinds: list[str], pca: PCA, first_step: int = 1
) -> Figure:
    """Figure 12: chosen tokens (rows, in the order of `projected`) projected on pairs of principal components
    (columns, `component_pairs`: 1-2, 3-4, 5-6 for 6 components).

    projected: {position: [steps, k] coordinates}, steps starting at `first_step`. Colour = step;
    x marks the first plotted step, * the last.
    """
    rows = list(projected)
    pairs = component_pairs(pca.num_components)
    n_rows = max(1, len(rows))
    width, height = 3.6 * len(pairs) + 1.4, PCA_ROW_INCHES * n_rows + 1.0
    # A fixed grid instead of constrained layout: with 18 panels the layout solver dominates
    # the drawing time, and fixed margins look the same here.
    fig = Figure(figsize=(width, height))
    fig.subplots_adjust(left=0.9 / width, right=1 - 1.3 / width, bottom=0.55 / height, top=1 - 0.8 / height,
                        wspace=0.32, hspace=0.45)
    axes = fig.subplots(n_rows, len(pairs), squeeze=False)
    sc = None
    for r, pos in enumerate(rows):
        for c, (a, b) in enumerate(pairs):
            ax = axes[r][c]
            sc = _trajectory_panel(ax, projected[pos][:, [a, b]], first_step)
            ax.set_xlabel(f"PC{a + 1} ({100 * pca.explained_ratio[a]:.1f}%)", fontsize=8, labelpad=1)
            ax.set_ylabel(f"PC{b + 1} ({100 * pca.explained_ratio[b]:.1f}%)", fontsize=8, labelpad=1)
            ax.xaxis.set_major_locator(MaxNLocator(4))
            ax.yaxis.set_major_locator(MaxNLocator(4))
            if c == 0:
                ax.set_title(f"{drawable(labels[pos])}  [{kinds[pos]}]", fontsize=9, loc="left",
                             color=KIND_COLOURS.get(kinds[pos], "black"))
    if sc is not None:
        cax = fig.add_axes((1 - 0.95 / width, 0.25, 0.18 / width, 0.5))
        fig.colorbar(sc, cax=cax).set_label("recurrence step")
    fig.suptitle("Latent trajectories on principal components (fit on all tokens and steps)", fontsize=11)
    return fig


def plot_path_independence(
    pi: PathIndependence, labels: list[str], pca: PCA, overlay: list[int]
) -> Figure:
    """Top: per-token spread across starts vs distance to the nearest other token (log scale).
    Bottom: the chosen tokens' paths from every start, projected on PC1-PC2 (one colour per start).
    """
    T = len(labels)
    overlay = overlay[:3]
    fig = Figure(figsize=(min(16, max(11, 0.22 * T + 2)), 8.5), layout="constrained")
    grid = fig.add_gridspec(2, max(1, len(overlay)), height_ratios=[1.1, 1])
    ax = fig.add_subplot(grid[0, :])
    x = np.arange(T)
    if T <= 60:
        ax.bar(x - 0.2, pi.separation, width=0.4, label="distance to nearest other token", color="tab:gray")
        ax.bar(x + 0.2, pi.spread, width=0.4, label="spread across starts (mean pairwise)", color="tab:orange")
    else:  # bars thinner than a pixel pair are unreadable; points stay legible
        ax.plot(x, pi.separation, ".", ms=4, label="distance to nearest other token", color="tab:gray")
        ax.plot(x, pi.spread, ".", ms=4, label="spread across starts (mean pairwise)", color="tab:orange")
    ax.set_yscale("log")
    shown = np.concatenate([pi.separation, pi.spread])
    shown = shown[np.isfinite(shown) & (shown > 0)]
    if shown.size:  # headroom above the data so the legend covers nothing
        ax.set_ylim(shown.min() / 2, shown.max() * 50)
    ax.set_xlim(-0.7, T - 0.3)
    _token_axis(ax, labels, axis="x")
    ax.set_ylabel("L2 distance of final ln_f states")
    ax.legend(fontsize=8, loc="upper right", ncols=2, framealpha=0.9)
    ax.set_title(f"Path independence over {len(pi.seeds)} random starts: median spread / nearest-token "
                 f"distance = {np.median(pi.ratio):.3g}", fontsize=10)
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink"]
    for j, pos in enumerate(overlay):
        sub = fig.add_subplot(grid[1, j])
        paths = pca.transform(pi.paths[pos])  # [K, S+1, k]
        for s in range(paths.shape[0]):
            xy = paths[s, 1:, :2] if paths.shape[1] > 1 else paths[s, :, :2]
            colour = colours[s % len(colours)]
            sub.plot(xy[:, 0], xy[:, 1], color=colour, lw=1.0, alpha=0.8, label=f"seed {pi.seeds[s]}")
            sub.scatter(xy[0, 0], xy[0, 1], marker="x", color=colour, s=30)
            sub.scatter(xy[-1, 0], xy[-1, 1], marker="*", color=colour, s=70, edgecolor="black", lw=0.5)
        sub.set_title(drawable(labels[pos]), fontsize=9)
        sub.set_xlabel("PC1", fontsize=8)
        sub.set_ylabel("PC2", fontsize=8)
        sub.tick_params(labelsize=7)
        sub.xaxis.set_major_locator(MaxNLocator(5))
        sub.yaxis.set_major_locator(MaxNLocator(5))
        if j == 0:
            sub.legend(fontsize=7)
    return fig


def plot_token_correlation(correlation: dict[str, np.ndarray]) -> Figure:
    """Figure 5's collapse signal over recurrence steps: mean pairwise cosine between positions."""
    fig = Figure(figsize=(8, 4), layout="constrained")
    ax = fig.add_subplot()
    styles = [("-", "o"), ("--", "s"), (":", "^")]
    for (name, values), (ls, marker) in zip(correlation.items(), styles * len(correlation)):
        # Dashes keep a curve visible where it lies on top of another (ln_f at init is a rescale).
        ax.plot(np.arange(len(values)), values, ls=ls, marker=marker, ms=3, label=name)
    ax.axhline(1.0, color="tab:red", ls="--", lw=1, label="collapse (all positions identical)")
    ax.set_ylim(min(-0.05, min(float(np.nanmin(v)) for v in correlation.values()) - 0.05), 1.05)
    _step_axis(ax, len(next(iter(correlation.values()))) - 1)
    ax.set_ylabel("mean pairwise cosine between tokens")
    ax.set_title("Token correlation over recurrence steps", fontsize=10)
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    return fig


def plot_depth_view(entropy: np.ndarray, changes: list[list[int]], labels: list[str]) -> Figure:
    """Heatmap of next-token entropy [T, S+1] read at each step; dots mark top-1 prediction changes."""
    T, cols = entropy.shape
    fig = Figure(figsize=(11, _heatmap_height(T)), layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(entropy, aspect="auto", interpolation="nearest", cmap="viridis")
    xs = [step for row in changes for step in row]
    ys = [t for t, row in enumerate(changes) for _ in row]
    ax.scatter(xs, ys, s=10, color="white", edgecolor="black", lw=0.4)
    _token_axis(ax, labels)
    _step_axis(ax, cols - 1)
    ax.set_ylabel("token (position: text)")
    ax.set_title("Next-token entropy if the model stopped after step i\n"
                 "white dot: the top-1 prediction differs from the previous step's", fontsize=10)
    fig.colorbar(im, ax=ax, label="entropy (nats)", shrink=_colorbar_shrink(fig))
    return fig


def plot_kind_counts(counts: dict[str, int]) -> Figure:
    """Bar chart of how many tokens move as fixed points, orbits and sliders."""
    fig = Figure(figsize=(5, 3), layout="constrained")
    ax = fig.add_subplot()
    values = [counts.get(k, 0) for k in KINDS]
    bars = ax.bar(KINDS, values, color=[KIND_COLOURS[k] for k in KINDS])
    ax.bar_label(bars, fontsize=9)
    ax.set_ylabel("tokens")
    ax.set_title("Trajectory shapes", fontsize=10)
    ax.set_ylim(0, max(values + [1]) * 1.2)
    return fig


def plot_exit_gate(gate: ExitGate, labels: list[str]) -> Figure:
    """Two heatmaps, tokens down and steps 1..S across: the gate's stop probability lambda_i, and the
    cumulative exit distribution with each token's exit step at the threshold (red box) and its
    expected exit step (white dot)."""
    T, S = gate.cumulative.shape
    fig = Figure(figsize=(13, _heatmap_height(T)), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    extent = (0.5, S + 0.5, T - 0.5, -0.5)  # column i is step i + 1
    panels = [(gate.probability, "stop probability λ at step i (given the token got there)", "λ"),
              (gate.cumulative, f"cumulative exit probability; red box: exit at q={gate.threshold:g}, "
               "white dot: expected exit step", "P(exit at a step ≤ i)")]
    for ax, (values, title, bar) in zip(axes, panels):
        im = ax.imshow(values, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=1, extent=extent)
        _step_axis(ax, S)
        ax.set_xlim(0.5, S + 0.5)
        ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=ax, label=bar, shrink=_colorbar_shrink(fig))
    for t, step in enumerate(gate.exit_step):
        axes[1].add_patch(Rectangle((step - 0.5, t - 0.5), 1, 1, fill=False, edgecolor="red", lw=1.5))
    axes[1].scatter(gate.expected_step, np.arange(T), s=12, color="white", edgecolor="black", lw=0.5, zorder=3)
    _token_axis(axes[0], labels)
    axes[0].set_ylabel("token (position: text)")
    fig.suptitle(f"The learned exit gate over {S} steps", fontsize=10)
    return fig
