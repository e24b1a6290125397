"""One call from a prompt to a report: `analyze` computes, `write_report` writes.

    result = analyze(model, input_ids, token_texts=texts, decode=decode, config=AnalysisConfig())
    paths = write_report(result, "runs/analysis")   # PNGs, report.html, analysis.json

The HTML page is self-contained: every figure is embedded as a base64 PNG, so it can be mailed
or attached to an issue as a single file.
"""

from __future__ import annotations

import base64
import html
import io
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor

from recurrent_depth.analysis import plots
from recurrent_depth.analysis.classify import (
    KINDS,
    MIN_STEPS,
    ClassifierThresholds,
    TrajectoryShape,
    classify_tokens,
    count_kinds,
)
from recurrent_depth.analysis.convergence import (
    DEFAULT_CONVERGE_TOL,
    DEFAULT_LIMIT_STEPS,
    distance_to_limit,
    limit_norms,
    steps_to_converge,
)
from recurrent_depth.analysis.correlation import token_correlation
from recurrent_depth.analysis.depth_view import change_points, prediction_arrays, report_steps, settling_step
from recurrent_depth.analysis.exit_gate import ExitGate, exit_gate_along, has_exit_gate
from recurrent_depth.analysis.path_independence import PathIndependence, fixed_start_reason, path_independence
from recurrent_depth.analysis.pca import PCA, fit_trajectory_pca
from recurrent_depth.analysis.trajectory import (
    DEFAULT_MAX_IN_MEMORY_BYTES,
    Trajectory,
    collect_trajectory,
    estimate_bytes,
    remove_trajectory,
    resolve_init_scale,
)
from recurrent_depth.config import is_int, is_real
from recurrent_depth.files import atomic_write_bytes, atomic_write_text, finite_or_null, link_note, lock_directory

if TYPE_CHECKING:
    from recurrent_depth.serving.text import TextCodec

FIGURES = {
    "convergence": ("convergence.png", "Distance to s* per token and step (paper fig. 11)"),
    "pca": ("pca_trajectories.png", "Trajectories on pairs of principal components, 1-2, 3-4, ... (paper fig. 12)"),
    "path_independence": ("path_independence.png", "Path independence across random starts"),
    "token_correlation": ("token_correlation.png", "Token correlation over steps (paper fig. 5)"),
    "depth_view": ("depth_view.png", "Next-token entropy at each depth and where the top prediction changes"),
    "kinds": ("trajectory_kinds.png", "Counts of trajectory shapes"),
    "exit_gate": ("exit_gate.png", "The learned exit gate: stop probability per step and cumulative exit distribution"),
}
LABEL_CHARS = 14
REPLACEMENT = "\ufffd"  # what decoding an incomplete UTF-8 sequence yields


