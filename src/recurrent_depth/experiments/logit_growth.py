"""Does the max attention logit grow like eta^2 T^2 under Muon and eta^2 T under Adam (research notes)?

The notes' argument ("Muon vs Adam"): a Muon step moves sigma_max(W_Q), sigma_max(W_K) by up to
eta, so with persistent alignment the logit l ~ sigma_Q sigma_K grows like eta^2 T^2 and saturates
(reaches a threshold C) at T_sat ~ 1/eta; Adam's random-walk-like growth gives l ~ eta^2 T and
T_sat ~ 1/eta^2. This experiment trains one small recurrent-depth model (byte-level, on a corpus)
with Muon and with AdamW at several learning rates, plain, with QK-norm and with QK-clip, records
the max pre-softmax logit of every step (over all layers and recurrence steps, from the training
forward), and fits

* the growth exponent p in  S(t) - S(0) ~ t^p  (t = updates done) by least squares on log-log over
  [t_min, T_sat) (T_sat: first t with S >= C or S not finite, else the end of the run), with a 95% interval
  from the fit's standard error (optimistic: neighbouring steps are correlated) and, across the
  learning rates, the mean with a 95% t-interval;
* the slope q in  T_sat ~ eta^q  over the learning rates whose plain run saturated (T_sat >= 1).

"Matches" means the theory's value (p = 2 Muon, 1 Adam; q = -1 Muon, -2 Adam) lies inside the
interval. Output: `logit_growth.json` and `logit_growth.png` in `out`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import recurrent_depth as rd
from recurrent_depth.config import is_int, is_real
from recurrent_depth.experiments.common import BYTE_VOCAB, ByteWindows, byte_tokens, train_fixed_depth
from recurrent_depth.files import check_out_dir, finite_or_null
from recurrent_depth.train.optim import OptimConfig

THEORY = {"muon": {"exponent": 2.0, "t_sat_slope": -1.0}, "adamw": {"exponent": 1.0, "t_sat_slope": -2.0}}
VARIANTS = ("plain", "qk-norm", "qk-clip")


@dataclass
class LogitGrowthConfig:
    muon_lrs: tuple[float, ...] = (0.01, 0.02, 0.04)
    # "torch": torch.optim.Muon (each fused weight one matrix, its own lr scale); "k2": Kimi K2's Muon
    # (q/k/v and gate/up orthogonalised apart, AdamW-RMS-matched lr, decoupled weight decay 0.1: the
    # "k2-muon" optimizer preset), whose lrs are AdamW-sized (e.g. --muon-lrs 0.001,0.002,0.004).
    muon_recipe: str = "torch"
    adamw_lrs: tuple[float, ...] = (1e-3, 2e-3, 4e-3)
    variants: tuple[str, ...] = VARIANTS
    steps: int = 150
    hidden_size: int = 64
    num_heads: int = 4
    recurrence: int = 2  # core steps per forward, all with gradients
    batch_size: int = 8
    seq_len: int = 64
    saturation: float = 8.0  # C: the logit at which softmax is taken to saturate
    qk_clip_tau: float = 5.0
    fit_start: int = 5  # t_min of the fit window (the first steps are a transient)
    aux_lr: float = 3e-3  # AdamW lr of the embedding and norms in the Muon runs
    corpus: str = "stdlib"
    seed: int = 0
    out: str = "runs/logit-growth"

    def __post_init__(self) -> None:
        unknown = sorted(set(self.variants) - set(VARIANTS))
        # (none: nothing would run; one twice: all its runs ran twice, the summary keeping one of each)
        if unknown or not self.variants or len(set(self.variants)) != len(self.variants):
            raise ValueError(f"logit-growth variants {list(self.variants)}: choose some of {list(VARIANTS)}, "
                             f"each once")
        for name in ("muon_lrs", "adamw_lrs"):
            lrs = getattr(self, name)
            # distinct: the summary keys its fits by lr, and the T_sat-vs-lr fit needs different lrs (a NaN or
            # inf lr would fail only when its runs start, after the other optimizer's runs)
            if len(lrs) < 2 or len(set(lrs)) != len(lrs) or not all(math.isfinite(lr) and lr > 0 for lr in lrs):
                raise ValueError(f"{name}={list(lrs)}: logit-growth needs at least 2 learning rates per "
                                 f"optimizer, distinct, finite and > 0")
        if not (isinstance(self.fit_start, int) and self.fit_start >= 1):  # (t = 0 has no place on a log axis)
            raise ValueError(f"fit_start={self.fit_start!r} must be an integer >= 1")
        if not (isinstance(self.steps, int) and self.steps > self.fit_start + 3):
            raise ValueError(f"steps={self.steps!r} must be an integer > fit_start + 3 = {self.fit_start + 3}")
        if self.muon_recipe not in ("torch", "k2"):
            raise ValueError(f"muon_recipe={self.muon_recipe!r} is unknown; choose 'torch' or 'k2'")
        # (a NaN saturation never saturates: the whole run wrote T_sat None everywhere; a NaN tau failed only when
        # the first qk-clip run started, after two full runs; recurrence 0 failed as "TrainConfig.backprop_depth")
        for name in ("saturation", "qk_clip_tau", "aux_lr"):
            value = getattr(self, name)
            if not is_real(value) or value <= 0:
                raise ValueError(f"{name}={value!r} is invalid: expected a finite number > 0")
        for name in ("hidden_size", "num_heads", "recurrence", "batch_size", "seq_len"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: expected an integer >= 1")
        for variant in self.variants:  # (a shape the model refuses: before --out is made, not at the first run)
            growth_model_config(self, variant)


def growth_model_config(cfg: LogitGrowthConfig, variant: str) -> rd.ModelConfig:
    return rd.ModelConfig(
        vocab_size=BYTE_VOCAB, hidden_size=cfg.hidden_size, num_heads=cfg.num_heads,
        intermediate_size=int(cfg.hidden_size * 2.75), prelude_layers=1, core_layers=1, coda_layers=1,
        mean_recurrence=cfg.recurrence, mean_backprop_depth=cfg.recurrence, max_seq_len=cfg.seq_len,
        qk_norm=variant == "qk-norm", init_scale=0.0,  # s_0 = 0: the logits depend on the weights alone
    )


def growth_model(cfg: LogitGrowthConfig, variant: str) -> rd.RecurrentDepthLM:
    torch.manual_seed(cfg.seed)
    return rd.RecurrentDepthLM(growth_model_config(cfg, variant))


def growth_optimizer(cfg: LogitGrowthConfig, optimizer: str, lr: float) -> OptimConfig:
    """Constant lr, no clipping; Muon at `lr` for the block matrices, AdamW at `aux_lr` for the rest."""
    if optimizer == "muon" and cfg.muon_recipe == "k2":
        return OptimConfig.from_preset("k2-muon", lr=cfg.aux_lr, muon_lr=lr, grad_clip=None, warmup_steps=0,
                                       cooldown_fraction=None)
    if optimizer == "muon":
        return OptimConfig(name="muon", lr=cfg.aux_lr, muon_lr=lr, grad_clip=None)
    return OptimConfig(name="adamw", lr=lr, grad_clip=None)


def run_one(cfg: LogitGrowthConfig, tokens: torch.Tensor, optimizer: str, lr: float, variant: str) -> dict:
    """Train one model; return its per-step max logit (NaN where the forward's logits were not finite: a
    diverged run is a result) and loss."""
    records: list[dict] = []
    result = train_fixed_depth(
        growth_model(cfg, variant), growth_optimizer(cfg, optimizer, lr), ByteWindows(tokens, cfg.seq_len, cfg.seed),
        cfg.steps, cfg.recurrence, cfg.batch_size, on_step=lambda _, record: records.append(record),
        record_max_logit=True, qk_clip=cfg.qk_clip_tau if variant == "qk-clip" else None)
    max_logit = [math.nan if r["max_logit"] is None else r["max_logit"] for r in records]  # (None: not finite)
    return {"optimizer": optimizer, "lr": lr, "variant": variant, "max_logit": max_logit,
            "clipped_heads": [r["qk_clipped_heads"] for r in records], "loss": result.losses}


def ols(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Least-squares slope of y on x with its standard error and a 95% interval."""
    from scipy import stats

    n = len(x)
    fit = stats.linregress(x, y)
    half = float(stats.t.ppf(0.975, n - 2) * fit.stderr) if n > 2 else float("inf")
    return {"slope": float(fit.slope), "stderr": float(fit.stderr), "ci95": [float(fit.slope) - half,
            float(fit.slope) + half], "points": n}


