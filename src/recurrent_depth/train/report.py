"""Pictures and a short report for a training run: loss curve, validation loss by depth, sampled depths.

Reads only files the trainer writes (`metrics.jsonl`, `eval.jsonl`), so it also works on a run
that another process trained. The HTML report embeds its PNGs (one self-contained file).
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


def _figure(width: float = 6.4, height: float = 4.0):
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, height), dpi=110)
    return plt, fig, ax


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or values.size < window:
        return values
    kernel = np.ones(window) / window
    padded = np.concatenate([np.full(window - 1, values[0]), values])
    return np.convolve(padded, kernel, mode="valid")


def plot_loss_curve(metrics: Sequence[dict[str, Any]], path: str | Path, evals: Sequence[dict[str, Any]] = ()) -> Path:
    """Training loss per optimizer step (raw and smoothed) plus validation loss at r̄ when available."""
    plt, fig, ax = _figure()
    steps = np.array([m["step"] for m in metrics if m.get("loss") is not None])
    losses = np.array([m["loss"] for m in metrics if m.get("loss") is not None])
    if steps.size:
        ax.plot(steps, losses, color="0.75", linewidth=0.8, label="train loss")
        ax.plot(steps, _smooth(losses, max(3, steps.size // 10)), color="C0", linewidth=1.6,
                label="train loss (moving average)")
    labelled = False
    for record in evals:
        # (eval.jsonl writes a diverged depth's loss as null: the best of the finite ones, none if none is)
        finite = [v for v in (record.get("val_loss_by_depth") or {}).values() if v is not None and np.isfinite(v)]
        if finite:
            ax.scatter([record["step"]], [min(finite)], color="C3", zorder=3, s=18,
                       label=None if labelled else "validation (best depth)")
            labelled = True
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("Training loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_val_by_depth(val_loss_by_depth: dict[str, float], path: str | Path, train_mean: float | None = None) -> Path:
    """Validation loss against test-time depth (log2 axis): the test-time scaling curve."""
    plt, fig, ax = _figure()
    depths = sorted(int(d) for d in val_loss_by_depth)
    losses = [val_loss_by_depth[str(d)] for d in depths]
    ax.plot(depths, losses, marker="o", color="C0")
    for d, v in zip(depths, losses):
        ax.annotate(f"{v:.3f}", (d, v), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    if train_mean is not None:
        ax.axvline(train_mean, color="0.5", linestyle="--", linewidth=1, label=f"training mean depth r̄={train_mean:g}")
        ax.legend()
    positive = [d for d in depths if d > 0]
    if positive and len(positive) == len(depths):
        ax.set_xscale("log", base=2)
        ax.set_xticks(depths)
        ax.set_xticklabels([str(d) for d in depths])
    ax.margins(y=0.15)  # room for the value labels
    ax.set_xlabel("test-time depth (core steps)")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title("Validation loss vs test-time depth")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_depth_histogram(depths: Sequence[int], path: str | Path, expected_mean: float | None = None) -> Path:
    """Histogram of the depths the sampler drew during training (one per micro-batch).

    expected_mean: the sampler's E[r] (r̄ + 1 for the paper's log-normal Poisson), drawn as a dashed line.
    """
    plt, fig, ax = _figure()
    values = np.asarray(depths, dtype=np.int64)
    if values.size:
        bins = np.arange(values.min(), values.max() + 2) - 0.5
        ax.hist(values, bins=bins, color="C2", edgecolor="white")
        ax.axvline(values.mean(), color="C3", linewidth=1.2, label=f"mean drawn {values.mean():.1f}")
        if expected_mean is not None:
            ax.axvline(expected_mean, color="0.4", linestyle="--", linewidth=1, label=f"expected {expected_mean:g}")
        ax.legend()
    ax.set_xlabel("sampled depth r (core steps)")
    ax.set_ylabel("micro-batches")
    ax.set_title(f"Sampled training depths ({values.size} micro-batches)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def sampled_depths(metrics: Sequence[dict[str, Any]]) -> list[int]:
    return [int(d) for m in metrics for d in m.get("num_steps", [])]


def depth_table(val_loss_by_depth: dict[str, float]) -> list[tuple[int, float, float]]:
    """(depth, loss, loss minus depth 1's) rows, sorted by depth."""
    depths = sorted(int(d) for d in val_loss_by_depth)
    first = val_loss_by_depth[str(depths[0])]
    return [(d, val_loss_by_depth[str(d)], val_loss_by_depth[str(d)] - first) for d in depths]


def format_depth_table(val_loss_by_depth: dict[str, float]) -> str:
    lines = ["depth  val loss  vs depth " + str(min(int(d) for d in val_loss_by_depth)),
             "-----  --------  ----------"]
    for d, loss, delta in depth_table(val_loss_by_depth):
        lines.append(f"{d:>5}  {loss:8.4f}  {delta:+10.4f}")
    return "\n".join(lines)


def write_training_report(
    out: str | Path, summary: dict[str, Any], images: dict[str, str | Path], sample: str | None
) -> dict:
    """Write `<out>/report.md` and a self-contained `<out>/report.html`; return their paths."""
    out = Path(out)
    title = summary.get("title", "Training report")
    facts = [
        ("model", f"{summary.get('preset')} preset, {summary.get('parameters', 0):,} parameters"),
        ("data", summary.get("data_description", "")),
        ("training", f"{summary.get('steps')} optimizer steps, {summary.get('tokens', 0):,} tokens, "
                     f"{summary.get('train_seconds', 0):.0f} s ({summary.get('tokens_per_s', 0):.0f} tokens/s)"),
        ("final train loss (mean of the last 20 steps)", f"{summary.get('final_train_loss', float('nan')):.4f}"),
        ("depth effect", summary.get("verdict", "")),
        ("total time", f"{summary.get('total_seconds', 0):.0f} s"),
    ]
    table = depth_table(summary["val_loss_by_depth"])
    versus = f"vs depth {table[0][0]}"  # (the deltas are against the smallest depth evaluated, not always 1)
    md = [f"# {title}", ""]
    md += [f"- **{k}**: {v}" for k, v in facts]
    md += ["", f"| depth | validation loss | {versus} |", "|---:|---:|---:|"]
    md += [f"| {d} | {loss:.4f} | {delta:+.4f} |" for d, loss, delta in table]
    md += [""]
    for caption, image in images.items():
        md += [f"![{caption}]({Path(image).name})", ""]
    if sample:
        md += ["## Sample completion", "", "```", sample, "```", ""]
    md_path = out / "report.md"
    md_path.write_text("\n".join(md))

    rows = "".join(f"<tr><td>{d}</td><td>{loss:.4f}</td><td>{delta:+.4f}</td></tr>" for d, loss, delta in table)
    fact_rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in facts)
    pictures = ""
    for caption, image in images.items():
        data = base64.b64encode(Path(image).read_bytes()).decode()
        pictures += (f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(caption)}">'
                     f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    sample_html = f"<h2>Sample completion</h2><pre>{html.escape(sample)}</pre>" if sample else ""
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:960px;margin:2em auto;padding:0 1em;color:#222}}
table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #ccc;padding:4px 10px;text-align:right}}
th{{text-align:left;background:#f5f5f5}}figure{{display:inline-block;margin:0.5em}}img{{max-width:440px}}
pre{{background:#f7f7f7;padding:1em;overflow-x:auto}}</style></head><body>
<h1>{html.escape(title)}</h1><table>{fact_rows}</table>
<h2>Validation loss by test-time depth</h2><table><tr><th>depth</th><th>validation loss</th><th>{versus}</th></tr>
{rows}</table>{pictures}{sample_html}</body></html>
"""
    html_path = out / "report.html"
    html_path.write_text(page)
    return {"markdown": str(md_path), "html": str(html_path)}