@dataclass
class AnalysisConfig:
    """Settings of one analysis (the CLI flags of `rdepth analyze` map onto these)."""

    num_steps: int = 64  # S: recurrence steps recorded and plotted
    limit_steps: int = DEFAULT_LIMIT_STEPS  # steps to the limit point s* (>= num_steps)
    num_starts: int = 4  # random s0 for path independence
    # scale of the random s0; None = the model config's (Huginn 1, Parcae's like-init 1/sqrt(h), its zero init 0);
    # 0 = zeros (path independence then uses the model config's, or 1 where that is 0 too)
    init_scale: float | None = None
    seed: int = 0
    converge_tol: float = DEFAULT_CONVERGE_TOL  # relative distance to s* counted as converged
    tokens: list[int] | None = None  # positions for the PCA plots; None = chosen automatically
    max_plot_tokens: int = 6
    max_tokens: int = 256  # longer prompts are refused: heatmaps beyond this are unreadable
    pca_components: int = 6
    save_states: bool = True  # keep the .npy trajectory in OUT/states
    thresholds: ClassifierThresholds = field(default_factory=ClassifierThresholds)

    def validate(self) -> None:
        def need(ok: bool, name: str, expected: str) -> None:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: expected {expected}")

        need(is_int(self.num_steps) and self.num_steps >= MIN_STEPS, "num_steps",
             f"an integer >= {MIN_STEPS} (trajectory shapes need a tail)")
        need(is_int(self.limit_steps) and self.limit_steps >= self.num_steps, "limit_steps",
             f"an integer >= num_steps ({self.num_steps})")
        need(is_int(self.num_starts) and self.num_starts >= 2, "num_starts", "an integer >= 2")
        need(self.init_scale is None or (is_real(self.init_scale) and self.init_scale >= 0), "init_scale",
             "None (the model config's) or a finite number >= 0")
        # torch's generators take 64-bit seeds: 2**70 was "Overflow when unpacking long long", naming nothing
        need(is_int(self.seed) and self.seed >= -(2**63) and self.seed + self.num_starts < 2**63, "seed",
             f"an integer in [-2**63, 2**63 - {self.num_starts}) (the starts are seeded seed + 1 .. seed + num_starts)")
        need(isinstance(self.converge_tol, float | int) and 0 < self.converge_tol < 1, "converge_tol",
             "a number in (0, 1)")
        # a figure taller than that took minutes to draw (230 tokens: 3 minutes, a PNG 76,010 pixels tall)
        rows = "(the PCA figure draws one row of panels, 3 inches tall, per token)"
        need(is_int(self.max_plot_tokens) and 1 <= self.max_plot_tokens <= plots.MAX_PCA_ROWS, "max_plot_tokens",
             f"an integer from 1 to {plots.MAX_PCA_ROWS} {rows}")
        need(is_int(self.max_tokens) and self.max_tokens >= 2, "max_tokens", "an integer >= 2")
        need(is_int(self.pca_components) and self.pca_components >= 2, "pca_components", "an integer >= 2")
        need(self.tokens is None or (len(self.tokens) > 0 and all(is_int(t) for t in self.tokens)),
             "tokens", "None or a non-empty list of token positions")
        need(self.tokens is None or len(set(self.tokens)) <= plots.MAX_PCA_ROWS, "tokens",
             f"at most {plots.MAX_PCA_ROWS} different positions {rows}")


@dataclass
class AnalysisResult:
    """Everything `write_report` draws; arrays are per real token of the analysed prompt."""

    config: AnalysisConfig
    prompt: str | None
    token_ids: list[int]
    labels: list[str]
    trajectory: Trajectory
    distance: np.ndarray  # [T, S+1]
    converged_at: np.ndarray  # [T], -1 = not within S steps
    pca: PCA
    projected: dict[int, np.ndarray]  # chosen position -> [S, k]
    shapes: list[TrajectoryShape]
    counts: dict[str, int]
    path: PathIndependence | None  # None where every run starts from the same s_0: model_info["fixed_start"] says why
    correlation: dict[str, np.ndarray]  # "raw states" / "ln_f states" -> [S+1]
    entropy: np.ndarray  # [T, S+1]
    top_ids: np.ndarray  # [T, S+1]
    top_probs: np.ndarray  # [T, S+1]
    top_texts: list[list[str]]  # [T][S+1] decoded top predictions
    settles_at: np.ndarray  # [T]
    chosen: list[int]
    timings: dict[str, float]
    model_info: dict[str, Any] = field(default_factory=dict)
    exit_gate: ExitGate | None = None  # models with a learned exit gate (Ouro) only

    def to_json_dict(self) -> dict[str, Any]:
        cfg = asdict(self.config)
        S = self.config.num_steps
        steps = report_steps(S)
        tokens = []
        for t, label in enumerate(self.labels):
            tokens.append({
                "position": t,
                "id": self.token_ids[t],
                "label": label,
                "converged_at": int(self.converged_at[t]),
                "distance_to_limit": self.distance[t].tolist(),
                "shape": self.shapes[t].to_dict(),
                "path_spread": None if self.path is None else float(self.path.spread[t]),
                "path_separation": None if self.path is None else float(self.path.separation[t]),
                "path_ratio": None if self.path is None else float(self.path.ratio[t]),
                "entropy": self.entropy[t].tolist(),
                "top_id": self.top_ids[t].tolist(),
                "top_prob": self.top_probs[t].tolist(),
                "top_prediction_at": {str(s): self.top_texts[t][s] for s in steps},
                "prediction_settles_at": int(self.settles_at[t]),
                **({} if self.exit_gate is None else {"exit_gate": self.exit_gate.token_dict(t)}),
            })
        return {
            "prompt": self.prompt,
            "model": self.model_info,
            "config": cfg,
            "num_tokens": len(self.labels),
            "trajectory_counts": self.counts,
            "chosen_tokens": self.chosen,
            "pca_explained_ratio": self.pca.explained_ratio.tolist(),
            "path_independence": ({"skipped": self.model_info["fixed_start"]} if self.path is None
                                  else self.path.summary()),
            "token_correlation": {k: v.tolist() for k, v in self.correlation.items()},
            "convergence": {
                "tolerance": self.config.converge_tol,
                "converged_tokens": int((self.converged_at >= 0).sum()),
                "median_steps_to_converge": (
                    float(np.median(self.converged_at[self.converged_at >= 0]))
                    if (self.converged_at >= 0).any() else None
                ),
            },
            **({} if self.exit_gate is None else {"exit_gate": self.exit_gate.summary()}),
            "timings_s": self.timings,
            "tokens": tokens,
        }