def saturation_step(series: list[float], threshold: float) -> int | None:
    """T_sat: the number of updates after which the max logit first reaches the threshold, or None.

    `series[t]` is the max logit of the forward after t updates (it is recorded by step t + 1,
    whose forward runs before its own update), so series[0] is the initial model's. A non-finite value
    (the logits overflowed: the run diverged) counts as reached."""
    for step, value in enumerate(series):
        if not math.isfinite(value) or value >= threshold:
            return step
    return None


def peak(series: list[float]) -> float:
    """The run's largest max logit; inf once it diverged (a NaN would make `max` depend on the order)."""
    return max(v if math.isfinite(v) else math.inf for v in series)


def growth_fit(series: list[float], cfg: LogitGrowthConfig) -> dict[str, Any] | None:
    """Fit S(t) - S(0) ~ t^p on t in [fit_start, T_sat) (t = updates done); None without enough points."""
    s = np.asarray(series, dtype=np.float64)
    t = np.arange(len(s), dtype=np.float64)
    t_sat = saturation_step(series, cfg.saturation)
    end = t_sat if t_sat is not None else len(s)
    window = slice(cfg.fit_start, end)
    growth = s[window] - s[0]
    keep = growth > 0
    if keep.sum() < 4:
        return None
    fit = ols(np.log(t[window][keep]), np.log(growth[keep]))
    return {**fit, "window": [int(t[window][keep][0]), int(t[window][keep][-1])], "t_sat": t_sat}


