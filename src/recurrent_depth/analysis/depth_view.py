"""Depth-scaling view: what the model would predict if it stopped after each step.

From the per-step predictions a `Trajectory` records (entropy and top token of
the model's readout of s_i for i = 0..S) this answers "where does the model change its mind?": the step
after which each token's top prediction no longer changes, and the predictions at a few depths.
"""

from __future__ import annotations

import numpy as np

from recurrent_depth.analysis.trajectory import Trajectory


def _require_predictions(traj: Trajectory) -> None:
    if traj.top_ids is None or traj.entropy is None or traj.top_probs is None:
        raise ValueError("the trajectory has no predictions: collect it with with_predictions=True")


def prediction_arrays(traj: Trajectory, row: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """entropy, top_ids, top_probs of one row's real tokens, each [T_row, S+1] (tokens down)."""
    _require_predictions(traj)
    pos = traj.positions(row)
    return tuple(np.asarray(a[:, row, pos]).T for a in (traj.entropy, traj.top_ids, traj.top_probs))


def settling_step(top_ids: np.ndarray) -> np.ndarray:
    """Per token, the first step from which the top prediction never changes again: [T] int64.

    top_ids: [T, S+1]. 0 means the prediction at s_0 already equals the final one throughout.
    """
    top_ids = np.asarray(top_ids)
    if top_ids.ndim != 2 or top_ids.shape[1] == 0:
        raise ValueError(f"top_ids must be [tokens, steps+1], got shape {top_ids.shape}")
    same_as_final = top_ids == top_ids[:, -1:]
    stays = np.flip(np.logical_and.accumulate(np.flip(same_as_final, axis=1), axis=1), axis=1)
    return np.argmax(stays, axis=1).astype(np.int64)  # the last column is always True


def change_points(top_ids: np.ndarray) -> list[list[int]]:
    """Per token, the steps i >= 1 at which the top prediction differs from step i-1."""
    top_ids = np.asarray(top_ids)
    changed = top_ids[:, 1:] != top_ids[:, :-1]
    return [(np.flatnonzero(c) + 1).tolist() for c in changed]


def report_steps(num_steps: int) -> list[int]:
    """Depths at which to tabulate predictions: 0, 1, 2, 4, 8, ... and the last step."""
    steps = [0]
    s = 1
    while s < num_steps:
        steps.append(s)
        s *= 2
    if num_steps > 0:
        steps.append(num_steps)
    return steps