def token_decoder(codec: TextCodec) -> Callable[[int], str]:
    """id -> a text that tells tokens apart, for labels and predictions (`analyze`'s token_texts and decode).

    A token's decoded text where it is whole UTF-8; where it is not (one byte of "世" from a byte-level BPE
    decodes to U+FFFD, like every other such byte) its bytes as SentencePiece writes them, `<0xE4>`, with any
    whole characters around them kept; `<id N>` for an id the tokenizer does not have (an embedding's padding
    rows, which a model may still predict, decode to '').
    """

    def text(token: int) -> str:
        if codec.tokenizer is None or codec.tokenizer.id_to_token(token) is None:
            return f"<id {token}>"
        decoded = codec.decode([token], skip_special_tokens=False)
        if REPLACEMENT not in decoded or token in codec.special_ids:
            return decoded
        return bytes_text(codec.token_bytes(token))  # the bytes the tokenizer itself maps the token to

    return text


def bytes_text(raw: bytes) -> str:
    """Bytes as text: whole UTF-8 characters as they are, every other byte as `<0xHH>` (b" \\xe4" -> " <0xE4>")."""
    parts: list[str] = []
    while raw:
        try:
            parts.append(raw.decode("utf-8"))
            break
        except UnicodeDecodeError as exc:
            parts.append(raw[: exc.start].decode("utf-8"))
            parts.extend(f"<0x{b:02X}>" for b in raw[exc.start : exc.end])
            raw = raw[exc.end :]
    return "".join(parts)


def token_label(position: int, text: str) -> str:
    """`12: ' dots'`: the position and the token's text, escaped (newlines visible), trimmed."""
    shown = repr(text)
    if len(shown) > LABEL_CHARS:
        shown = shown[: LABEL_CHARS - 2] + "…" + shown[-1]
    return f"{position}: {shown}"


def choose_tokens(shapes: list[TrajectoryShape], limit: int) -> list[int]:
    """Positions worth plotting: the most-moving tokens of each kind, taken in turn, in order."""
    by_kind = {
        kind: sorted((t for t, s in enumerate(shapes) if s.kind == kind), key=lambda t: -shapes[t].extent)
        for kind in ("orbit", "slider", "fixed point")
    }
    chosen: list[int] = []
    while len(chosen) < min(limit, len(shapes)):
        progressed = False
        for kind in by_kind:
            if by_kind[kind] and len(chosen) < limit:
                chosen.append(by_kind[kind].pop(0))
                progressed = True
        if not progressed:
            break
    return sorted(chosen)