def interval_of_mean(values: list[float]) -> list[float] | None:
    from scipy import stats

    if len(values) < 2:
        return None
    mean, sd = float(np.mean(values)), float(np.std(values, ddof=1))
    half = float(stats.t.ppf(0.975, len(values) - 1) * sd / math.sqrt(len(values)))
    return [mean - half, mean + half]


def summarise(runs: list[dict], cfg: LogitGrowthConfig) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for optimizer, lrs in (("muon", cfg.muon_lrs), ("adamw", cfg.adamw_lrs)):
        plain = [r for r in runs if r["optimizer"] == optimizer and r["variant"] == "plain"]
        fits = {str(r["lr"]): growth_fit(r["max_logit"], cfg) for r in plain}
        exponents = [f["slope"] for f in fits.values() if f is not None]
        across = interval_of_mean(exponents)
        theory = THEORY[optimizer]
        t_sats = [(r["lr"], saturation_step(r["max_logit"], cfg.saturation)) for r in plain]
        # T_sat = 0 (saturated before any update) times no growth, and log 0 has no place in the fit
        reached = [(lr, t) for lr, t in t_sats if t]
        t_sat_fit = None
        if len(reached) >= 3:
            t_sat_fit = ols(np.log([lr for lr, _ in reached]), np.log([t for _, t in reached]))
        mine = [r for r in runs if r["optimizer"] == optimizer]
        peaks = {v: {str(r["lr"]): peak(r["max_logit"]) for r in mine if r["variant"] == v} for v in cfg.variants}
        summary[optimizer] = {
            "learning_rates": list(lrs),
            "growth_fits": fits,
            "exponent_mean": float(np.mean(exponents)) if exponents else None,
            "exponent_ci95_across_lrs": across,
            "theory_exponent": theory["exponent"],
            "exponent_matches": bool(across is not None and across[0] <= theory["exponent"] <= across[1]),
            "t_sat": {str(lr): t for lr, t in t_sats},
            "t_sat_vs_lr_fit": t_sat_fit,
            "theory_t_sat_slope": theory["t_sat_slope"],
            "t_sat_slope_matches": bool(t_sat_fit is not None
                                        and t_sat_fit["ci95"][0] <= theory["t_sat_slope"] <= t_sat_fit["ci95"][1]),
            "peak_max_logit": peaks,
        }
    return summary


