"""Path independence: do different random starts s_0 end in the same place?

Following the paper (section 7, after Anil et al. 2022): run the same prompt from several random
s_0 and compare, per token, the spread of its final states across starts with how far apart
*different* tokens' final states are. A path-independent model has spread << separation.

    spread[t]     = mean over pairs of starts (a, b) of ‖f_a[t] − f_b[t]‖
    separation[t] = min over other positions t' of ‖mean_a f_a[t] − mean_a f_a[t']‖
    ratio[t]      = spread[t] / separation[t]     (< 1: the token's final state is identifiable)

f are the final ln_f-normalised states. The chosen tokens' whole paths are kept for overlay plots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from recurrent_depth.analysis.trajectory import iterate_states
from recurrent_depth.config import is_real


@dataclass
class PathIndependence:
    """seeds [K]; finals [K, T, h]; spread, separation, ratio [T]; paths {position: [K, S+1, h]}."""

    seeds: list[int]
    finals: np.ndarray
    spread: np.ndarray
    separation: np.ndarray
    ratio: np.ndarray
    paths: dict[int, np.ndarray]
    init_scale: float

    def summary(self) -> dict:
        return {
            "num_starts": len(self.seeds),
            "seeds": list(self.seeds),
            "init_scale": self.init_scale,
            "median_spread": float(np.median(self.spread)),
            "median_separation": float(np.median(self.separation)),
            "median_ratio": float(np.median(self.ratio)),
            "max_ratio": float(np.max(self.ratio)),
            "fraction_ratio_below_1": float(np.mean(self.ratio < 1.0)),
        }


def spread_and_separation(finals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """From final states [K, T, h] (K >= 2, T >= 2): spread [T] and separation [T] as defined above."""
    finals = np.asarray(finals, dtype=np.float64)
    if finals.ndim != 3 or finals.shape[0] < 2 or finals.shape[1] < 2:
        raise ValueError(f"finals must be [starts >= 2, tokens >= 2, hidden], got shape {finals.shape}")
    K, T, _ = finals.shape
    # (summed start by start: a list of the K(K-1)/2 pair distances held ~1 GB at 1000 starts)
    total = np.zeros(T)
    for a in range(K - 1):
        total += np.linalg.norm(finals[a + 1:] - finals[a], axis=-1).sum(axis=0)
    spread = total / (K * (K - 1) / 2)
    centre = finals.mean(axis=0)  # [T, h]
    sq = np.einsum("th,th->t", centre, centre)
    dist2 = sq[:, None] + sq[None, :] - 2 * centre @ centre.T
    dist = np.sqrt(np.clip(dist2, 0.0, None))
    np.fill_diagonal(dist, np.inf)
    return spread, dist.min(axis=1)


def fixed_start_reason(model: torch.nn.Module) -> str | None:
    """Why every run of `model` starts from the same s_0 (so path independence holds trivially), or None."""
    state_init = getattr(getattr(model, "config", None), "state_init", "random")
    if state_init == "random":
        return None
    return f"this model starts every run from its embedding (state_init={state_init!r}, as Ouro), not a random s_0"


def path_independence(
    model: torch.nn.Module,
    input_ids: Tensor,
    num_steps: int,
    *,
    seeds: list[int],
    positions: list[int] | None = None,
    attention_mask: Tensor | None = None,
    row: int = 0,
    init_scale: float | None = None,
    progress: bool = False,
) -> PathIndependence:
    """Run `num_steps` from one random s_0 per seed and measure path independence for row `row`.

    init_scale: the scale of the random starts (> 0); None = the model config's, as the model's forward.

    positions: indices among the row's real tokens whose full normed paths to keep (for plots).
    progress: show a progress bar over all starts' steps.
    """
    if len(seeds) < 2 or len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds must hold at least 2 distinct seeds, got {seeds!r}")
    reason = fixed_start_reason(model)
    if reason is not None:
        raise ValueError(f"path independence needs random starts: {reason}")
    if init_scale is None:
        init_scale = getattr(model.config, "init_scale", 1.0)
    if not is_real(init_scale) or init_scale <= 0:
        raise ValueError(
            f"init_scale={init_scale!r} is invalid: path independence needs random starts (a finite number > 0)"
        )
    batch = input_ids.shape[0] if isinstance(input_ids, Tensor) and input_ids.dim() == 2 else 0
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < batch:
        raise ValueError(f"row={row!r} is out of range: input_ids has batch size {batch}")
    valid = np.arange(input_ids.shape[1])
    if attention_mask is not None:
        valid = np.flatnonzero(attention_mask[row].cpu().numpy())
    keep = list(dict.fromkeys(positions or []))  # a repeated position would stack its paths twice
    for p in keep:
        if not 0 <= p < len(valid):
            raise ValueError(f"position {p} is out of range: the row has {len(valid)} real tokens")
    finals, paths = [], {p: [] for p in keep}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(seeds) * (num_steps + 1), desc="path independence", unit="step",
                   disable=None)  # bars on a terminal only, not in pipes and logs
    for seed in seeds:
        path_steps = []
        for state, _ in iterate_states(
            model, input_ids, num_steps, attention_mask=attention_mask, init_scale=init_scale, seed=seed
        ):
            if bar is not None:
                bar.update()
            normed = state.normed[row, valid].float().cpu().numpy()  # [T_row, h]
            if keep:
                path_steps.append(normed[keep])
        finals.append(normed)
        for j, p in enumerate(keep):
            paths[p].append(np.stack([s[j] for s in path_steps]))
    if bar is not None:
        bar.close()
    final_arr = np.stack(finals)
    spread, separation = spread_and_separation(final_arr)
    # A token whose final state coincides with another's is not identifiable, whatever its spread: inf. (Dividing
    # by the smallest float instead gave 0 for a collapsed model, whose every start ends in one shared state, and
    # the report called every token identifiable.)
    ratio = np.divide(spread, separation, out=np.full_like(spread, np.inf), where=separation > 0)
    return PathIndependence(
        seeds=list(seeds), finals=final_arr, spread=spread, separation=separation, ratio=ratio,
        paths={p: np.stack(v) for p, v in paths.items()}, init_scale=float(init_scale),
    )