def _as_batch(input_ids: Tensor | list[int]) -> Tensor:
    ids = torch.as_tensor(input_ids)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        # a cast would silently turn 1.5 into token 1
        raise ValueError(f"input_ids must hold integer token ids, got dtype {ids.dtype}")
    ids = ids.long()
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"input_ids must be one prompt [T] or [1, T], got shape {tuple(ids.shape)}")
    return ids


def check_prompt(
    model: torch.nn.Module,
    input_ids: Tensor | list[int],
    config: AnalysisConfig,
    *,
    in_memory: bool,
    token_texts: list[str] | None = None,
) -> Tensor:
    """`input_ids` as one [1, T] prompt, or a ValueError line saying why `analyze` refuses it (too short, longer
    than max_tokens or the model's max_seq_len, a --tokens position outside it, too large to hold in memory).

    `rdepth analyze` calls it before its progress line, `analyze` before any work. in_memory: the trajectory
    stays in memory (no states_dir)."""
    ids = _as_batch(input_ids)
    n_tokens = ids.shape[1]
    if n_tokens < 2:
        raise ValueError(f"the prompt has {n_tokens} token; the analysis compares tokens and needs at least 2")
    if n_tokens > config.max_tokens:
        raise ValueError(
            f"the prompt has {n_tokens} tokens, more than max_tokens={config.max_tokens} (--max-tokens); per-token "
            "plots stop being readable beyond that: shorten the prompt or raise the limit"
        )
    if n_tokens > model.config.max_seq_len:  # (collect_trajectory refuses it too, but only once the run starts)
        raise ValueError(f"the prompt has {n_tokens} tokens but the model's max_seq_len is "
                         f"{model.config.max_seq_len}; shorten the prompt")
    if token_texts is not None and len(token_texts) != n_tokens:
        raise ValueError(f"token_texts has {len(token_texts)} entries for {n_tokens} tokens")
    if config.tokens is not None:
        bad = [t for t in config.tokens if not 0 <= t < n_tokens]
        if bad:
            raise ValueError(
                f"tokens={config.tokens} (--tokens) has positions {bad} outside the prompt's 0..{n_tokens - 1}")
    if in_memory:
        # collect_trajectory's own refusal names its out_dir=, which neither analyze's callers nor the CLI have
        size = estimate_bytes(config.num_steps, 1, n_tokens, model.config.hidden_size)
        if size > DEFAULT_MAX_IN_MEMORY_BYTES:
            raise ValueError(
                f"the trajectory needs {size / 2**20:.0f} MiB, too much to keep in memory: keep the states on disk "
                "(states_dir=...; save_states=True; rdepth analyze without --no-states), or use fewer steps or tokens"
            )
    return ids