def plot(runs: list[dict], summary: dict[str, Any], cfg: LogitGrowthConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    styles = {"plain": "-", "qk-norm": ":", "qk-clip": "--"}
    for ax, optimizer in zip(axes[:2], ("muon", "adamw"), strict=True):
        lrs = cfg.muon_lrs if optimizer == "muon" else cfg.adamw_lrs
        colors = dict(zip(lrs, plt.cm.viridis(np.linspace(0, 0.85, len(lrs))), strict=True))
        for r in runs:
            if r["optimizer"] != optimizer:
                continue
            steps = np.arange(1, len(r["max_logit"]))  # updates done; t = 0 has no place on a log axis
            ax.plot(steps, r["max_logit"][1:], styles[r["variant"]], color=colors[r["lr"]],
                    label=f"lr {r['lr']:g} {r['variant']}")
        ax.axhline(cfg.saturation, color="grey", lw=0.8)
        ax.axhline(cfg.qk_clip_tau, color="red", lw=0.6, ls="--")
        s = summary[optimizer]
        ci = s["exponent_ci95_across_lrs"]
        ci_text = f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""
        mean = s["exponent_mean"]
        ax.set_title(f"{optimizer}: S-S0 ~ t^p, p = {mean:.2f}{ci_text} (theory {s['theory_exponent']:g})"
                     if mean is not None else optimizer, fontsize=9)
        # log axes need a point to draw: none when every run diverged at its first update (all NaN)
        shown = [v for r in runs if r["optimizer"] == optimizer for v in r["max_logit"][1:]]
        if any(math.isfinite(v) and v > 0 for v in shown):
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.set_xlabel("updates t")
        ax.set_ylabel("max pre-softmax logit (all layers, all recurrence steps)")
        ax.legend(fontsize=6, ncol=2)
    ax = axes[2]
    for optimizer, marker in (("muon", "o"), ("adamw", "s")):
        pts = [(float(lr), t) for lr, t in summary[optimizer]["t_sat"].items() if t]  # (log axes: t >= 1)
        if pts:
            ax.plot(*zip(*pts, strict=True), marker=marker, label=optimizer)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("learning rate (Muon: muon_lr)")
    ax.set_ylabel(f"T_sat (first step with max logit >= {cfg.saturation:g})")
    ax.set_title("saturation time vs lr (theory: Muon slope -1, Adam -2)", fontsize=9)
    if ax.get_legend_handles_labels()[0]:  # no run saturated: no points, and matplotlib warns on an empty legend
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_logit_growth(cfg: LogitGrowthConfig, log=print) -> dict[str, Any]:
    out = Path(cfg.out)
    check_out_dir(out)  # (an existing file: one line naming it, not mkdir's bare errno)
    tokens = byte_tokens(cfg.corpus, max_bytes=1_000_000)
    ByteWindows(tokens, cfg.seq_len, cfg.seed)  # (a corpus shorter than a window: refused here, not at the first run)
    out.mkdir(parents=True, exist_ok=True)  # (after the corpus loads: a bad --corpus leaves no empty --out)
    runs = []
    start = time.perf_counter()
    for optimizer, lrs in (("muon", cfg.muon_lrs), ("adamw", cfg.adamw_lrs)):
        for lr in lrs:
            for variant in cfg.variants:
                runs.append(run_one(cfg, tokens, optimizer, lr, variant))
                log(f"{optimizer:<6} lr {lr:<7g} {variant:<8} peak max logit {peak(runs[-1]['max_logit']):8.2f}  "
                    f"final loss {runs[-1]['loss'][-1]:.3f}  ({time.perf_counter() - start:.0f}s)")
    summary = summarise(runs, cfg)
    result = {"config": asdict(cfg), "summary": summary, "runs": runs,
              "seconds": time.perf_counter() - start, "torch_threads": torch.get_num_threads()}
    # strict JSON: a diverged run's NaN / inf (max logit, loss, peak) as null
    (out / "logit_growth.json").write_text(json.dumps(finite_or_null(result), indent=1, allow_nan=False) + "\n")
    plot(runs, summary, cfg, out / "logit_growth.png")
    return result


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"{'optimizer':<8}{'lr':>9}{'p (fit)':>9}{'95% CI':>18}{'window':>10}{'T_sat':>7}"]
    for optimizer, s in summary.items():
        for lr, fit in s["growth_fits"].items():
            if fit is None:
                lines.append(f"{optimizer:<8}{lr:>9}{'-':>9}")
                continue
            lo, hi = fit["ci95"]
            lines.append(f"{optimizer:<8}{lr:>9}{fit['slope']:>9.2f}{f'[{lo:.2f}, {hi:.2f}]':>18}"
                         f"{'{}-{}'.format(*fit['window']):>10}{str(fit['t_sat']):>7}")
        ci = s["exponent_ci95_across_lrs"]
        mean = s["exponent_mean"]
        # no interval (fewer than 2 lrs gave a fit) tests nothing: say so rather than "NOT consistent"
        verdict = ("no verdict: fewer than 2 lrs gave a fit" if ci is None
                   else "consistent" if s["exponent_matches"] else "NOT consistent")
        lines.append(f"  {optimizer}: exponent {mean if mean is None else round(mean, 2)} "
                     f"(95% CI across lrs {None if ci is None else [round(c, 2) for c in ci]}), theory "
                     f"{s['theory_exponent']:g}: {verdict}")
        fit = s["t_sat_vs_lr_fit"]
        if fit is None:
            lines.append(f"  {optimizer}: T_sat >= 1 at fewer than 3 lrs ({s['t_sat']}): no T_sat-vs-lr fit")
        else:
            lines.append(f"  {optimizer}: T_sat ~ lr^{fit['slope']:.2f} (95% CI [{fit['ci95'][0]:.2f}, "
                         f"{fit['ci95'][1]:.2f}]), theory {s['theory_t_sat_slope']:g}: "
                         f"{'consistent' if s['t_sat_slope_matches'] else 'NOT consistent'}")
        lines.append(f"  {optimizer}: peak max logit by variant {s['peak_max_logit']}")
    return "\n".join(lines)