def analyze(
    model: torch.nn.Module,
    input_ids: Tensor | list[int],
    *,
    token_texts: list[str] | None = None,
    decode: Callable[[int], str] | None = None,
    config: AnalysisConfig | None = None,
    prompt: str | None = None,
    states_dir: str | Path | None = None,
    model_name: str | None = None,
    progress: bool = False,
) -> AnalysisResult:
    """Run every analysis of the report on one prompt.

    Args:
        input_ids: [T] or [1, T] token ids (2 <= T <= config.max_tokens and the model's max_seq_len).
        token_texts: the text of each input token, for labels (default: the ids).
        decode: id -> text for predicted tokens (default: str(id)).
        states_dir: stream the trajectory to .npy memory maps here (default: in memory).
        model_name: recorded in the report (e.g. the model directory).
    """
    cfg = config or AnalysisConfig()
    cfg.validate()
    # the s0 scale the model's forward uses unless told otherwise; the report records the value used
    cfg = replace(cfg, init_scale=resolve_init_scale(model, cfg.init_scale))
    ids = check_prompt(model, input_ids, cfg, in_memory=states_dir is None, token_texts=token_texts)
    n_tokens = ids.shape[1]
    decode = decode or str
    texts = token_texts or [str(int(i)) for i in ids[0]]
    labels = [token_label(t, text) for t, text in enumerate(texts)]
    timings: dict[str, float] = {}
    clock = time.perf_counter()

    traj = collect_trajectory(
        model, ids, cfg.num_steps, init_scale=cfg.init_scale, seed=cfg.seed, limit_steps=cfg.limit_steps,
        out_dir=states_dir, progress=progress,
    )
    timings["trajectory"] = time.perf_counter() - clock
    clock = time.perf_counter()

    distance = distance_to_limit(traj)
    converged_at = steps_to_converge(distance, limit_norms(traj), cfg.converge_tol)
    if cfg.limit_steps == cfg.num_steps:
        # s* is then step S itself (distance 0 by construction): being within tol only there is no convergence
        converged_at[converged_at == cfg.num_steps] = -1
    normed = traj.states("normed")
    for step in range(normed.shape[0]):  # say where, not classify's "x contains NaN" (one step at a time: memmaps)
        bad = np.flatnonzero(~np.isfinite(np.asarray(normed[step])).all(axis=-1))
        if bad.size:
            dtype = next((p.dtype for p in model.parameters()), None)
            raise ValueError(
                f"the model's state is NaN or inf at step {step} (token {int(bad[0])}, {bad.size} of {n_tokens} "
                f"tokens) in {dtype}: the weights or the recurrence diverge, there is nothing to analyse "
                "(float16 may overflow where float32 or bfloat16 do not)"
            )
    shapes = classify_tokens(normed, cfg.thresholds)
    counts = count_kinds(shapes)
    # --tokens in the order typed (a repeat dropped): its first 3 are the ones path independence draws
    chosen = choose_tokens(shapes, cfg.max_plot_tokens) if cfg.tokens is None else list(dict.fromkeys(cfg.tokens))
    pca = fit_trajectory_pca(normed, cfg.pca_components, skip_initial=True)
    projected = {t: pca.transform(np.asarray(normed[1:, t])) for t in chosen}
    correlation = {
        "raw states": _correlation_over_steps(traj.states("raw")),
        "ln_f states": _correlation_over_steps(normed),
    }
    entropy, top_ids, top_probs = prediction_arrays(traj)
    vocab_text: dict[int, str] = {}
    top_texts = [[vocab_text.setdefault(int(i), decode(int(i))) for i in row] for row in top_ids]
    gate = exit_gate_along(model, traj.states("raw")) if has_exit_gate(model) else None
    timings["measures"] = time.perf_counter() - clock
    clock = time.perf_counter()

    # Path independence needs random starts; with init_scale 0 the main run is deterministic. A model that
    # starts every run from its embedding (Ouro) has one start only: the measure would be 0 by construction.
    fixed_start = fixed_start_reason(model)
    pi = None
    if fixed_start is None:
        # a zero-s_0 main run still measures from the starts the model was trained with (Parcae: 1/sqrt(h))
        pi_scale = cfg.init_scale or resolve_init_scale(model, None) or 1.0
        seeds = [cfg.seed + 1 + k for k in range(cfg.num_starts)]
        pi = path_independence(model, ids, cfg.num_steps, seeds=seeds, positions=chosen[:3], init_scale=pi_scale,
                               progress=progress)
        timings["path_independence"] = time.perf_counter() - clock

    model_cfg = getattr(model, "config", None)
    info: dict[str, Any] = {} if model_name is None else {"name": model_name}
    if fixed_start is not None:
        info["fixed_start"] = fixed_start
    if model_cfg is not None:
        info |= {"hidden_size": model_cfg.hidden_size, "vocab_size": model_cfg.vocab_size,
                "mean_recurrence": model_cfg.mean_recurrence}
    from recurrent_depth.weight_quant import held_weights

    if (weights := held_weights(model)) is not None:  # (rdepth analyze --weights: the model as it is served)
        info["weights"] = weights
    return AnalysisResult(
        config=cfg, prompt=prompt, token_ids=[int(i) for i in ids[0]], labels=labels, trajectory=traj,
        distance=distance, converged_at=converged_at, pca=pca, projected=projected, shapes=shapes,
        counts=counts, path=pi, correlation=correlation, entropy=entropy, top_ids=top_ids,
        top_probs=top_probs, top_texts=top_texts, settles_at=settling_step(top_ids), chosen=chosen,
        timings=timings, model_info=info, exit_gate=gate,
    )


def _correlation_over_steps(states: np.ndarray) -> np.ndarray:
    """token_correlation of states [S+1, T, h] at each step: [S+1]."""
    return np.array([float(token_correlation(torch.from_numpy(np.asarray(s)))) for s in states])


def build_figures(result: AnalysisResult) -> dict[str, Figure]:
    """Every figure of the report, by the keys of `FIGURES`."""
    kinds = [s.kind for s in result.shapes]
    return {
        "convergence": plots.plot_convergence(
            result.distance, result.labels, result.converged_at, result.config.limit_steps),
        "pca": plots.plot_pca_trajectories(result.projected, result.labels, kinds, result.pca),
        **({} if result.path is None else {"path_independence": plots.plot_path_independence(
            result.path, result.labels, result.pca, result.chosen[:3])}),
        "token_correlation": plots.plot_token_correlation(result.correlation),
        "depth_view": plots.plot_depth_view(result.entropy, change_points(result.top_ids), result.labels),
        "kinds": plots.plot_kind_counts(result.counts),
        **({} if result.exit_gate is None else {"exit_gate": plots.plot_exit_gate(result.exit_gate, result.labels)}),
    }


def _png(fig: Figure) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def write_report(result: AnalysisResult, out_dir: str | Path) -> dict[str, Path]:
    """Write the PNGs, `report.html` (figures embedded) and `analysis.json` into out_dir."""
    out = Path(out_dir)
    # Every figure drawn before the first file is written: drawing is most of the time spent here, and a run
    # interrupted there must leave an earlier run's report and figures as they were, not mixed with its own.
    images = {key: _png(fig) for key, fig in build_figures(result).items()}
    out.mkdir(parents=True, exist_ok=True)
    # Each file through a temporary one renamed over its name: a symbolic link there is replaced, never written
    # through (analysis.json linked to a user's file overwrote that file), and a reader sees whole files only.
    written: dict[str, Path] = {}
    for key, data in images.items():
        path = out / FIGURES[key][0]
        atomic_write_bytes(path, data)
        written[key] = path
    for key, (name, _) in FIGURES.items():  # a figure this run has not drawn must not pass for its own
        if key not in images:
            (out / name).unlink(missing_ok=True)
    # strict JSON: a ratio that is inf (a token not identifiable) is null, not the `Infinity` no parser takes
    data = finite_or_null(result.to_json_dict())
    atomic_write_text(out / "analysis.json", json.dumps(data, indent=1, allow_nan=False) + "\n")
    written["json"] = out / "analysis.json"
    atomic_write_text(out / "report.html", render_html(result, images))
    written["html"] = out / "report.html"
    return written


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def exit_gate_rows(gate: ExitGate) -> list[list[str]]:
    """The exit gate's summary lines (measure, value): the report page's and `rdepth analyze`'s."""
    expected, exits = gate.expected_step, gate.exit_step
    return [
        [f"exit gate: expected exit step (of {gate.cumulative.shape[-1]})",
         f"mean {expected.mean():.2f}, tokens {expected.min():.2f} to {expected.max():.2f}"],
        [f"exit gate: exit step at q={gate.threshold:g}",
         f"median {np.median(exits):g}, tokens {exits.min()} to {exits.max()}"],
    ]


def render_html(result: AnalysisResult, images: dict[str, bytes]) -> str:
    """The self-contained report page (figures as data: URIs, no external resources)."""
    cfg = result.config
    S = cfg.num_steps
    data = result.to_json_dict()
    conv = data["convergence"]
    pi = data["path_independence"]
    corr_first = {k: v[1] if len(v) > 1 else v[0] for k, v in data["token_correlation"].items()}
    corr_last = {k: v[-1] for k, v in data["token_correlation"].items()}
    settings = _table(["setting", "value"], [
        ["recurrence steps S", S], ["limit point s*", f"{cfg.limit_steps} steps from the same s0"],
        ["s0", "the embedding (state_init='embedding')" if result.path is None else "zeros (init_scale=0)"
         if cfg.init_scale == 0 else f"random, init_scale={cfg.init_scale}, seed={cfg.seed}"],
        ["convergence tolerance", f"‖ln_f(s_i) − s*‖ ≤ {cfg.converge_tol} ‖s*‖ from step i on"],
        ["path independence", f"skipped: {pi['skipped']}" if result.path is None
         else f"{cfg.num_starts} starts, seeds {pi['seeds']}, init_scale={pi['init_scale']}"],
        ["model", ", ".join(f"{k}={v}" for k, v in result.model_info.items()) or "-"],
        ["time", ", ".join(f"{k} {v:.1f}s" for k, v in result.timings.items())],
    ])
    summary = _table(["measure", "value"], [
        ["tokens", len(result.labels)],
        ["converged within S steps", f"{conv['converged_tokens']} of {len(result.labels)}"],
        ["median steps to converge", conv["median_steps_to_converge"]],
        *[[f"trajectories: {k}", result.counts[k]] for k in KINDS],
        *([] if result.path is None else [
            ["path independence: median spread / nearest-token distance", f"{pi['median_ratio']:.3g}"],
            ["tokens whose spread is below their nearest-token distance",
             f"{100 * pi['fraction_ratio_below_1']:.0f}%"]]),
        *[[f"token correlation ({k}) at step 1 -> {S}", f"{corr_first[k]:.3f} -> {corr_last[k]:.3f}"]
          for k in corr_first],
        *([] if result.exit_gate is None else exit_gate_rows(result.exit_gate)),
    ])
    gate = result.exit_gate
    token_rows = []
    for t, label in enumerate(result.labels):
        shape = result.shapes[t]
        final = S
        token_rows.append([
            label, result.token_ids[t],
            result.converged_at[t] if result.converged_at[t] >= 0 else f"> {S}",
            shape.kind, f"{shape.extent:.3f}", f"{shape.straightness:.2f}", f"{shape.speed_ratio:.2f}",
            "-" if result.path is None else f"{result.path.ratio[t]:.3g}", result.settles_at[t],
            f"{result.top_texts[t][final]!r} ({result.top_probs[t][final]:.2f})", f"{result.entropy[t][final]:.2f}",
            *([] if gate is None else [f"{gate.expected_step[t]:.2f}", gate.exit_step[t]]),
        ])
    tokens_table = _table(
        ["token", "id", "converged at", "shape", "tail extent", "straightness", "speed ratio",
         "path spread / sep.", "prediction settles at", f"top prediction at {S}", "entropy",
         *([] if gate is None else ["expected exit step", f"exit step at q={gate.threshold:g}"])],
        token_rows,
    )
    steps = report_steps(S)
    depth_rows = [[label] + [repr(result.top_texts[t][s]) for s in steps] for t, label in enumerate(result.labels)]
    depth_table = _table(["token"] + [f"step {s}" for s in steps], depth_rows)
    figures = "".join(
        f'<figure id="fig-{key}"><img alt="{html.escape(FIGURES[key][1])}" '
        f'src="data:image/png;base64,{base64.b64encode(images[key]).decode("ascii")}">'
        f"<figcaption>{html.escape(FIGURES[key][1])}</figcaption></figure>"
        for key in FIGURES if key in images
    )
    prompt = result.prompt if result.prompt is not None else " ".join(map(str, result.token_ids))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>recurrent-depth analysis</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; padding: 0 1em; color: #222; }}
pre {{ background: #f4f4f4; padding: 0.8em; white-space: pre-wrap; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.85em; }}
th, td {{ border: 1px solid #ccc; padding: 0.2em 0.5em; text-align: left; font-family: monospace; }}
th {{ background: #eee; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; border: 1px solid #ddd; }}
figcaption {{ font-style: italic; color: #555; }}
</style></head><body>
<h1>What the recurrence computes: latent-space analysis</h1>
<h2>Prompt</h2><pre>{html.escape(prompt)}</pre>
<h2>Settings</h2>{settings}
<h2>Summary</h2>{summary}
<h2>Figures</h2>{figures}
<h2>Per-token measures</h2>
<p>Shapes follow the heuristic of <code>recurrent_depth.analysis.classify</code> on the last half of
the ln_f trajectory: fixed point (tail extent ≤ {cfg.thresholds.fixed_extent} or speed ratio ≤
{cfg.thresholds.converging_speed_ratio}), slider (straightness ≥ {cfg.thresholds.slider_straightness}),
else orbit.</p>
{tokens_table}
<h2>Top prediction by depth</h2>{depth_table}
</body></html>
"""


def states_dir_of(out_dir: str | Path) -> Path:
    """OUT/states, where `analyze_to_dir` keeps the trajectory; a ValueError line where it is a symbolic link:
    the run writes there, and removes an older run's files there, inside OUT only."""
    states = Path(out_dir) / "states"
    if states.is_symlink():
        raise ValueError(f"{states} is a symbolic link{link_note(states)}: the trajectory files are written, and an "
                         "older run's removed, inside the output directory only; remove the link or choose another "
                         "output directory (--out)")
    return states


def analyze_to_dir(
    model: torch.nn.Module,
    input_ids: Tensor | list[int],
    out_dir: str | Path,
    **kwargs: Any,
) -> tuple[AnalysisResult, dict[str, Path]]:
    """`analyze` then `write_report` into out_dir.

    With config.save_states the trajectory streams to .npy memory maps in OUT/states (reopen with
    `Trajectory.load`); otherwise it stays in memory (refused above 1 GiB, with a message).
    """
    out = Path(out_dir)
    config = kwargs.pop("config", None) or AnalysisConfig()
    states_dir = states_dir_of(out)
    created = not out.exists()  # a failed run removes the directory it made (an empty OUT passed for a result)
    lock, locked = None, False
    try:
        out.mkdir(parents=True, exist_ok=True)
        # One run at a time in OUT: a second one truncated the first one's memory-mapped states under it, which
        # then died of SIGBUS (no message), and the report mixed the two runs' files.
        lock = lock_directory(out, "output directory")
        locked = True  # (the lock is this run's, or there is none: a file system without locks)
        if not config.save_states:
            result = analyze(model, input_ids, config=config, **kwargs)
            files = write_report(result, out)
            remove_trajectory(states_dir)  # an older run's states would sit beside this run's report
            return result, files
        try:
            result = analyze(model, input_ids, config=config, states_dir=states_dir, **kwargs)
            return result, write_report(result, out)
        except BaseException:  # a diverging model, Ctrl-C while computing or drawing: no states without a report
            remove_trajectory(states_dir)
            raise
    except BaseException:
        # (everything in it is this run's; a run refused by another's lock on an OUT both found missing is not
        # the one that fills it)
        if created and locked and out.is_dir():
            shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            lock.close()
